"""vLLM's ``EngineCoreReadyResponse``: the message an engine core sends once its KV cache is up.

The schema is the code: field order, names and wire types follow vLLM 0.34,
which encodes its dataclass with ``msgspec.msgpack.encode`` as a map keyed by
field name, every field present. Only the three fields of 0.20 are required;
every later field defaults to ``UNSET`` so that a decoded payload tells which
keys its engine sent (an absent key and an explicit ``None`` mean different
things to the sync). Unknown keys from newer engines are ignored here; the
exporter keeps the bytes as received, so nothing is lost. The free-form map
``vllm_config`` stays raw, a slice of those bytes: the sync never reads it, and
decoded it can take 70 times its size (a list of empty maps), so it is decoded
only to be shown. Of ``prefix_hash_config`` (0.34+) only the engine's resolved
``hash_block_size`` is decoded; its other keys are skipped.

Whatever an engine sends is shown as JSON, so a value JSON cannot show (a
msgpack extension, a map key that is an array, ``nil`` or a boolean) is refused,
under any key, naming its path.

One key is this project's own: ``cache_config_exporter_kv_cache_groups``, the
engine core's KV-cache groups, which the plugin adds to the response in the
engine-core process (vLLM's frontend ignores keys it does not know). It is the
ground truth of every group's block size; without it the sync falls back to rules.
"""

from __future__ import annotations

import itertools
import operator
import re
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from protocol.errors import InvalidPayload, MalformedPayload
from protocol.labels import MAX_LABEL_VALUE, MAX_LABELS, check_labels
from protocol.releases import newest

# Bounds that no real engine comes near; they turn corrupt or hostile numbers
# into a precise validation error instead of a nonsensical metric.
MAX_TOKENS = 1 << 40
MAX_BLOCKS = 1 << 40
MAX_BLOCK_SIZE = 1 << 24
MAX_PARALLEL = 1 << 16
MAX_TEXT = 256

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
# Bounded while decoding; names and the values the sync reads are checked after it, by ``check_labels``.
LabelValue = Annotated[str, Meta(max_length=MAX_LABEL_VALUE)]
Labels = Annotated[dict[str, LabelValue], Meta(max_length=MAX_LABELS)]


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
    # Token granularity at which prefix-cache hits land, as the engine core resolved it (vLLM 0.32+): a prompt
    # shorter than it never hits the prefix cache.
    cache_hit_alignment_tokens: Tokens | None = None

    def block_sizes(self, kind: str) -> list[int]:
        return [group.block_size for group in self.groups if group.kind == kind]


class PrefixHashConfig(msgspec.Struct, kw_only=True, frozen=True):
    """vLLM's ``PrefixHashConfig`` (0.34+): sent when the engine hashes prompt blocks (prefix caching or a KV
    connector), with the hash block size its engine core resolved. Its other keys (the hash algorithm, the
    ``none_hash`` bytes) are the frontend's business and skipped; a release without the size leaves it None."""

    hash_block_size: BlockSize | None = None


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
    vllm_config: msgspec.Raw | UnsetType = UNSET
    prefix_hash_config: PrefixHashConfig | UnsetType | None = UNSET
    cache_config_info: Labels | UnsetType | None = UNSET
    config_hash: Text | UnsetType | None = UNSET
    enable_expert_parallel: bool | UnsetType = UNSET
    kv_cache_groups: KVCacheGroups | UnsetType = msgspec.field(default=UNSET, name=KV_CACHE_GROUPS_KEY)

    def sent(self, name: str) -> bool:
        """True when the engine put this field on the wire (``None`` included)."""
        return getattr(self, name) is not UNSET

    def sent_keys(self) -> frozenset[str]:
        """vLLM's fields the engine put on the wire (known ones; unknown keys and the plugin's are not counted)."""
        return frozenset(itertools.compress(_VLLM_FIELDS, map(operator.is_not, _vllm_values(self), _UNSETS)))

    def reported(self, name: str) -> Any:
        """A field's value, ``None`` when the engine did not send it or sent ``None``."""
        value = getattr(self, name)
        return None if value is UNSET else value


_VLLM_FIELDS = tuple(name for name in EngineCoreReadyResponse.__struct_fields__ if name != "kv_cache_groups")
# The values of ``_VLLM_FIELDS`` of a response, read at C speed, and as many ``UNSET`` to compare them with.
_vllm_values = operator.attrgetter(*_VLLM_FIELDS)
_UNSETS = (UNSET,) * len(_VLLM_FIELDS)

