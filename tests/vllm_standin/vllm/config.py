"""vLLM's config classes in miniature: only what the frontend's ready-response handling reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheConfig:
    """vLLM's defaults for the fields the exporter knows, minus the newest ones (an older vLLM),
    plus ``swap_space``, which vLLM has and the exporter does not."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    swap_space: float = 4.0
    cache_dtype: str = "auto"
    is_attention_free: bool = False
    num_gpu_blocks_override: int | None = None
    sliding_window: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_dtype_skip_layers: list[str] = field(default_factory=list)
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    mamba_cache_mode: str = "none"
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    _block_size_resolved: bool = False


@dataclass
class ModelConfig:
    served_model_name: str | list[str] | None = None


@dataclass
class VllmConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
