"""``vllm.v1.engine.core.EngineCoreProc`` of vLLM 0.32.0: the method the plugin wraps in the engine core.

vLLM's ``EngineCoreProc.__init__`` loads the model and sets up the KV cache, so
neither this stand-in nor the tests call it: they set the attributes that
``_make_ready_response`` reads (``vllm_config``, ``scheduler``, ``model_executor``,
``frontend_stats_publish_address``, ``engine_index``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import EngineCoreReadyResponse

VLLM_VERSION = "0.32.0"


class EngineCoreProc:
    """The engine core of one engine, in its own process."""

    vllm_config: Any
    scheduler: Any
    model_executor: Any
    frontend_stats_publish_address: str | None
    engine_index: int

    def _make_ready_response(self) -> EngineCoreReadyResponse:
        parallel_config = self.vllm_config.parallel_config
        scheduler_config = self.vllm_config.scheduler_config
        cache_config = self.vllm_config.cache_config
        lora_config = self.vllm_config.lora_config
        weight_transfer_config = self.vllm_config.weight_transfer_config
        return EngineCoreReadyResponse(
            max_model_len=self.vllm_config.model_config.max_model_len,
            num_gpu_blocks=cache_config.num_gpu_blocks or 0,
            block_size=cache_config.block_size,
            mamba_block_size=cache_config.mamba_block_size,
            effective_attention_block_size=cache_config.effective_attention_block_size,
            dp_stats_address=self.frontend_stats_publish_address,
            dtype=str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            vllm_version=VLLM_VERSION,
            world_size=parallel_config.world_size,
            data_parallel_size=parallel_config.data_parallel_size,
            kv_cache_size_tokens=cache_config.kv_cache_size_tokens,
            kv_cache_max_concurrency=cache_config.kv_cache_max_concurrency,
            tensor_parallel_size=parallel_config.tensor_parallel_size,
            pipeline_parallel_size=parallel_config.pipeline_parallel_size,
            decode_context_parallel_size=parallel_config.decode_context_parallel_size,
            data_parallel_rank=self.engine_index,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            instance_id=self.vllm_config.instance_id,
            supports_lora=lora_config is not None,
            max_loras=lora_config.max_loras if lora_config is not None else 0,
            kv_events_config=self.scheduler.get_kv_event_publisher_config(),
            weight_transfer_backend=weight_transfer_config.backend if weight_transfer_config is not None else None,
            enable_sleep_mode=self.vllm_config.model_config.enable_sleep_mode,
            supports_draft_weight_updates=(
                self.model_executor.supports_draft_weight_updates() if weight_transfer_config is not None else False
            ),
        )
