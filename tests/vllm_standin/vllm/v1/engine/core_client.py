"""``vllm.v1.engine.core_client.MPClient`` of vLLM 0.32.0: the methods the plugin wraps, with vLLM's bodies.

vLLM's ``MPClient.__init__(self, asyncio_mode, vllm_config, executor_class, log_stats,
client_addresses=None, renderer=None)`` starts engine processes, so neither this
stand-in nor the tests call it: they set up the attributes it sets before it
applies the engines' ready responses, and before ``shutdown`` (its background
resources and the ``weakref.finalize`` that frees them once).
"""

from __future__ import annotations

import weakref
from typing import Any

import msgspec

from vllm.v1.engine import EngineCoreReadyResponse


class MPClient:
    """The frontend's client of its engine cores."""

    vllm_config: Any
    stats_update_address: str | None
    _effective_attention_block_sizes: set[int | None]
    _kv_event_sources: dict[int, Any]
    resources: Any
    _finalizer: weakref.finalize

    def shutdown(self, timeout: float | None = None) -> None:
        """Shutdown engine manager under timeout and clean up resources."""
        if self._finalizer.detach() is not None:
            if self.resources.engine_manager is not None:
                self.resources.engine_manager.shutdown(timeout=timeout)
            self.resources()

    def _apply_ready_response(self, payload: bytes) -> None:
        """Decode an EngineCoreReadyResponse and sync any post-initialization
        config changes (e.g. auto-fitted max_model_len) back to the frontend."""
        vllm_config = self.vllm_config
        response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse) if payload else None
        self._effective_attention_block_sizes.add(
            response.effective_attention_block_size if response is not None else None
        )
        sizes = self._effective_attention_block_sizes
        vllm_config.cache_config.effective_attention_block_size = next(iter(sizes)) if len(sizes) == 1 else None
        if response is None:
            return
        vllm_config.model_config.max_model_len = min(vllm_config.model_config.max_model_len, response.max_model_len)
        num_gpu_blocks = vllm_config.cache_config.num_gpu_blocks or 0
        num_gpu_blocks += response.num_gpu_blocks
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        cache_config = vllm_config.cache_config
        cache_config.block_size = response.block_size
        cache_config.mamba_block_size = response.mamba_block_size
        if cache_config.kv_cache_size_tokens is None:
            cache_config.kv_cache_size_tokens = response.kv_cache_size_tokens
        if cache_config.kv_cache_max_concurrency is None:
            cache_config.kv_cache_max_concurrency = response.kv_cache_max_concurrency
        if response.dp_stats_address is not None:
            if self.stats_update_address is None:
                self.stats_update_address = response.dp_stats_address
            else:
                assert response.dp_stats_address == self.stats_update_address
        if response.kv_events_config is not None:
            self._kv_event_sources[response.data_parallel_rank] = response.kv_events_config