MSGPACK = "msgpack"
JSON = "json"

_decoders: dict[str, Any] = {
    MSGPACK: msgspec.msgpack.Decoder(EngineCoreReadyResponse),
    JSON: msgspec.json.Decoder(EngineCoreReadyResponse),
}
_raw_decoders: dict[str, Any] = {MSGPACK: msgspec.msgpack.Decoder(), JSON: msgspec.json.Decoder()}
_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
# Map keys JSON shows (as strings); msgpack also allows arrays, nil and booleans.
_SHOWN_KEYS = (str, int, float, bytes)


def _not_shown(value: Any) -> tuple[str, str]:
    """The path of the first value in ``value`` that JSON cannot show, and why (the value is known to have one)."""
    pending: list[tuple[str, Any]] = [("$", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, bool) or not isinstance(key, _SHOWN_KEYS):
                    return path, f"a map key of type {type(key).__name__} cannot be shown as JSON"
                pending.append((f"{path}.{key}", inner))
        elif isinstance(item, list | tuple):
            pending.extend((f"{path}[{index}]", inner) for index, inner in enumerate(item))
        elif isinstance(item, msgspec.msgpack.Ext):
            return path, f"a msgpack extension (type {item.code}) cannot be shown as JSON"
    return "$", "it cannot be shown as JSON"


_FREE_FORM = ("vllm_config",)
# The first byte of a map or nil: msgpack's fixmap, map 16, map 32 and nil; JSON's ``{`` and ``null``.
_MAP_OR_NIL = {MSGPACK: frozenset([*range(0x80, 0x90), 0xDE, 0xDF, 0xC0]), JSON: frozenset(b"{n")}


def _check_free_form(response: EngineCoreReadyResponse, wire_format: str) -> None:
    """The free-form field stays raw, but must be a map (or null), as vLLM sends it."""
    for name in _FREE_FORM:
        raw = getattr(response, name)
        if raw is not UNSET and memoryview(raw)[:1].tobytes()[0] not in _MAP_OR_NIL[wire_format]:
            raise InvalidPayload(f"$.{name}", "expected a map or null")


def decode_ready_response(payload: bytes, wire_format: str = MSGPACK) -> EngineCoreReadyResponse:
    """Decode one ready response from msgpack (vLLM's wire format) or JSON.

    The whole payload must be well-formed and showable as JSON, unknown keys included: it is kept and shown as sent.
    """
    return decode_shown_ready_response(payload, wire_format)[0]


def decode_shown_ready_response(payload: bytes, wire_format: str = MSGPACK) -> tuple[EngineCoreReadyResponse, bytes]:
    """``decode_ready_response``, and the payload as JSON (what ``shown_as_json`` gives): the check that it can be
    shown encodes it anyway, so whoever measures or answers that view takes it from here, not by decoding again."""
    if not payload:
        raise MalformedPayload("$", "the body is empty: expected one ready response")
    try:
        if wire_format == MSGPACK:
            as_sent = _raw_decoders[MSGPACK].decode(payload)
            try:
                shown = _json_encoder.encode(as_sent)
            except TypeError:
                raise InvalidPayload(*_not_shown(as_sent)) from None
            del as_sent  # decoded, it may take 70 times its bytes: gone before the next step allocates
        else:
            _raw_decoders[JSON].decode(payload)
            shown = payload
        response: EngineCoreReadyResponse = _decoders[wire_format].decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:  # msgspec's depth guard, e.g. deeply nested values of an unknown (skipped) key
        raise MalformedPayload("$", "nested too deeply") from None
    _check_free_form(response, wire_format)
    if is_set(response.cache_config_info):
        check_labels(response.cache_config_info, "$.cache_config_info")
    return response, shown


def decode_accepted_ready_response(payload: bytes, wire_format: str = MSGPACK) -> EngineCoreReadyResponse:
    """A ready response ``decode_ready_response`` accepted before, decoded again: the typed decode alone.

    A holder of many responses can keep their bytes only (decoded, one takes about one and a half times its
    bytes again) and decode one when it needs its fields.
    """
    response: EngineCoreReadyResponse = _decoders[wire_format].decode(payload)
    return response


def shown_as_json(payload: bytes, wire_format: str = MSGPACK) -> msgspec.Raw:
    """The payload as JSON, unknown keys included (for showing what an engine sent); a JSON one as it came."""
    if wire_format == JSON:
        return msgspec.Raw(payload)
    return msgspec.Raw(_json_encoder.encode(_raw_decoders[MSGPACK].decode(payload)))


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
