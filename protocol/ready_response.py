"""vLLM's ``EngineCoreReadyResponse``: the message an engine core sends once its KV cache is up.

The schema is the code: field order, names and wire types follow vLLM 0.34,
which encodes its dataclass with ``msgspec.msgpack.encode`` as a map keyed by
field name, every field present. Only the three fields of 0.20 are required;
every later field defaults to ``UNSET`` so that a decoded payload tells which
keys its engine sent (an absent key and an explicit ``None`` mean different
things to the sync). Unknown keys from newer engines are ignored here; the
exporter keeps the bytes as received, so nothing is lost.

One key is this project's own: ``cache_config_exporter_kv_cache_groups``, the
engine core's KV-cache groups, which the plugin adds to the response in the
engine-core process (vLLM's frontend ignores keys it does not know). It is the
ground truth of every group's block size; without it the sync falls back to rules.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from protocol.errors import InvalidPayload, MalformedPayload
from protocol.releases import newest

# Bounds that no real engine comes near; they turn corrupt or hostile numbers
# into a precise validation error instead of a nonsensical metric.
MAX_TOKENS = 1 << 40
MAX_BLOCKS = 1 << 40
MAX_BLOCK_SIZE = 1 << 24
MAX_PARALLEL = 1 << 16
MAX_TEXT = 256
MAX_LABELS = 128
MAX_LABEL_VALUE = 4096

Text = Annotated[str, Meta(max_length=MAX_TEXT)]
Tokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
TokenCount = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
BlockCount = Annotated[int, Meta(ge=0, le=MAX_BLOCKS)]
BlockSize = Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
ParallelSize = Annotated[int, Meta(ge=1, le=MAX_PARALLEL)]
Rank = Annotated[int, Meta(ge=0, le=MAX_PARALLEL - 1)]
Port = Annotated[int, Meta(ge=0, le=65535)]
# NaN fails ``ge`` and infinity fails ``le``: both are rejected.
Concurrency = Annotated[float, Meta(ge=0.0, le=float(MAX_TOKENS))]
# vLLM names layers by their module path (``model.layers.0.self_attn.attn``).
MAX_LAYERS = 4096
MAX_GROUPS = 256
MAX_PAGE_BYTES = 1 << 48
LayerName = Annotated[str, Meta(max_length=MAX_TEXT)]
# A Prometheus label name that is not reserved (``__``) and not one the exporter adds itself.
LABEL_NAME_PATTERN = r"^(?!__)(?!(deployment|engine|replica)$)[a-zA-Z_][a-zA-Z0-9_]{0,127}$"
LabelName = Annotated[str, Meta(pattern=LABEL_NAME_PATTERN)]
LabelValue = Annotated[str, Meta(max_length=MAX_LABEL_VALUE)]
Labels = Annotated[dict[LabelName, LabelValue], Meta(max_length=MAX_LABELS)]


class KVEventsConfig(msgspec.Struct, kw_only=True):
    """vLLM's KVEventsConfig dataclass as it appears nested in a ready response."""

    enable_kv_cache_events: bool | UnsetType = UNSET
    publisher: Text | UnsetType = UNSET
    endpoint: Text | UnsetType = UNSET
    replay_endpoint: Text | UnsetType | None = UNSET
    buffer_steps: BlockCount | UnsetType = UNSET
    hwm: BlockCount | UnsetType = UNSET
    max_queue_size: BlockCount | UnsetType = UNSET
    topic: Text | UnsetType = UNSET


# The key under which the plugin adds the engine core's KV-cache groups to a ready response.
KV_CACHE_GROUPS_KEY = "cache_config_exporter_kv_cache_groups"
_WORD_START = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def spec_kind(spec: str) -> str:
    """A KV-cache spec class as a kind: snake case without ``Spec`` (``MLAAttentionSpec`` -> ``mla_attention``).

    A class this project has never heard of keeps its own name, so a new kind shows as what vLLM calls it.
    """
    return _WORD_START.sub("_", spec.removesuffix("Spec")).lower() or spec


class KVCacheGroup(msgspec.Struct, kw_only=True, frozen=True):
    """One of the engine core's KV-cache groups: layers that share one block table (vLLM's ``KVCacheGroupSpec``)."""

    # The class of the group's ``kv_cache_spec``; for ``UniformTypeKVCacheSpecs``, that of the layers' specs.
    spec: Text
    block_size: BlockSize
    page_size_bytes: Annotated[int, Meta(ge=0, le=MAX_PAGE_BYTES)]
    layers: Annotated[list[LayerName], Meta(max_length=MAX_LAYERS)]
    sliding_window: Tokens | None = None
    attention_chunk_size: Tokens | None = None
    # The group holds a speculative drafter's (EAGLE/MTP) layers.
    draft: bool = False
    # Blocks one request of max_model_len takes from the shared pool in this group, as the engine computed it.
    blocks_per_request: BlockCount | None = None

    @property
    def kind(self) -> str:
        return spec_kind(self.spec)


class KVCacheGroups(msgspec.Struct, kw_only=True, frozen=True):
    """The engine core's ``KVCacheConfig`` as the scheduler holds it after the KV cache is up."""

    num_blocks: BlockCount
    groups: Annotated[list[KVCacheGroup], Meta(max_length=MAX_GROUPS)]
    # Tokens per prefix-cache block hash, as the engine core resolved it (vLLM 0.32+).
    hash_block_size: BlockSize | None = None

    def block_sizes(self, kind: str) -> list[int]:
        return [group.block_size for group in self.groups if group.kind == kind]


