"""Decoding and encoding vLLM's ready response, across vLLM versions."""

from __future__ import annotations

import math

import msgspec
import pytest

from protocol import EngineCoreReadyResponse, InvalidPayload, decode_ready_response, encode_ready_response
from tests.support import case_names, fixture_bytes


class VllmReadyResponse(msgspec.Struct):
    """vLLM's own decoder for the newest wire form: required fields, then ones with defaults."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dp_stats_address: str | None
    dtype: str
    vllm_version: str
    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    supports_lora: bool
    max_loras: int
    mamba_block_size: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_events_config: dict | None = None
    weight_transfer_backend: str | None = None
    enable_sleep_mode: bool = False
    supports_draft_weight_updates: bool = False


@pytest.mark.parametrize("name", case_names())
def test_every_fixture_decodes_the_same_from_msgpack_and_json(name: str) -> None:
    from_msgpack = decode_ready_response(fixture_bytes(name))
    from_json = decode_ready_response(fixture_bytes(name, "json"), "json")
    assert from_msgpack == from_json
    assert from_msgpack.num_gpu_blocks > 0


@pytest.mark.parametrize("name", case_names())
def test_encoding_keeps_exactly_the_known_keys_the_engine_sent(name: str) -> None:
    sent = msgspec.msgpack.decode(fixture_bytes(name))
    encoded = msgspec.msgpack.decode(encode_ready_response(decode_ready_response(fixture_bytes(name))))
    known = set(EngineCoreReadyResponse.__struct_fields__)
    assert encoded == {key: value for key, value in sent.items() if key in known}


def test_vllm_decoder_accepts_what_we_encode() -> None:
    response = decode_ready_response(fixture_bytes("hybrid-with-kv-events-config"))
    decoded = msgspec.msgpack.decode(encode_ready_response(response), type=VllmReadyResponse)
    assert (decoded.block_size, decoded.mamba_block_size) == (1056, 1056)
    assert decoded.kv_events_config is not None
    assert decoded.kv_events_config["buffer_steps"] == 10000


def test_old_forms_leave_newer_fields_absent_not_none() -> None:
    oldest = decode_ready_response(fixture_bytes("minimal-pre42967"))
    assert oldest.block_size is msgspec.UNSET
    assert oldest.mamba_block_size is msgspec.UNSET
    pre_mamba = decode_ready_response(fixture_bytes("hybrid-tp1-pre50809"))
    assert pre_mamba.mamba_block_size is msgspec.UNSET
    dense = decode_ready_response(fixture_bytes("dense-post50809"))
    assert dense.mamba_block_size is None


def test_unknown_fields_from_newer_engines_are_ignored() -> None:
    response = decode_ready_response(fixture_bytes("hybrid-future-extra-fields"))
    assert response.block_size == 1056
    assert "some_future_field" not in msgspec.msgpack.decode(encode_ready_response(response))


def _payload(**changes: object) -> bytes:
    document = msgspec.msgpack.decode(fixture_bytes("hybrid-tp1-post50809"))
    document.update(changes)
    return msgspec.msgpack.encode(document)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"block_size": 0}, "$.block_size"),
        ({"block_size": "1056"}, "$.block_size"),
        ({"mamba_block_size": -16}, "$.mamba_block_size"),
        ({"num_gpu_blocks": -1}, "$.num_gpu_blocks"),
        ({"max_model_len": 0}, "$.max_model_len"),
        ({"kv_cache_max_concurrency": math.nan}, "$.kv_cache_max_concurrency"),
        ({"kv_cache_max_concurrency": math.inf}, "$.kv_cache_max_concurrency"),
        ({"kv_cache_size_tokens": 1 << 62}, "$.kv_cache_size_tokens"),
        ({"instance_id": "x" * 10_000}, "$.instance_id"),
        ({"data_parallel_rank": -1}, "$.data_parallel_rank"),
        ({"kv_events_config": {"buffer_steps": "many"}}, "$.kv_events_config.buffer_steps"),
        ({"num_gpu_blocks": None}, "$.num_gpu_blocks"),
    ],
)
def test_impossible_values_are_refused_with_their_path(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidPayload) as refused:
        decode_ready_response(_payload(**changes))
    assert refused.value.field == field
    assert not refused.value.malformed


@pytest.mark.parametrize("missing", ["max_model_len", "num_gpu_blocks"])
def test_the_two_fields_every_version_sends_are_required(missing: str) -> None:
    document = msgspec.msgpack.decode(fixture_bytes("minimal-pre42967"))
    del document[missing]
    with pytest.raises(InvalidPayload) as refused:
        decode_ready_response(msgspec.msgpack.encode(document))
    assert missing in refused.value.reason


@pytest.mark.parametrize("payload", [b"", b"\xc1", fixture_bytes("hybrid-tp1-post50809")[:-3]])
def test_broken_msgpack_is_malformed(payload: bytes) -> None:
    with pytest.raises(InvalidPayload) as refused:
        decode_ready_response(payload)
    assert refused.value.malformed
