"""The caps and the byte budget (exporter/state/limits.py), each at its boundary, checked on a writer batch directly."""

from __future__ import annotations

from exporter.errors import LimitExceeded
from exporter.state import changes
from exporter.state.changes import Rules
from exporter.state.limits import ByteBudget, Limits
from exporter.state.replicas import Replica
from tests.helpers.batches import KEY, RANK1, Clock, Fleet, ready

# Every replica takes 100 bytes per engine: sizes a test can count.
ENGINE_BYTES = 100


def measure(replica: Replica) -> int:
    return ENGINE_BYTES * len(replica.engines)


def fleet_with(limits: Limits) -> Fleet:
    budget = ByteBudget(limits.bytes, measure) if limits.bytes is not None else None
    return Fleet(Rules({}, limits, Clock(1_800_000_000.0), Clock(0.0), budget))


def push(fleet: Fleet, key: tuple[str, str], *engines: int) -> changes.ReadyOutcome:
    return fleet.ready(key, *(ready(engine, RANK1) if engine else ready(0) for engine in engines))


def refused_field(outcome: changes.ReadyOutcome) -> str | None:
    errors = [error for error in outcome.refused.values() if isinstance(error, LimitExceeded)]
    return errors[0].field if errors else None


def test_a_deployment_holds_its_cap_of_replicas_and_no_more() -> None:
    fleet = fleet_with(Limits(replicas_per_deployment=2))
    assert refused_field(push(fleet, ("d", "r1"), 0)) is None
    assert refused_field(push(fleet, ("d", "r2"), 0)) is None
    assert refused_field(push(fleet, ("d", "r3"), 0)) == "replica"
    assert refused_field(push(fleet, ("d", "r2"), 0, 1)) is None  # an existing replica still changes
    assert refused_field(push(fleet, ("e", "r3"), 0)) is None  # the cap is per deployment
    assert fleet.run(changes.goodbye, ("d", "r1"))
    assert refused_field(push(fleet, ("d", "r3"), 0)) is None
    assert {key for key in fleet.replicas if key[0] == "d"} == {("d", "r2"), ("d", "r3")}


def test_two_new_replicas_of_one_batch_count_against_the_cap_together() -> None:
    fleet = fleet_with(Limits(replicas_per_deployment=2))
    push(fleet, ("d", "r1"), 0)
    batch = fleet.batch()
    first = changes.ready(fleet.rules, batch, ("d", "r2"), (ready(0),), None)
    second = changes.ready(fleet.rules, batch, ("d", "r3"), (ready(0),), None)
    assert (first.refused, refused_field(second)) == ({}, "replica")


def test_the_exporter_holds_its_cap_of_deployments_and_no_more() -> None:
    fleet = fleet_with(Limits(deployments=2))
    assert refused_field(push(fleet, ("a", "r"), 0)) is None
    assert refused_field(push(fleet, ("b", "r"), 0)) is None
    assert refused_field(push(fleet, ("c", "r"), 0)) == "deployment"
    assert refused_field(push(fleet, ("a", "other"), 0)) is None  # a new replica of a held deployment
    batch = fleet.batch()
    assert changes.delete_deployment(batch, "a")
    assert changes.ready(fleet.rules, batch, ("c", "r"), (ready(0),), None).refused == {}  # room within one batch
    assert refused_field(changes.ready(fleet.rules, batch, ("d", "r"), (ready(0),), None)) == "deployment"


def test_a_replica_holds_its_cap_of_engines_and_no_more() -> None:
    fleet = fleet_with(Limits(engines_per_replica=1))
    assert refused_field(push(fleet, KEY, 0, 1)) == "engine"
    assert set(fleet.replicas[KEY].engines) == {0}
    assert refused_field(push(fleet, KEY, 0)) is None  # the same engine again


