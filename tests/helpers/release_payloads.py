"""Ready responses exactly as each vLLM release's engine puts them on the wire.

vLLM's ``EngineCoreReadyResponse`` is a plain dataclass that
``msgspec.msgpack.encode`` writes as a map with every field in declaration
order. The dataclass of each release is rebuilt here from the release table
(field names, order and defaults read from the wheels), filled with the
figures of a hybrid model whose engine aligned its block size to 1056 while its
configured ``mamba_block_size`` stayed 16, and encoded the way vLLM encodes it.
The same table gives vLLM's own typed decoder of each release.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from protocol.releases import Release

HYBRID = {
    "max_model_len": 262144,
    "num_gpu_blocks": 1997,
    "block_size": 1056,
    "dp_stats_address": None,
    "dtype": "bfloat16",
    "world_size": 1,
    "data_parallel_size": 1,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "decode_context_parallel_size": 1,
    "data_parallel_rank": 0,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "instance_id": "3f2c1a7e9b0d4c55",
    "supports_lora": False,
    "max_loras": 0,
    # The engine core's copy: still the configured value, as with the multi-process executor.
    "mamba_block_size": 16,
    "kv_cache_size_tokens": 2108832,
    "kv_cache_max_concurrency": 8.04,
    "effective_attention_block_size": 1056,
    "config_hash": "9c1d",
}
# Types for vLLM's nested config classes, enough for a typed decode of the map they become.
_NAMESPACE = {"Any": Any, "KVEventsConfig": dict[str, Any], "PrefixHashConfig": dict[str, Any]}


def engine_labels(release: Release, **changes: str) -> dict[str, str]:
    """The ``metrics_info()`` a hybrid engine of ``release`` has (sent from 0.34 as ``cache_config_info``)."""
    return {**release.default_labels(), "mamba_cache_mode": "align", "mamba_block_size": "16", **changes}


def vllm_dataclass(release: Release) -> type:
    """The release's ``EngineCoreReadyResponse`` dataclass, with its real field order, types and defaults."""
    fields = []
    for field in release.ready_response.fields:
        annotation = eval(field.annotation, _NAMESPACE)  # the table's annotations are vLLM's own source text
        if field.required:
            fields.append((field.name, annotation))
        else:
            fields.append((field.name, annotation, dataclasses.field(default=field.default_value())))
    return dataclasses.make_dataclass("EngineCoreReadyResponse", fields)


def ready_payload(release: Release, **changes: Any) -> bytes:
    """What an engine of ``release`` sends: every field of its dataclass, as ``msgspec.msgpack.encode`` writes it."""
    values: dict[str, Any] = {**HYBRID, "vllm_version": release.version}
    if "cache_config_info" in release.field_names:
        values["cache_config_info"] = engine_labels(release)
    values.update(changes)
    return vllm_encode(release, values)


def vllm_encode(release: Release, values: dict[str, Any]) -> bytes:
    """``release``'s dataclass of the fields ``values`` has (the others at vLLM's defaults), encoded as vLLM does."""
    cls = vllm_dataclass(release)
    names = [field.name for field in dataclasses.fields(cls)]
    return msgspec.msgpack.encode(cls(**{name: values[name] for name in names if name in values}))


def vllm_decode(release: Release, payload: bytes) -> Any:
    """Decode ``payload`` with ``release``'s own decoder (``msgspec.msgpack.decode(payload, type=...)``)."""
    return msgspec.msgpack.decode(payload, type=vllm_dataclass(release))
