"""Arrays of ready responses (``changes.ready``): taken as if each response came alone and in order, at a cost
linear in their number whether they are clean, conflict or cross the byte budget. Driven on a writer batch
directly, with fake clocks (``tests/helpers/batches.py``)."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable

import pytest

from exporter.errors import LimitExceeded
from exporter.exposition.lines import ReplicaLines
from exporter.state import changes
from exporter.state.changes import EngineReady, Rules
from exporter.state.limits import ByteBudget, Limits
from exporter.state.ready_arrays import Measured, crossing
from exporter.state.replicas import Replica
from protocol import SyncConflict
from tests.helpers.batches import CONFLICTING, KEY, RANK0, RANK1, Clock, Fleet, ready

# A large data-parallel server's start, as one array (the limit is 1,024).
ENGINES = 980
ENGINE_BYTES = 100
# Seconds a timing may be off on a machine shared with other jobs (the old code's took seconds).
NOISE = 0.05


def rules(limits: Limits | None = None, measure: Callable[[Replica], int] | None = None) -> Rules:
    limits = limits or Limits()
    budget = ByteBudget(limits.bytes, measure) if limits.bytes is not None and measure is not None else None
    return Rules({}, limits, Clock(1_800_000_000.0), Clock(5_000.0), budget)


def engine(rank: int, payload: bytes = RANK0, size: int = 1024, **changed: object) -> EngineReady:
    return ready(rank, payload, data_parallel_rank=rank, data_parallel_size=size, **changed)


def server_start(conflicting_last: bool = False) -> list[EngineReady]:
    array = [engine(rank) for rank in range(ENGINES)]
    if conflicting_last:
        array[-1] = engine(ENGINES - 1, CONFLICTING)
    return array


def linear_measure(replica: Replica) -> int:
    return ENGINE_BYTES * len(replica.engines)


def counted(function: Callable[..., object], calls: list[object]) -> Callable[..., object]:
    def counting(*arguments: object, **keywords: object) -> object:
        calls.append(arguments)
        return function(*arguments, **keywords)

    return counting


def seconds_of(array: list[EngineReady], repeats: int = 5, **given: object) -> float:
    """The least time, of ``repeats``, that a fresh fleet takes to take ``array`` (the collector held off: the
    arrays' own cost, not a collection's that falls into it)."""
    times = []
    for _ in range(repeats):
        fleet = Fleet(rules(**given))  # type: ignore[arg-type]
        gc.disable()
        try:
            started = time.perf_counter()
            fleet.ready(KEY, *array)
            times.append(time.perf_counter() - started)
        finally:
            gc.enable()
    return min(times)


def test_an_array_whose_last_engine_conflicts_is_synced_once_like_a_clean_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    builds: list[object] = []
    monkeypatch.setattr(changes, "build_replica", counted(changes.build_replica, builds))
    fleet = Fleet(rules())
    outcome = fleet.ready(KEY, *server_start(conflicting_last=True))
    assert len(builds) == 1, f"{len(builds)} syncs of the replica for one array"
    assert list(outcome.refused) == [ENGINES - 1] and isinstance(outcome.refused[ENGINES - 1], SyncConflict)
    assert outcome.refused[ENGINES - 1].field == "$.dp_stats_address"
    assert len(fleet.replicas[KEY].engines) == ENGINES - 1


def test_a_conflict_costs_the_writer_no_more_than_a_clean_array() -> None:
    clean = seconds_of(server_start())
    conflicting = seconds_of(server_start(conflicting_last=True))
    assert conflicting <= 2 * clean + NOISE, f"clean {clean:.3f} s, the last engine conflicting {conflicting:.3f} s"


def test_a_large_array_costs_about_ten_times_a_tenth_of_it() -> None:
    """Linear in the entries: the agreement of each engine is not checked against every engine before it."""
    tenth = seconds_of(server_start()[: ENGINES // 10])
    whole = seconds_of(server_start())
    assert whole <= 20 * tenth + NOISE, f"{ENGINES // 10} engines {tenth:.4f} s, {ENGINES} engines {whole:.4f} s"


def test_an_array_past_the_budget_is_measured_a_few_times_not_once_per_engine() -> None:
    measured: list[object] = []
    budget = ENGINE_BYTES * 451 + 50  # room for 451 engines
    fleet = Fleet(rules(Limits(bytes=budget), counted(linear_measure, measured)))  # type: ignore[arg-type]
    outcome = fleet.ready(KEY, *server_start())
    assert len(measured) <= 4, f"{len(measured)} measures of the replica for one array"
    assert set(fleet.replicas[KEY].engines) == set(range(451))
    assert set(outcome.refused) == set(range(451, ENGINES))
    assert all(isinstance(error, LimitExceeded) and error.field == "bytes" for error in outcome.refused.values())
    assert fleet.census.bytes == ENGINE_BYTES * 451


def test_crossing_the_budget_costs_the_writer_about_what_a_clean_array_costs() -> None:
    lines = ReplicaLines()

    def measure(replica: Replica) -> int:
        return lines.size(replica)

    clean = seconds_of(server_start(), limits=Limits(bytes=10**9), measure=measure)
    crossed = seconds_of(server_start(), limits=Limits(bytes=1_300_000), measure=measure)
    assert crossed <= 3 * clean + NOISE, f"clean {clean:.3f} s, crossing the budget {crossed:.3f} s"


SIZES = {
    "even": lambda taken: 1_000 + 100 * taken,
    "growing faster": lambda taken: taken * taken,
    "one large response first": lambda taken: 10_000_000 * (taken > 0) + taken,
    "one large response last": lambda taken: taken + 10_000_000 * (taken == 1024),
    "steps": lambda taken: 5_000 * (taken // 100),
}


@pytest.mark.parametrize("size_of", SIZES.values(), ids=SIZES.keys())
def test_the_cut_is_found_in_about_two_log2_measures_whatever_the_sizes(size_of: Callable[[int], int]) -> None:
    """Where an array of 1,024 crosses the budget: one taken fits, one more does not, within 2 log2 1,024 + 2."""
    measured: list[int] = []

    def measure(most: int) -> Measured:
        measured.append(most)
        return Measured(most, None, size_of(most))

    for room in range(size_of(0), size_of(1024), max(1, (size_of(1024) - size_of(0)) // 97)):
        measured.clear()
        fits, crosses = crossing(measure(0), measure(1024), room, measure)
        assert crosses.most == fits.most + 1 and fits.size <= room < crosses.size
        assert len(measured) - 2 <= 22, f"{len(measured) - 2} measures for room {room}"


# As if each came alone: arrays against the same responses sent one by one ---------------------------------

PAYLOADS = (RANK0, RANK1, CONFLICTING)


def random_array(chooser: random.Random) -> list[EngineReady]:
    """Up to 12 responses of engines 0-5: repeated engines, conflicts, restarts (a new instance) anywhere."""
    array = []
    for _ in range(chooser.randint(1, 12)):
        rank = chooser.randrange(6)
        instance = chooser.choice(("a", "a", "a", "b", "c"))
        array.append(engine(rank, chooser.choice(PAYLOADS), size=6, instance_id=instance))
    return array


def in_turn(fleet: Fleet, array: list[EngineReady]) -> dict[int, type[Exception]]:
    """Take the array one response at a time: what each engine's last refusal was, unless taken later."""
    refused: dict[int, type[Exception]] = {}
    for report in array:
        error = fleet.ready(KEY, report).refused.get(report.engine)
        if error is None:
            refused.pop(report.engine, None)
        else:
            refused[report.engine] = type(error)
    return refused


