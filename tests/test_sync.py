"""The sync rules: vLLM's ``_apply_ready_response`` without its weaknesses."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from protocol import (
    CacheConfig,
    EngineCoreReadyResponse,
    InvalidPayload,
    SyncConflict,
    check_engine_index,
    decode_ready_response,
    render_labels,
    sync,
)
from tests.support import cases, fixture_bytes

# A base that differs from every fixture, so "<base>" can only come from the base.
BASE = CacheConfig(block_size=64, mamba_block_size=2048, mamba_cache_mode="align")


def response(name: str) -> EngineCoreReadyResponse:
    return decode_ready_response(fixture_bytes(name))


def engine_of(name: str) -> int:
    rank = response(name).data_parallel_rank
    return rank if isinstance(rank, int) else 0


def apply_in_order(names: list[str]) -> dict[int, EngineCoreReadyResponse]:
    """What the exporter keeps for a deployment after these payloads arrive in this order."""
    engines: dict[int, EngineCoreReadyResponse] = {}
    for name in names:
        engines[engine_of(name)] = response(name)
    return engines


def expected_cases() -> list[dict]:
    return [case for case in cases() if case["expect"] and not case["expect"].get("reject")]


@pytest.mark.parametrize("case", expected_cases(), ids=lambda case: case["name"])
def test_fixture_expectations(case: dict) -> None:
    expect = dict(case["expect"])
    steps = expect.pop("after", [case["name"]])
    labels = render_labels(sync(BASE, apply_in_order(steps)).config)
    base_labels = render_labels(BASE)
    for label, value in expect.items():
        if value is None:
            continue
        assert labels[label] == (base_labels[label] if value == "<base>" else value), label


@pytest.mark.parametrize(
    "case", [case for case in cases() if case["expect"] and case["expect"].get("reject")], ids=lambda c: c["name"]
)
def test_fixture_rejections(case: dict) -> None:
    engines = apply_in_order(case["expect"]["after"])
    before = sync(BASE, engines)
    engines[engine_of(case["name"])] = response(case["name"])
    with pytest.raises(SyncConflict) as refused:
        sync(BASE, engines)
    assert refused.value.field == "$.dp_stats_address"
    assert before.config.num_gpu_blocks == 1997


def test_result_does_not_depend_on_arrival_order() -> None:
    first = response("dp2-rank0")
    second = msgspec.structs.replace(response("dp2-rank1"), block_size=528, mamba_block_size=528)
    results = {
        msgspec.json.encode(sync(BASE, dict(order))) for order in itertools.permutations([(0, first), (1, second)])
    }
    assert len(results) == 1


def test_a_resent_response_changes_nothing() -> None:
    engines = apply_in_order(["dp2-rank0", "dp2-rank1"])
    once = sync(BASE, engines)
    again = sync(BASE, apply_in_order(["dp2-rank0", "dp2-rank1", "dp2-rank0", "dp2-rank1"]))
    assert again == once
    assert again.config.num_gpu_blocks == 3994


def test_an_engine_that_re_reports_replaces_its_own_contribution() -> None:
    grown = msgspec.structs.replace(response("dp2-rank1"), num_gpu_blocks=2500)
    synced = sync(BASE, {0: response("dp2-rank0"), 1: grown})
    assert synced.config.num_gpu_blocks == 1997 + 2500


def test_max_model_len_is_the_smallest_engines() -> None:
    short = msgspec.structs.replace(response("dp2-rank1"), max_model_len=131072)
    assert sync(BASE, {0: response("dp2-rank0"), 1: short}).max_model_len == 131072


def test_missing_mamba_block_size_keeps_the_base_but_explicit_none_overrides_it() -> None:
    assert sync(BASE, {0: response("hybrid-tp1-pre50809")}).config.mamba_block_size == 2048
    assert sync(BASE, {0: response("dense-post50809")}).config.mamba_block_size is None


def test_disagreeing_block_sizes_pick_the_lowest_engine_and_are_counted() -> None:
    odd = msgspec.structs.replace(response("dp2-rank1"), block_size=528, mamba_block_size=528)
    synced = sync(BASE, {1: odd, 0: response("dp2-rank0")})
    assert synced.config.block_size == 1056
    assert synced.distinct_values == {"block_size": 2, "mamba_block_size": 2}
    agreeing = sync(BASE, apply_in_order(["dp2-rank0", "dp2-rank1"]))
    assert agreeing.distinct_values == {"block_size": 1, "mamba_block_size": 1}


def test_kv_cache_figures_are_per_engine_never_summed() -> None:
    synced = sync(BASE, apply_in_order(["dp2-rank1", "dp2-rank0"]))
    assert synced.config.kv_cache_size_tokens == 2108832
    assert synced.config.kv_cache_max_concurrency == 8.04


def test_block_size_is_resolved_only_when_an_engine_reported_it() -> None:
    assert sync(BASE, {0: response("minimal-pre42967")}).config.block_size_resolved is False
    assert sync(BASE, {0: response("minimal-pre42206")}).config.block_size_resolved is True


def test_no_engines_leaves_the_base() -> None:
    synced = sync(BASE, {})
    assert synced.config == BASE
    assert synced.max_model_len is None


def test_an_engine_index_outside_data_parallel_size_is_refused() -> None:
    with pytest.raises(InvalidPayload) as refused:
        check_engine_index(2, msgspec.structs.replace(response("dp2-rank1"), data_parallel_rank=msgspec.UNSET))
    assert refused.value.field == "$.data_parallel_rank"
    with pytest.raises(InvalidPayload):
        check_engine_index(0, response("dp2-rank1"))
    check_engine_index(1, response("dp2-rank1"))
    check_engine_index(7, response("minimal-pre42967"))