def test_the_budget_boundary_one_byte_either_side() -> None:
    fleet = fleet_with(Limits(bytes=300))
    push(fleet, ("d", "r1"), 0, 1)
    assert refused_field(push(fleet, ("d", "r2"), 0)) is None  # exactly the budget: 300 of 300
    assert fleet.census.bytes == 300
    assert refused_field(push(fleet, ("d", "r2"), 0, 1)) == "bytes"  # 400 of 300
    assert fleet.census.bytes == 300
    fleet = fleet_with(Limits(bytes=299))
    push(fleet, ("d", "r1"), 0, 1)
    assert refused_field(push(fleet, ("d", "r2"), 0)) == "bytes"  # 300 of 299
    assert fleet.census.bytes == 200


def test_a_refusal_for_the_budget_names_the_flag_the_budget_and_the_bytes_in_use() -> None:
    fleet = fleet_with(Limits(bytes=300))
    push(fleet, ("d", "r1"), 0, 1)  # 200 in use
    crossing = push(fleet, ("d", "r2"), 0, 1, 2)  # the first fits (300 of 300), the second crosses, the third follows
    details = {engine: str(error) for engine, error in crossing.refused.items()}
    assert set(details) == {1, 2}
    for detail in details.values():
        assert "--limits.bytes" in detail and "budget of 300 bytes" in detail and "200 bytes in use now" in detail
    assert "to 400 bytes" in details[1]  # what the crossing one would have taken it to
    assert fleet.census.bytes == 300


def test_a_replica_may_grow_up_to_the_budget_its_old_size_counted_once() -> None:
    fleet = fleet_with(Limits(bytes=300))
    push(fleet, KEY, 0, 1)  # 200 of 300
    assert refused_field(push(fleet, KEY, 0, 1, 2)) is None  # grows to 300 of 300: its own 200 are not counted twice
    assert fleet.census.bytes == 300
    assert refused_field(push(fleet, KEY, 0, 1, 2, 3)) == "bytes"  # 400 of 300


def test_a_shrink_passes_under_a_lowered_budget_and_growth_does_not() -> None:
    fleet = fleet_with(Limits(bytes=1000))
    push(fleet, ("d", "r1"), 0, 1)
    push(fleet, ("d", "r2"), 0, 1)
    lowered = Rules({}, Limits(bytes=100), fleet.rules.wall, fleet.rules.monotonic, ByteBudget(100, measure))
    fleet.rules = lowered  # as after a restart with a lower --limits.bytes: 400 held, 100 allowed
    assert fleet.run(changes.delete_engine, ("d", "r1"), 1) is not None  # 400 -> 300: passes
    assert refused_field(push(fleet, ("d", "r2"), 1)) is None  # the same size: passes
    assert refused_field(push(fleet, ("d", "r1"), 1)) == "bytes"  # grows back: refused
    assert refused_field(push(fleet, ("d", "r3"), 0)) == "bytes"
    assert fleet.census.bytes == 300


def test_two_changes_of_one_batch_are_refused_together_past_the_budget() -> None:
    fleet = fleet_with(Limits(bytes=300))
    push(fleet, ("d", "r1"), 0)
    batch = fleet.batch()
    first = changes.ready(fleet.rules, batch, ("d", "r2"), (ready(0),), None)
    second = changes.ready(fleet.rules, batch, ("d", "r3"), (ready(0), ready(1, RANK1)), None)
    assert first.refused == {} and set(second.refused) == {1}  # r3's first engine fits, its second does not
    fleet.commit(batch)
    assert fleet.census.bytes == 300 == sum(measure(replica) for replica in fleet.replicas.values())


def test_an_array_that_fits_is_measured_once_and_one_past_the_budget_is_refused_alone() -> None:
    measured: list[int] = []

    def counting(replica: Replica) -> int:
        measured.append(len(replica.engines))
        return measure(replica)

    fleet = Fleet(Rules({}, Limits(bytes=1_000), Clock(1_800_000_000.0), Clock(0.0), ByteBudget(1_000, counting)))
    assert push(fleet, KEY, *range(8)).refused == {}
    assert measured == [8], "a DP=8 server's start is one measure, not one per engine"
    outcome = push(fleet, ("d", "other"), 0, 1, 2)  # 300 more bytes of a budget with 200 left
    assert set(outcome.refused) == {2} and refused_field(outcome) == "bytes"
    assert set(fleet.replicas[("d", "other")].engines) == {0, 1}
    assert fleet.census.bytes == 1_000
