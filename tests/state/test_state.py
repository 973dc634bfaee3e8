"""The state's rules (state/changes.py) driven on a batch directly, with fake clocks: no writer thread, no store
(``tests/helpers/batches.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from exporter.errors import LimitExceeded, UnknownReplica
from exporter.state import changes
from exporter.state.changes import EngineReady, Rules
from exporter.state.limits import ByteBudget, Limits
from exporter.state.replica_map import SHARDS
from exporter.state.replicas import Replica, ReplicaKey
from exporter.state.writer import Batch
from protocol import EngineCoreReadyResponse, SyncConflict, decode_ready_response
from tests.helpers.batches import CONFLICTING, KEY, RANK0, RANK1, Clock, Fleet, ready


@pytest.fixture
def wall() -> Clock:
    return Clock(1_800_000_000.0)


@pytest.fixture
def monotonic() -> Clock:
    return Clock(5_000.0)


@pytest.fixture
def fleet(wall: Clock, monotonic: Clock) -> Fleet:
    return Fleet(Rules({}, Limits(), wall, monotonic, missed_heartbeats=3))


# Heartbeat promises ---------------------------------------------------------------------------------------


def test_a_push_without_heartbeat_keeps_the_replicas_earlier_promise(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0), heartbeat=30.0)
    assert fleet.ready(KEY, ready(1, RANK1)).replica.heartbeat_seconds == 30.0
    fleet.run(changes.heartbeat, KEY, 10.0)
    assert fleet.run(changes.static_labels, KEY, {"block_size": "16"}, None).heartbeat_seconds == 10.0
    assert fleet.replicas[KEY].heartbeat_seconds == 10.0


def test_a_push_without_heartbeat_to_a_new_replica_never_expires(fleet: Fleet, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0))
    monotonic.now += 10 * 86400
    assert not fleet.liveness.due(fleet.replicas)


def test_a_heartbeat_for_an_unknown_replica_is_refused_so_its_sender_resends(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0), heartbeat=30.0)
    with pytest.raises(UnknownReplica):
        fleet.run(changes.heartbeat, ("d", "r2"), 30.0)
    with pytest.raises(UnknownReplica):
        fleet.run(changes.heartbeat, ("other", "r1"), 30.0)


def test_a_heartbeat_is_kept_in_memory_without_a_write(fleet: Fleet, wall: Clock, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=30.0)
    fleet.store.calls.clear()
    wall.now += 20
    monotonic.now += 20
    batch = fleet.batch()
    changes.heartbeat(fleet.rules, batch, KEY, 30.0)
    assert (batch.writes, batch.touched) == ([], {KEY})
    fleet.commit(batch)
    assert (fleet.replicas[KEY].last_seen, fleet.replicas[KEY].seen) == (wall.now, monotonic.now)


def test_a_heartbeat_to_a_shared_store_is_written(wall: Clock, monotonic: Clock) -> None:
    fleet = Fleet(Rules({}, Limits(), wall, monotonic, store_heartbeats=True))
    fleet.ready(KEY, ready(0), heartbeat=30.0)
    fleet.store.calls.clear()
    wall.now += 20
    fleet.run(changes.heartbeat, KEY, 30.0)
    [(name, (stored,))] = fleet.store.calls
    assert (name, stored.last_seen) == ("save_replica", wall.now)


# Goodbyes and deletes -------------------------------------------------------------------------------------


def test_a_goodbye_for_an_unknown_replica_changes_nothing(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0))
    before = fleet.replicas
    batch = fleet.batch()
    assert changes.goodbye(batch, ("d", "r2")) is False
    assert changes.goodbye(batch, ("e", "r1")) is False
    assert (batch.changed, batch.writes) == ({}, [])
    fleet.commit(batch)
    assert fleet.replicas is before


def test_a_goodbye_forgets_that_replica_alone(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0))
    fleet.ready(("d", "r2"), ready(0))
    assert fleet.run(changes.goodbye, KEY) is True
    assert set(fleet.replicas) == {("d", "r2")}
    assert fleet.store.calls[-1] == ("delete_replica", KEY)
    assert fleet.census.members == {"d": {"r2"}}


def test_deleting_a_deployment_keeps_deployments_whose_names_it_begins(fleet: Fleet) -> None:
    for key in [("a", "r1"), ("a", "r2"), ("a/b", "r1"), ("ab", "r1"), ("b", "a")]:
        fleet.ready(key, ready(0))
    batch = fleet.batch()
    for key in [("a", "r3"), ("a/b", "r8"), ("ab", "r9")]:  # staged in the same batch: only a's deleted too
        changes.ready(fleet.rules, batch, key, (ready(0),), None)
    assert changes.delete_deployment(batch, "a") is True
    fleet.commit(batch)
    assert set(fleet.replicas) == {("a/b", "r1"), ("a/b", "r8"), ("ab", "r1"), ("ab", "r9"), ("b", "a")}
    deleted = {arguments for name, arguments in fleet.store.calls if name == "delete_replica"}
    assert deleted == {("a", "r1"), ("a", "r2"), ("a", "r3")}
    assert fleet.run(changes.delete_deployment, "a") is False


def test_deleting_an_engine_keeps_the_others_and_the_expiry_clock(fleet: Fleet, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), ready(1, RANK1), heartbeat=30.0)
    seen = fleet.replicas[KEY].seen
    monotonic.now += 50
    updated = fleet.run(changes.delete_engine, KEY, 1)
    assert (set(updated.engines), updated.seen) == ({0}, seen)
    assert fleet.run(changes.delete_engine, KEY, 1) is None
    assert fleet.store.calls[-1] == ("delete_engine", (*KEY, 1))


# Restarts -------------------------------------------------------------------------------------------------


def test_a_restarted_replicas_engine_drop_never_reaches_other_replicas(fleet: Fleet) -> None:
    for key in [KEY, ("d", "r2"), ("e", "r1")]:
        fleet.ready(key, ready(0), ready(1, RANK1))
    fleet.store.calls.clear()
    outcome = fleet.ready(KEY, ready(0, instance_id="a-new-run"))
    assert (set(outcome.replica.engines), outcome.replica.instance_id) == ({0}, "a-new-run")
    assert set(fleet.replicas["d", "r2"].engines) == set(fleet.replicas["e", "r1"].engines) == {0, 1}
    dropped = [arguments for name, arguments in fleet.store.calls if name == "delete_engines"]
    assert dropped == [KEY]
    # The drop comes before the new run's engine is saved, the replica's row before both.
    assert [name for name, _ in fleet.store.calls] == ["save_replica", "delete_engines", "save_engine"]


def test_a_replica_with_the_same_instance_keeps_its_engines(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0), ready(1, RANK1))
    fleet.store.calls.clear()
    assert set(fleet.ready(KEY, ready(0)).replica.engines) == {0, 1}
    assert "delete_engines" not in [name for name, _ in fleet.store.calls]


# Several engines in one change ----------------------------------------------------------------------------


def test_several_engines_are_checked_alone_and_staged_once(wall: Clock, monotonic: Clock) -> None:
    fleet = Fleet(Rules({}, Limits(engines_per_replica=2), wall, monotonic))
    batch = fleet.batch()
    reports = (ready(0), ready(1, CONFLICTING), ready(1, RANK1), ready(2, RANK1, data_parallel_rank=2))
    outcome = changes.ready(fleet.rules, batch, KEY, reports, 30.0)
    assert set(outcome.refused) == {2}  # engine 1's conflict was replaced by its accepted response
    assert isinstance(outcome.refused[2], LimitExceeded)
    assert (set(outcome.replica.engines), batch.counts["accepted"]) == ({0, 1}, 2)
    assert list(batch.changed) == [KEY]
    fleet.commit(batch)
    assert [name for name, _ in fleet.store.calls] == ["save_replica", "save_engine", "save_engine"]


ARRAYS = {
    "a new replica's engines": ((), (ready(0), ready(1, RANK1))),
    "a restart's engines": ((ready(0), ready(1, RANK1)), (ready(0, instance_id="b"), ready(1, RANK1, instance_id="b"))),
    "a restart after an engine": ((), (ready(0), ready(1, RANK1, instance_id="b"))),
    "a restart after a refused engine": (
        (ready(0), ready(1, RANK1)),
        (ready(1, CONFLICTING), ready(0, instance_id="b")),
    ),
    "kept engines replaced one by one": (
        (ready(0), ready(1, RANK1)),
        (ready(0, CONFLICTING, data_parallel_rank=0), ready(1, CONFLICTING)),
    ),
    "a conflict with a kept engine": ((ready(0),), (ready(1, CONFLICTING),)),
    "an engine twice": ((), (ready(0), ready(1, CONFLICTING), ready(1, RANK1))),
    "a kept engine replaced": ((ready(0), ready(1, RANK1)), (ready(0, num_gpu_blocks=77),)),
    "a conflict within the array": ((), (ready(0), ready(1, CONFLICTING))),
}


@pytest.mark.parametrize("before, array", ARRAYS.values(), ids=ARRAYS.keys())
def test_an_array_is_taken_as_its_responses_one_by_one_would_be(
    before: tuple[EngineReady, ...], array: tuple[EngineReady, ...], wall: Clock, monotonic: Clock
) -> None:
    together, in_turn = (Fleet(Rules({}, Limits(), wall, monotonic)) for _ in range(2))
    for fleet in (together, in_turn):
        if before:
            fleet.ready(KEY, *before)
    outcome = together.ready(KEY, *array)
    refused: dict[int, Exception] = {}
    for report in array:  # a later response of an engine, taken, replaces its refusal
        error = in_turn.ready(KEY, report).refused.get(report.engine)
        if error is None:
            refused.pop(report.engine, None)
        else:
            refused[report.engine] = error
    assert {engine: type(error) for engine, error in outcome.refused.items()} == {
        engine: type(error) for engine, error in refused.items()
    }
    mine, theirs = together.replicas[KEY], in_turn.replicas[KEY]
    assert (mine.instance_id, mine.synced) == (theirs.instance_id, theirs.synced)
    assert {e: r.payload for e, r in mine.engines.items()} == {e: r.payload for e, r in theirs.engines.items()}


def test_a_servers_start_is_synced_once_however_many_engines(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DP=8 server's start: one sync of the replica its eight engines make, not one per engine."""
    fleet.ready(KEY, *(ready(rank, data_parallel_rank=rank, data_parallel_size=8) for rank in range(8)))
    builds = []
    build = changes.build_replica
    monkeypatch.setattr(changes, "build_replica", lambda *a, **k: builds.append(a) or build(*a, **k))
    run = [ready(rank, data_parallel_rank=rank, data_parallel_size=8, instance_id="next") for rank in range(8)]
    fleet.store.calls.clear()
    outcome = fleet.ready(KEY, *run)
    assert (len(builds), outcome.refused, set(outcome.replica.engines)) == (1, {}, set(range(8)))
    assert [name for name, _ in fleet.store.calls] == ["save_replica", "delete_engines"] + ["save_engine"] * 8


