"""vLLM's ``vllm.v1.engine.core_client`` in miniature: the class, method and signature the plugin wraps."""

from __future__ import annotations

import msgspec

from vllm.config import VllmConfig


class MPClient:
    """The frontend's client of its engine cores."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.applied: list[bytes] = []

    def _apply_ready_response(self, payload: bytes) -> None:
        """Fold one engine's ready response into the frontend's cache config, as vLLM does."""
        response = msgspec.msgpack.decode(payload)
        cache_config = self.vllm_config.cache_config
        cache_config.num_gpu_blocks = (cache_config.num_gpu_blocks or 0) + response["num_gpu_blocks"]
        cache_config.block_size = response["block_size"]
        cache_config.mamba_block_size = response.get("mamba_block_size")
        cache_config._block_size_resolved = True
        self.applied.append(payload)
