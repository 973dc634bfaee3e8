"""``vllm.config.cache.CacheConfig`` of vLLM 0.32.0: its fields in order, defaults and ``metrics_info()``.

vLLM's class is a pydantic dataclass that validates; this one is a plain
dataclass with the same fields, so ``metrics_info()`` renders the same label
set, in the same order, with the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar


@dataclass
class CacheConfig:
    """Configuration for the KV cache."""

    DEFAULT_BLOCK_SIZE: ClassVar[int] = 16

    block_size: int | None = None
    user_specified_block_size: bool = field(default=False, init=False)
    kv_cache_layout: str | None = field(default=None, init=False)
    prefix_match_unit: int | None = None
    gpu_memory_utilization: float = 0.92
    cache_dtype: str = "auto"
    is_attention_free: bool = False
    num_gpu_blocks_override: int | None = None
    sliding_window: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    prefix_cache_retention_interval: int | None = 0
    kv_cache_dtype_skip_layers: list[str] = field(default_factory=list)
    mamba_page_size_padded: int | None = None
    skip_page_size_padded: int | None = None
    mamba_block_size: int | None = None
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_cache_mode: str = "none"
    enable_mamba_shared_prefix_checkpoint: bool = False
    replayssm_buffer_len: int = 16
    use_replayssm: bool = False
    use_kda_recoverssm: bool = field(default=False, init=False)
    num_gpu_blocks: int | None = field(default=None, init=False)
    num_cpu_blocks: int | None = field(default=None, init=False)
    effective_attention_block_size: int | None = field(default=None, init=False)
    kv_cache_size_tokens: int | None = field(default=None, init=False)
    kv_cache_max_concurrency: float | None = field(default=None, init=False)
    hash_block_size: int | None = field(default=None, init=False)
    cache_hit_alignment_tokens: int | None = field(default=None, init=False)
    kv_sharing_fast_prefill: bool = False
    swa_bounded_replay: bool = True
    kv_cache_memory_bytes: int | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"

    def metrics_info(self) -> dict[str, str]:
        # convert cache_config to dict(key: str, value: str) for prometheus
        # metrics info
        return {key: str(value) for key, value in self.__dict__.items()}

    _block_size_resolved: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        """Every field in ``__dict__`` in field order, as pydantic keeps them; then vLLM's block size default.

        A plain dataclass leaves the defaults of ``init=False`` fields on the class,
        where ``metrics_info()`` would not see them.
        """
        values = {config_field.name: getattr(self, config_field.name) for config_field in fields(self)}
        self.__dict__.clear()
        self.__dict__.update(values)
        self._block_size_resolved = True
        if self.block_size is None:
            self.block_size = self.DEFAULT_BLOCK_SIZE
        else:
            self.user_specified_block_size = True