def test_a_refused_engine_alone_changes_nothing(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0))
    before = fleet.replicas
    outcome = fleet.ready(KEY, ready(1, CONFLICTING))
    assert isinstance(outcome.refused[1], SyncConflict)
    assert (outcome.replica, fleet.replicas) == (before[KEY], before)


def test_every_engine_of_a_new_replica_past_the_caps_is_refused(wall: Clock, monotonic: Clock) -> None:
    fleet = Fleet(Rules({}, Limits(replicas_per_deployment=1), wall, monotonic))
    fleet.ready(KEY, ready(0))
    outcome = fleet.ready(("d", "r2"), ready(0), ready(1, RANK1))
    assert outcome.replica is None
    assert all(isinstance(error, LimitExceeded) for error in outcome.refused.values())
    assert set(outcome.refused) == {0, 1}
    assert set(fleet.replicas) == {KEY}


# Expiry ---------------------------------------------------------------------------------------------------


def expired(fleet: Fleet) -> set[ReplicaKey]:
    batch = fleet.batch()
    changes.expire(fleet.rules, batch)
    fleet.commit(batch)
    return {key for key, replica in batch.changed.items() if replica is None}


def test_a_replica_expires_after_its_missed_heartbeats_and_not_a_moment_before(fleet: Fleet, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    fleet.ready(("d", "forever"), ready(0))
    monotonic.now += 30.0  # exactly 3 x 10 s: still within its promise
    assert not fleet.liveness.due(fleet.replicas)
    assert expired(fleet) == set()
    monotonic.now += 0.001
    assert fleet.liveness.due(fleet.replicas)
    assert expired(fleet) == {KEY}
    assert fleet.store.calls[-1] == ("delete_replica", KEY)
    assert set(fleet.replicas) == {("d", "forever")}


def test_expiry_looks_at_every_replica_only_once_the_earliest_deadline_may_have_passed(
    fleet: Fleet, monotonic: Clock
) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    assert not fleet.liveness.due(fleet.replicas)  # looks: the earliest deadline is in 30 s
    monotonic.now += 20.0
    assert not fleet.liveness.due(NoWalk(fleet.replicas))
    fleet.ready(("d", "hasty"), ready(0), heartbeat=1.0)  # committed: its deadline is heard of
    monotonic.now += 3.5
    assert fleet.liveness.due(fleet.replicas)
    assert expired(fleet) == {("d", "hasty")}
    assert not fleet.liveness.due(fleet.replicas)  # the earliest deadline is KEY's again, 6.5 s ahead
    fleet.liveness.committed({}, reloaded=True)  # another process wrote: look again
    with pytest.raises(AssertionError, match="walked"):
        fleet.liveness.due(NoWalk(fleet.replicas))


def test_a_heartbeat_moves_the_deadline(fleet: Fleet, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    monotonic.now += 25.0
    fleet.run(changes.heartbeat, KEY, 10.0)
    monotonic.now += 29.0
    assert expired(fleet) == set()
    monotonic.now += 1.5
    assert expired(fleet) == {KEY}


def test_a_heard_heartbeat_counts_from_when_it_was_heard_and_keeps_its_replica_from_expiry(
    fleet: Fleet, wall: Clock, monotonic: Clock
) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    monotonic.now += 25.0
    wall.now += 25.0
    fleet.liveness.hear(KEY, 10.0)
    heard_at = wall.now
    assert fleet.liveness.pending() and fleet.replicas[KEY].last_seen < heard_at  # answered, not yet folded
    monotonic.now += 6.0  # past the old deadline, within the heard one
    wall.now += 6.0
    assert fleet.liveness.due(fleet.replicas)
    assert expired(fleet) == set(), "the batch folds what was heard before it expires"
    assert fleet.replicas[KEY].last_seen == heard_at and not fleet.liveness.pending()
    monotonic.now += 24.5
    assert expired(fleet) == {KEY}


def test_what_was_heard_stays_pending_until_a_batch_that_folded_it_commits(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    fleet.liveness.hear(KEY, 10.0)
    fleet.batch()  # folded, then failed: never committed
    assert fleet.liveness.pending()
    batch = fleet.batch()
    fleet.liveness.hear(KEY, 20.0)  # heard again while the batch runs
    fleet.commit(batch)
    assert fleet.replicas[KEY].heartbeat_seconds == 10.0 and fleet.liveness.pending()
    fleet.commit(fleet.batch())
    assert fleet.replicas[KEY].heartbeat_seconds == 20.0 and not fleet.liveness.pending()


def test_a_heartbeat_heard_for_a_replica_gone_since_is_dropped(fleet: Fleet) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    fleet.liveness.hear(KEY, 10.0)
    batch = fleet.batch()
    assert changes.goodbye(batch, KEY) is True
    fleet.commit(batch)
    fleet.liveness.hear(KEY, 10.0)  # the route checked an older snapshot
    batch = fleet.batch()
    fleet.commit(batch)
    assert KEY not in fleet.replicas and not batch.changed and not fleet.liveness.pending()


def test_a_replica_changed_in_the_batch_of_its_expiry_stays(fleet: Fleet, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=10.0)
    monotonic.now += 60.0
    batch = fleet.batch()
    changes.heartbeat(fleet.rules, batch, KEY, 10.0)
    changes.expire(fleet.rules, batch)
    fleet.commit(batch)
    assert KEY in fleet.replicas


def test_a_wall_clock_step_forward_does_not_expire_live_replicas(fleet: Fleet, wall: Clock, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=30.0)
    wall.now += 120.0  # libfaketime's +120 s: the wall clock alone moves
    monotonic.now += 2.5
    assert not fleet.liveness.due(fleet.replicas)
    fleet.run(changes.heartbeat, KEY, 30.0)
    assert KEY in fleet.replicas


def test_a_wall_clock_step_back_does_not_keep_silent_replicas(fleet: Fleet, wall: Clock, monotonic: Clock) -> None:
    fleet.ready(KEY, ready(0), heartbeat=1.0)
    wall.now -= 3600.0
    monotonic.now += 3.5  # three missed 1 s heartbeats, whatever the wall clock says
    assert expired(fleet) == {KEY}


@pytest.mark.parametrize(
    ("last_seen_ago", "expected"),
    [
        (100.0, 1_000.0),  # heard from before start-up: a full period from start-up
        (-3600.0, 1_010.0),  # "seen" in the future (the wall clock went back): counts as now
        (4.0, 1_006.0),  # a replica another worker heard from 4 s ago
    ],
)
def test_a_stored_last_seen_counts_on_the_monotonic_clock(last_seen_ago: float, expected: float) -> None:
    wall_now = 1_800_000_000.0
    seen = changes.seen_at_load(wall_now - last_seen_ago, wall_now, monotonic_now=1_010.0, started=1_000.0)
    assert seen == expected


# Running totals: one change never walks the fleet ---------------------------------------------------------


class NoWalk(Mapping[ReplicaKey, Replica]):
    """The committed replicas, refusing to be walked: a change may look one up, never count them all."""

    def __init__(self, replicas: Mapping[ReplicaKey, Replica]) -> None:
        self._replicas = replicas

    def __getitem__(self, key: ReplicaKey) -> Replica:
        return self._replicas[key]

    def __iter__(self) -> Iterator[ReplicaKey]:
        raise AssertionError("a change walked every replica")

    def __len__(self) -> int:
        raise AssertionError("a change counted every replica")


def test_one_change_measures_one_replica_and_walks_no_other(wall: Clock, monotonic: Clock) -> None:
    measured: list[ReplicaKey] = []

    def measure(replica: Replica) -> int:
        measured.append(replica.key)
        return 1000

    fleet = Fleet(Rules({}, Limits(deployments=300, bytes=10**9), wall, monotonic, ByteBudget(10**9, measure)))
    for index in range(200):
        fleet.ready((f"d{index % 50}", f"r{index}"), ready(0))
    assert (fleet.census.bytes, len(fleet.census.members)) == (200_000, 50)
    measured.clear()
    batch = Batch(NoWalk(fleet.replicas), fleet.census)  # type: ignore[arg-type]
    changes.ready(fleet.rules, batch, ("new", "r"), (ready(0),), 30.0)
    changes.ready(fleet.rules, batch, ("d1", "r1"), (ready(1, RANK1),), 30.0)
    changes.static_labels(fleet.rules, batch, ("d2", "r2"), {"block_size": "16"}, None)
    changes.heartbeat(fleet.rules, batch, ("d3", "r3"), 30.0)
    changes.delete_engine(fleet.rules, batch, ("d1", "r1"), 1)
    changes.goodbye(batch, ("d4", "r4"))
    changes.delete_deployment(batch, "d5")
    assert measured == [("new", "r"), ("d1", "r1"), ("d2", "r2"), ("d1", "r1")]
    fleet.commit(batch)
    assert fleet.census.bytes == 1000 * len(fleet.replicas) == 1000 * (200 + 1 - 1 - 4)
    assert ("d4", "r4") not in fleet.census.sizes  # sizes leave with their replicas
    assert len(fleet.census.sizes) == len(fleet.replicas)


def test_the_census_counts_what_a_fresh_count_would(fleet: Fleet) -> None:
    keys = [(f"d{index % 7}", f"r{index}") for index in range(40)]
    for key in keys:
        fleet.ready(key, ready(0))
    batch = fleet.batch()
    for key in keys[::3]:
        changes.goodbye(batch, key)
    changes.delete_deployment(batch, "d2")
    changes.ready(fleet.rules, batch, ("d9", "r"), (ready(0),), None)
    expected: dict[str, set[str]] = {}
    for deployment, name in {key for key in keys if key not in keys[::3] and key[0] != "d2"} | {("d9", "r")}:
        expected.setdefault(deployment, set()).add(name)
    assert batch.deployments() == len(expected)
    assert all(batch.replicas_in(deployment) == len(names) for deployment, names in expected.items())
    fleet.commit(batch)
    assert fleet.census.members == expected


# The snapshot ---------------------------------------------------------------------------------------------


def test_a_new_version_copies_only_the_shards_it_changes_and_never_touches_the_old() -> None:
    response: EngineCoreReadyResponse = decode_ready_response(RANK0)
    fleet = Fleet(Rules({}))
    for index in range(600):
        fleet.ready((f"d{index}", "r"), EngineReady(0, response, RANK0, "msgpack"))
    old = fleet.replicas
    new = old.with_changes({("d7", "r"): None, ("new", "r"): old["d8", "r"]})
    assert (len(old), len(new)) == (600, 600)
    assert ("d7", "r") in old and ("d7", "r") not in new and ("new", "r") not in old
    assert dict(new.items()) == {**{key: value for key, value in old.items() if key != ("d7", "r")},
                                 ("new", "r"): old["d8", "r"]}  # fmt: skip
    assert sum(a is not b for a, b in zip(old._shards, new._shards, strict=True)) <= 2 < SHARDS
    assert sorted(new) == sorted(new.keys()) and list(new.values()) == [new[key] for key in new]


def test_the_key_set_stays_while_replicas_are_only_replaced() -> None:
    """What a reader works out from the keys alone (the exposition's sorted order) is good while ``key_set`` is
    the same object: a replaced replica keeps it, a key that comes or goes (even both in one change) does not."""
    fleet = Fleet(Rules({}))
    for name in ("a", "b"):
        fleet.ready(("d", name), ready(0))
    both = fleet.replicas
    a, b = both["d", "a"], both["d", "b"]
    assert both.with_changes({a.key: b}).key_set is both.key_set
    added = both.with_changes({("d", "c"): a})
    removed = both.with_changes({b.key: None})
    swapped = both.with_changes({b.key: None, ("d", "c"): a})
    assert len(swapped) == len(both)
    assert len({id(version.key_set) for version in (both, added, removed, swapped)}) == 4
    assert removed.with_changes({b.key: None}).key_set is removed.key_set, "removing an absent key changes no key"
    assert type(both).of([a, b]).key_set is not both.key_set, "maps built apart never share one"


def test_an_engines_report_keeps_its_bytes_and_decodes_them_on_demand(fleet: Fleet) -> None:
    """Decoded, a ready response takes about one and a half times its bytes again: the state keeps the bytes."""
    fleet.ready(KEY, ready(0))
    report = fleet.replicas[KEY].engines[0]
    assert "response" not in type(report).__struct_fields__
    assert report.payload == RANK0 and report.response() == decode_ready_response(RANK0)
