"""The plugin's part in vLLM's engine-core process: the engine's own KV-cache groups, added to its ready response.

After ``EngineCore._initialize_kv_caches`` the engine core's scheduler holds
vLLM's ``KVCacheConfig``: per group its spec (class, block size, page size,
sliding window or attention chunk), its layers, and the block pool they share.
That is the ground truth of every block size; the ready response carries only
the smallest one, and a rule has to guess the rest.

``install()`` wraps ``EngineCoreProc._make_ready_response`` once, so that the
response the engine core builds carries one more field, ``KV_CACHE_GROUPS_KEY``.
vLLM's frontend decodes it into its own dataclass, which ignores a key it does
not know, and the plugin in the frontend forwards the bytes as received: the
groups reach the exporter inside the ready response of their own engine, under
its deployment, replica, engine index and run, with nothing else to deliver,
retry or expire. Anything unexpected leaves vLLM's response exactly as vLLM built it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

from protocol.ready_response import KV_CACHE_GROUPS_KEY, KVCacheGroup, KVCacheGroups

ENGINE_CORE = "vllm.v1.engine.core"
# Set on the wrapper: marks the method as patched.
PATCHED_ATTRIBUTE = "cache_config_exporter_kv_cache_groups"

logger = logging.getLogger("vllm.cache_config_exporter")


def _optional(read: Callable[[], Any]) -> Any:
    """A figure some specs lack or cannot compute (``NotImplementedError`` in vLLM's base class): ``None``."""
    try:
        value = read()
    except Exception:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _spec_class(spec: object) -> str:
    """The class of a group's spec; for vLLM's ``UniformTypeKVCacheSpecs`` wrapper, that of the layers' specs."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        classes = {type(layer_spec).__name__ for layer_spec in inner.values()}
        if len(classes) == 1:
            return classes.pop()
    return type(spec).__name__


def group_of(group: Any, vllm_config: Any) -> KVCacheGroup:
    """One ``KVCacheGroupSpec`` as the exporter's schema has it."""
    spec = group.kv_cache_spec
    page_size = _optional(lambda: spec.page_size_bytes)
    return KVCacheGroup(
        spec=_spec_class(spec),
        block_size=spec.block_size,
        page_size_bytes=page_size or 0,
        layers=list(group.layer_names),
        sliding_window=_optional(lambda: spec.sliding_window),
        attention_chunk_size=_optional(lambda: spec.attention_chunk_size),
        draft=bool(getattr(group, "is_eagle_group", False)),
        # What vLLM's get_max_concurrency_for_kv_cache_config adds up for one request of max_model_len.
        blocks_per_request=_optional(lambda: math.ceil(spec.max_memory_usage_bytes(vllm_config) / page_size)),
    )


def groups_of(kv_cache_config: Any, vllm_config: Any) -> KVCacheGroups:
    """The scheduler's ``KVCacheConfig``: its groups in vLLM's order, the shared pool's blocks, and what the engine
    core resolved for prefix caching (0.32+), which vLLM's frontend never learns."""
    return KVCacheGroups(
        num_blocks=kv_cache_config.num_blocks,
        groups=[group_of(group, vllm_config) for group in kv_cache_config.kv_cache_groups],
        hash_block_size=_optional(lambda: kv_cache_config.hash_block_size),
        cache_hit_alignment_tokens=_optional(lambda: kv_cache_config.cache_hit_alignment_tokens),
    )


def _log_groups(groups: KVCacheGroups) -> None:
    """Say in vLLM's log, from the engine-core process, what the ready response carries: an operator (and the
    real-vLLM test) can hold it against the exporter's series."""
    logger.info(
        "cache-config-exporter: the engine core's KV-cache config: %d blocks, group block sizes %s, "
        "hash_block_size %s, cache_hit_alignment_tokens %s",
        groups.num_blocks,
        tuple(group.block_size for group in groups.groups),
        groups.hash_block_size,
        groups.cache_hit_alignment_tokens,
    )


@functools.cache
def _extended(response_class: type) -> type:
    """vLLM's ready-response dataclass with the groups as one more field, encoded last by msgspec."""
    return dataclasses.make_dataclass(
        response_class.__name__,
        [(KV_CACHE_GROUPS_KEY, Any, dataclasses.field(default=None))],
        bases=(response_class,),
    )


def with_groups(response: Any, groups: KVCacheGroups) -> Any:
    """``response`` with every field as vLLM set it, plus the groups."""
    fields = {field.name: getattr(response, field.name) for field in dataclasses.fields(response) if field.init}
    return _extended(type(response))(**fields, **{KV_CACHE_GROUPS_KEY: groups})


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _make_ready_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = original(self, *args, **kwargs)
        try:
            groups = groups_of(self.scheduler.kv_cache_config, self.vllm_config)
            extended = with_groups(response, groups)
        except Exception as error:
            logger.warning("cache-config-exporter: cannot read the engine core's KV-cache groups: %r", error)
            return response
        _log_groups(groups)
        return extended

    setattr(_make_ready_response, PATCHED_ATTRIBUTE, True)
    return _make_ready_response


def install() -> None:
    """Wrap ``EngineCoreProc._make_ready_response`` once; a vLLM without it keeps the rule-based fallback."""
    try:
        engine_core = importlib.import_module(ENGINE_CORE)
    except Exception as error:
        logger.warning("cache-config-exporter: cannot import %s (%r); no KV-cache groups", ENGINE_CORE, error)
        return
    proc_class = getattr(engine_core, "EngineCoreProc", None)
    original = getattr(proc_class, "_make_ready_response", None)
    if not callable(original):
        logger.info("cache-config-exporter: this vLLM has no EngineCoreProc._make_ready_response; no KV-cache groups")
        return
    if not hasattr(original, PATCHED_ATTRIBUTE):
        proc_class._make_ready_response = _wrap(original)
