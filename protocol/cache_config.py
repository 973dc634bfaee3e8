"""vLLM's ``CacheConfig``: its fields, its defaults and its metric labels.

Labels are rendered exactly as vLLM's ``metrics_info()`` renders them, with
Python ``str()`` of each value (``None`` -> "None", ``True`` -> "True",
``[]`` -> "[]"), so dashboards built on ``vllm:cache_config_info`` keep working.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from protocol.errors import InvalidPayload
from protocol.ready_response import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_TOKENS, BlockSize, Text

OptionalCount = Annotated[int, Meta(ge=0, le=MAX_BLOCKS)] | None
OptionalBlockSize = BlockSize | None
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]
NonNegative = Annotated[float, Meta(ge=0.0, le=float(MAX_TOKENS))]
SkipLayers = Annotated[list[Text], Meta(max_length=1024)]
SmallInt = Annotated[int, Meta(ge=0, le=MAX_BLOCK_SIZE)]


class CacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The cache configuration of one deployment, with vLLM's defaults."""

    block_size: BlockSize = 16
    gpu_memory_utilization: Fraction = 0.92
    cache_dtype: Text = "auto"
    is_attention_free: bool = False
    num_gpu_blocks_override: OptionalCount = None
    sliding_window: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Text = "sha256"
    prefix_cache_retention_interval: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    prefix_match_unit: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = None
    kv_cache_memory_bytes: Annotated[int, Meta(ge=0, le=1 << 60)] | None = None
    kv_offloading_size: NonNegative | None = None
    kv_offloading_backend: Text = "native"
    kv_sharing_fast_prefill: bool = False
    kv_cache_dtype_skip_layers: SkipLayers = msgspec.field(default_factory=list)
    mamba_cache_dtype: Text = "auto"
    mamba_ssm_cache_dtype: Text = "auto"
    mamba_block_size: OptionalBlockSize = None
    mamba_cache_mode: Text = "none"
    mamba_page_size_padded: OptionalCount = None
    skip_page_size_padded: OptionalCount = None
    use_replayssm: bool = False
    replayssm_buffer_len: SmallInt = 16
    use_kda_recoverssm: bool = False
    user_specified_block_size: bool = False
    user_specified_mamba_block_size: bool = False
    num_gpu_blocks: OptionalCount = None
    num_cpu_blocks: OptionalCount = None
    kv_cache_size_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] | None = None
    kv_cache_max_concurrency: NonNegative | None = None
    block_size_resolved: bool = msgspec.field(default=False, name="_block_size_resolved")


def render_labels(config: CacheConfig) -> dict[str, str]:
    """Label values as vLLM renders them: ``str()`` of each field value, keyed by vLLM's field name."""
    return {field.encode_name: str(getattr(config, field.name)) for field in _FIELDS}


_FIELDS = msgspec.structs.fields(CacheConfig)
LABEL_NAMES = tuple(field.encode_name for field in _FIELDS)


def _update_type() -> type[msgspec.Struct]:
    """A struct with every CacheConfig field optional: a partial document that overrides a base."""
    fields = [
        (field.name, field.type | UnsetType, msgspec.field(default=UNSET, name=field.encode_name)) for field in _FIELDS
    ]
    return msgspec.defstruct("CacheConfigUpdate", fields, kw_only=True, forbid_unknown_fields=True)


CacheConfigUpdate = _update_type()


def set_fields(update: msgspec.Struct) -> dict[str, Any]:
    """The fields an update actually sets, by attribute name."""
    return {name: value for name in update.__struct_fields__ if (value := getattr(update, name)) is not UNSET}


def apply_update(base: CacheConfig, update: msgspec.Struct) -> CacheConfig:
    """``base`` with the fields that ``update`` sets replaced."""
    changes = set_fields(update)
    return msgspec.structs.replace(base, **changes) if changes else base


_update_decoders: dict[str, Any] = {
    "json": msgspec.json.Decoder(CacheConfigUpdate),
    "toml": msgspec.toml.decode,
    "yaml": msgspec.yaml.decode,
}


def decode_cache_config_update(data: bytes, document_format: str = "json") -> msgspec.Struct:
    """Decode a partial cache configuration (JSON, TOML or YAML); unknown fields are refused."""
    decoder = _update_decoders[document_format]
    try:
        if document_format == "json":
            return decoder.decode(data)
        return decoder(data, type=CacheConfigUpdate)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:
        raise InvalidPayload("$", "nested too deeply", malformed=True) from None