@pytest.mark.parametrize("seed", range(4))
def test_random_arrays_are_taken_as_their_responses_one_by_one_would_be(seed: int) -> None:
    chooser = random.Random(seed)
    for _ in range(50):
        limits = Limits(engines_per_replica=chooser.randint(2, 6))
        before, array = random_array(chooser), random_array(chooser)
        together, alone = Fleet(rules(limits)), Fleet(rules(limits))
        for fleet in (together, alone):
            in_turn(fleet, before)
        outcome = together.ready(KEY, *array)
        expected = in_turn(alone, array)
        assert {engine: type(error) for engine, error in outcome.refused.items()} == expected, array
        mine, theirs = together.replicas.get(KEY), alone.replicas.get(KEY)
        assert (mine is None) == (theirs is None)
        if mine is not None and theirs is not None:
            assert (mine.instance_id, mine.synced) == (theirs.instance_id, theirs.synced)
            assert {e: r.payload for e, r in mine.engines.items()} == {e: r.payload for e, r in theirs.engines.items()}
        assert _stored_rows(together) == {e: r.payload for e, r in (mine.engines.items() if mine else ())}


def _stored_rows(fleet: Fleet) -> dict[int, bytes]:
    """The engine rows the recorded store calls leave for ``KEY``, in order."""
    rows: dict[int, bytes] = {}
    for name, arguments in fleet.store.calls:
        if name == "delete_engines" and arguments[:2] == KEY:
            rows.clear()
        elif name == "save_engine" and arguments[:2] == KEY:
            rows[arguments[2]] = arguments[3].payload
    return rows


def test_with_sizes_that_grow_with_each_engine_the_budget_refuses_what_one_by_one_would() -> None:
    budget = ENGINE_BYTES * 7
    array = [engine(rank, size=12) for rank in range(12)]
    together = Fleet(rules(Limits(bytes=budget), linear_measure))
    alone = Fleet(rules(Limits(bytes=budget), linear_measure))
    outcome = together.ready(KEY, *array)
    expected = in_turn(alone, array)
    assert {engine: type(error) for engine, error in outcome.refused.items()} == expected
    assert set(together.replicas[KEY].engines) == set(alone.replicas[KEY].engines) == set(range(7))
    crossing = outcome.refused[7]
    assert isinstance(crossing, LimitExceeded) and f"{ENGINE_BYTES * 8} bytes" in str(crossing)
