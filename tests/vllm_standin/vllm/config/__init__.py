"""``vllm.config``: a package in vLLM, re-exporting its config classes."""

from vllm.config.cache import CacheConfig

__all__ = ["CacheConfig"]
