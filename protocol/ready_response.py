"""vLLM's ``EngineCoreReadyResponse``: the message an engine core sends once its KV cache is up.

The schema is the code: field order, names and wire types follow vLLM, which
encodes the struct with ``msgspec.msgpack.encode`` as a map keyed by field name.
Only ``max_model_len`` and ``num_gpu_blocks`` exist in every vLLM version; every
later field defaults to ``UNSET`` so that a decoded old payload re-encodes
without the keys it never had (an absent key and an explicit ``None`` mean
different things to the sync). Unknown keys from newer engines are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from protocol.errors import InvalidPayload

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
# NaN fails ``ge`` and infinity fails ``le``: both are rejected.
Concurrency = Annotated[float, Meta(ge=0.0, le=float(MAX_TOKENS))]


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


class EngineCoreReadyResponse(msgspec.Struct, kw_only=True):
    """One engine's ready response, in vLLM's wire order."""

    max_model_len: Tokens
    num_gpu_blocks: BlockCount
    block_size: BlockSize | UnsetType = UNSET
    dp_stats_address: Text | None = None
    dtype: Text | UnsetType = UNSET
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


MSGPACK = "msgpack"
JSON = "json"

_decoders: dict[str, Any] = {
    MSGPACK: msgspec.msgpack.Decoder(EngineCoreReadyResponse),
    JSON: msgspec.json.Decoder(EngineCoreReadyResponse),
}
_encoder = msgspec.msgpack.Encoder()


def decode_ready_response(payload: bytes, wire_format: str = MSGPACK) -> EngineCoreReadyResponse:
    """Decode one ready response from msgpack (vLLM's wire format) or JSON."""
    try:
        return _decoders[wire_format].decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:  # msgspec's depth guard, e.g. deeply nested values of an unknown (skipped) key
        raise InvalidPayload("$", "nested too deeply", malformed=True) from None


def encode_ready_response(response: EngineCoreReadyResponse) -> bytes:
    """Encode as vLLM does: a msgpack map keyed by field name (absent fields stay absent)."""
    return _encoder.encode(response)


def is_set(value: object) -> bool:
    """True for a value the engine actually reported (neither absent nor ``None``)."""
    return value is not UNSET and value is not None