class EngineCoreReadyResponse(msgspec.Struct, kw_only=True):
    """One engine's ready response, every field of vLLM 0.20-0.34 in wire order."""

    max_model_len: Tokens
    num_gpu_blocks: BlockCount
    block_size: BlockSize | UnsetType = UNSET
    dp_stats_address: Text | UnsetType | None = UNSET
    dtype: Text | UnsetType | None = UNSET
    vllm_version: Text | UnsetType = UNSET
    world_size: ParallelSize | UnsetType = UNSET
    data_parallel_size: ParallelSize | UnsetType = UNSET
    tensor_parallel_size: ParallelSize | UnsetType = UNSET
    pipeline_parallel_size: ParallelSize | UnsetType = UNSET
    decode_context_parallel_size: ParallelSize | UnsetType = UNSET
    data_parallel_rank: Rank | UnsetType = UNSET
    max_num_seqs: Tokens | UnsetType = UNSET
    max_num_batched_tokens: Tokens | UnsetType = UNSET
    instance_id: Text | UnsetType = UNSET
    supports_lora: bool | UnsetType = UNSET
    max_loras: Annotated[int, Meta(ge=0, le=MAX_PARALLEL)] | UnsetType = UNSET
    mamba_block_size: BlockSize | UnsetType | None = UNSET
    kv_cache_size_tokens: TokenCount | UnsetType | None = UNSET
    kv_cache_max_concurrency: Concurrency | UnsetType | None = UNSET
    kv_events_config: KVEventsConfig | UnsetType | None = UNSET
    weight_transfer_backend: Text | UnsetType | None = UNSET
    enable_sleep_mode: bool | UnsetType = UNSET
    supports_draft_weight_updates: bool | UnsetType = UNSET
    effective_attention_block_size: BlockSize | UnsetType | None = UNSET
    coord_store_port: Port | UnsetType = UNSET
    coordinator_input_address: Text | UnsetType | None = UNSET
    coordinator_output_address: Text | UnsetType | None = UNSET
    vllm_config: dict[str, Any] | UnsetType | None = UNSET
    prefix_hash_config: dict[str, Any] | UnsetType | None = UNSET
    cache_config_info: Labels | UnsetType | None = UNSET
    config_hash: Text | UnsetType | None = UNSET
    enable_expert_parallel: bool | UnsetType = UNSET
    kv_cache_groups: KVCacheGroups | UnsetType = msgspec.field(default=UNSET, name=KV_CACHE_GROUPS_KEY)

    def sent(self, name: str) -> bool:
        """True when the engine put this field on the wire (``None`` included)."""
        return getattr(self, name) is not UNSET

    def sent_keys(self) -> frozenset[str]:
        """vLLM's fields the engine put on the wire (known ones; unknown keys and the plugin's are not counted)."""
        return frozenset(name for name in _VLLM_FIELDS if self.sent(name))

    def reported(self, name: str) -> Any:
        """A field's value, ``None`` when the engine did not send it or sent ``None``."""
        value = getattr(self, name)
        return None if value is UNSET else value


_VLLM_FIELDS = tuple(name for name in EngineCoreReadyResponse.__struct_fields__ if name != "kv_cache_groups")

MSGPACK = "msgpack"
JSON = "json"
WIRE_FORMATS = (MSGPACK, JSON)

_decoders: dict[str, Any] = {
    MSGPACK: msgspec.msgpack.Decoder(EngineCoreReadyResponse),
    JSON: msgspec.json.Decoder(EngineCoreReadyResponse),
}
_raw_decoders: dict[str, Any] = {MSGPACK: msgspec.msgpack.Decoder(), JSON: msgspec.json.Decoder()}
_encoder = msgspec.msgpack.Encoder()


def decode_ready_response(payload: bytes, wire_format: str = MSGPACK) -> EngineCoreReadyResponse:
    """Decode one ready response from msgpack (vLLM's wire format) or JSON."""
    if not payload:
        raise MalformedPayload("$", "the body is empty: expected one ready response")
    try:
        # The whole payload must be well-formed, unknown keys included: it is kept and shown as sent.
        _raw_decoders[wire_format].decode(payload)
        return _decoders[wire_format].decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:  # msgspec's depth guard, e.g. deeply nested values of an unknown (skipped) key
        raise MalformedPayload("$", "nested too deeply") from None


def decode_as_sent(payload: bytes, wire_format: str = MSGPACK) -> Any:
    """The payload as a plain map, unknown keys included (for showing what an engine sent)."""
    return _raw_decoders[wire_format].decode(payload)


def encode_ready_response(response: EngineCoreReadyResponse) -> bytes:
    """Encode as vLLM 0.34 does: a msgpack map with every field, so every release's decoder accepts it.

    A field that is not set takes vLLM's default; one that vLLM requires and
    has no default for raises ``ValueError`` naming it.
    """
    message: dict[str, Any] = {}
    for field in newest().ready_response.fields:
        value = getattr(response, field.name, UNSET)
        if value is UNSET:
            if field.required:
                raise ValueError(f"{field.name} is required by vLLM's decoder (it has no default)")
            value = field.default_value()
        message[field.name] = value
    return _encoder.encode(message)


def is_set(value: object) -> bool:
    """True for a value the engine actually reported (neither absent nor ``None``)."""
    return value is not UNSET and value is not None
