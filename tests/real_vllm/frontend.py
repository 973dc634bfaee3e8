"""vLLM's frontend client as its ready-response handling needs it, and one engine's ready response.

Shared by the plugin's tests and by the stand-in's comparison with the real vLLM,
so that both drive the stand-in and the real package the same way. Imports no vLLM:
the caller passes the classes of the package it tests.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# A hybrid model's engine as vLLM 0.32 answers with the multi-process executor: the
# attention block raised to 1056 in the worker, the Mamba block size still the configured 16.
HYBRID_RESPONSE: dict[str, Any] = {
    "max_model_len": 4096, "num_gpu_blocks": 1997, "block_size": 1056, "dp_stats_address": None,
    "dtype": "torch.bfloat16", "vllm_version": "0.32.0", "world_size": 1, "data_parallel_size": 1,
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
    "data_parallel_rank": 0, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
    "instance_id": "5b7c1c4e", "supports_lora": False, "max_loras": 0, "mamba_block_size": 16,
    "kv_cache_size_tokens": 2108832, "kv_cache_max_concurrency": 514.85, "effective_attention_block_size": 1056,
}  # fmt: skip


def frontend_client(client_class: type, cache_config: Any, served_model_name: str | list[str] | None) -> Any:
    """An ``MPClient`` set up as its ``__init__`` sets it up before applying the engines' ready responses.

    ``__init__`` itself starts engine processes; vLLM's ``VllmConfig`` and ``ModelConfig``
    need a model on disk, so a namespace carries the two values read from them.
    """
    client = client_class.__new__(client_class)
    client.vllm_config = SimpleNamespace(
        cache_config=cache_config,
        model_config=SimpleNamespace(served_model_name=served_model_name, max_model_len=8192),
    )
    client.stats_update_address = None
    client._effective_attention_block_sizes = set()
    client._kv_event_sources = {}
    return client
