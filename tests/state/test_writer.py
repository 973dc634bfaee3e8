"""The writer (exporter/state/writer.py): group commit, nothing shown or acknowledged before it is durable, a failing
store or a failing change refused alone."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from exporter.errors import StorageUnavailable
from exporter.state import writer
from exporter.state.changes import EngineReady, ReadyOutcome
from exporter.state.exporter_state import ExporterState
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica
from exporter.state.storage import SqliteStore
from protocol import decode_ready_response
from tests.helpers.sqlite_file import read_only, rows
from tests.support import fixture_bytes, wait_until


class GatedStore(SqliteStore):
    """A store whose first transaction waits for a gate, and which counts and can fail its commits."""

    def __init__(self, path: Path) -> None:
        self.gate = threading.Event()
        self.gate.set()  # creating the schema is not held up
        self.entered = threading.Event()
        self.fail = False
        self.commits = 0
        super().__init__(path)
        self.gate.clear()
        self.entered.clear()
        self.commits = 0

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.entered.set()
        self.gate.wait(timeout=30)
        with super().transaction():
            yield
            if self.fail:
                raise sqlite3.OperationalError("disk I/O error")
        self.commits += 1


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[GatedStore, ExporterState]]:
    store = GatedStore(tmp_path / "state.db")
    state = ExporterState(store, {}, time.time)
    yield store, state
    store.gate.set()
    state.close()
    store.close()


PAYLOAD = fixture_bytes("dp2-rank0")
RESPONSE = decode_ready_response(PAYLOAD)


def test_changes_waiting_together_are_committed_together(gated: tuple[GatedStore, ExporterState]) -> None:
    store, state = gated
    first = state.apply_ready(("d-first", "default"), 0, RESPONSE, PAYLOAD, "msgpack")
    assert store.entered.wait(timeout=10)
    waiting = [state.apply_ready((f"d{index}", "default"), 0, RESPONSE, PAYLOAD, "msgpack") for index in range(50)]
    assert not any(future.done() for future in [first, *waiting])
    store.gate.set()
    for future in [first, *waiting]:
        future.result(timeout=10)
    assert store.commits == 2
    assert len(state.snapshot()) == 51


def test_nothing_is_acknowledged_or_shown_when_the_commit_fails(gated: tuple[GatedStore, ExporterState]) -> None:
    store, state = gated
    store.gate.set()
    state.apply_ready(("kept", "default"), 0, RESPONSE, PAYLOAD, "msgpack").result(timeout=10)
    version = state.version
    store.fail = True
    failed = state.apply_ready(("lost", "default"), 0, RESPONSE, PAYLOAD, "msgpack")
    with pytest.raises(StorageUnavailable):
        failed.result(timeout=10)
    assert set(state.snapshot()) == {("kept", "default")}
    assert state.version == version
    assert state.storage_error == "disk I/O error"
    store.fail = False
    state.apply_ready(("after", "default"), 0, RESPONSE, PAYLOAD, "msgpack").result(timeout=10)
    assert state.storage_error is None
    assert {stored.deployment for stored in SqliteStore(store.path).load()} == {"kept", "after"}


def test_an_unexpected_error_fails_one_change_and_the_writer_goes_on(gated: tuple[GatedStore, ExporterState]) -> None:
    store, state = gated
    store.gate.set()
    broken = state._writer.submit(lambda batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        broken.result(timeout=10)
    assert (
        state.apply_ready(("after", "default"), 0, RESPONSE, PAYLOAD, "msgpack").result(timeout=10).deployment
        == "after"
    )


class Wall:
    """A wall clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def stored_last_seen(path: Path) -> dict[tuple[str, str], tuple[float | None, float]]:
    with closing(read_only(path)) as db:
        return {(row[0], row[1]): (row[4], row[5]) for row in rows(db)[0]}


KEY = ("d", "r")


def heartbeat(state: ExporterState, key: tuple[str, str], seconds: float) -> Replica:
    """A heartbeat as a single process takes it: answered at once, in the state once the next batch folded it."""
    assert state.heartbeat(key, seconds) is None
    settled = state.settled()
    assert settled is not None, "heard, so pending until a batch folds it in"
    settled.result(timeout=10)
    assert state.settled() is None
    return state.snapshot()[key]


def test_heartbeats_take_no_commit_and_are_stored_when_the_writer_stops(tmp_path: Path) -> None:
    store, wall = GatedStore(tmp_path / "state.db"), Wall()
    store.gate.set()
    state = ExporterState(store, {}, wall)
    try:
        state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        commits = store.commits
        for _ in range(20):
            wall.now += 1
            assert heartbeat(state, KEY, 15.0).last_seen == wall.now
        assert store.commits == commits  # no write transaction, no fsync, for "still alive"
        assert state.snapshot()[KEY].last_seen == wall.now
        assert stored_last_seen(store.path)[KEY] == (30.0, wall.now - 20)
    finally:
        state.close()
    assert stored_last_seen(store.path)[KEY] == (15.0, wall.now)
    store.close()


def test_every_commit_hands_what_it_changed_to_render_ahead_heartbeats_too(tmp_path: Path) -> None:
    """The exposition renders changed replicas on the writer's thread, not at the next scrape."""
    store, wall = GatedStore(tmp_path / "state.db"), Wall()
    store.gate.set()
    handed: list[Replica] = []
    maps: list[tuple[ReplicaMap, ReplicaMap]] = []

    def render_ahead(before: ReplicaMap, after: ReplicaMap, changed: Sequence[Replica]) -> None:
        maps.append((before, after))
        handed.extend(changed)

    state = ExporterState(store, {}, wall, render_ahead=render_ahead)
    try:
        pushed = state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        wait_until(lambda: pushed in handed, timeout=10)
        wall.now += 5
        alive = heartbeat(state, KEY, 30.0)
        wait_until(lambda: alive in handed, timeout=10)
        assert handed[-1].last_seen == wall.now
        assert state.delete_replica(KEY).result(timeout=10)
        assert all(replica is not None for replica in handed), "a removal hands nothing"
        assert maps[-1][1] is state.snapshot() and KEY not in maps[-1][1] and KEY in maps[-1][0]
        assert all(after is before for (_, after), (before, _) in itertools.pairwise(maps)), "each map after the last"
    finally:
        state.close()
        store.close()


def test_a_checkpoint_stores_what_heartbeats_changed_within_its_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "CHECKPOINT_SECONDS", 0.3)
    monkeypatch.setattr(writer, "HOUSEKEEPING_SECONDS", 0.1)
    store, wall = GatedStore(tmp_path / "state.db"), Wall()
    store.gate.set()
    state = ExporterState(store, {}, wall)
    try:
        state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        state.apply_ready(("d", "gone"), 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        wall.now += 7
        heartbeat(state, KEY, 30.0)
        heartbeat(state, ("d", "gone"), 30.0)
        state.delete_replica(("d", "gone")).result(timeout=10)
        deadline = time.monotonic() + 10
        while stored_last_seen(store.path)[KEY][1] != wall.now and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored_last_seen(store.path) == {KEY: (30.0, wall.now)}  # a goodbye stays a goodbye
    finally:
        state.close()
        store.close()


def test_a_heartbeat_to_a_shared_store_is_committed_at_once(tmp_path: Path) -> None:
    store, wall = GatedStore(tmp_path / "state.db"), Wall()
    store.gate.set()
    state = ExporterState(store, {}, wall, shared_store=True)
    try:
        state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        wall.now += 5
        state.heartbeat(KEY, 30.0).result(timeout=10)
        # Another worker reads it from the store before any checkpoint: its expiry counts from it.
        assert stored_last_seen(store.path)[KEY] == (30.0, wall.now)
    finally:
        state.close()
        store.close()


def test_several_engines_of_a_replica_are_one_commit(gated: tuple[GatedStore, ExporterState]) -> None:
    store, state = gated
    store.gate.set()
    rank1 = fixture_bytes("dp2-rank1")
    conflicting = fixture_bytes("dp2-rank1-conflicting-stats-address")
    reports = [
        EngineReady(0, RESPONSE, PAYLOAD, "msgpack"),
        EngineReady(1, decode_ready_response(conflicting), conflicting, "msgpack"),
        EngineReady(1, decode_ready_response(rank1), rank1, "msgpack"),
    ]
    outcome = state.apply_ready_many(KEY, reports[:2], 30.0).result(timeout=10)
    assert isinstance(outcome, ReadyOutcome) and set(outcome.refused) == {1}
    assert set(state.snapshot()[KEY].engines) == {0}
    outcome = state.apply_ready_many(KEY, reports, 30.0).result(timeout=10)
    assert (dict(outcome.refused), set(outcome.replica.engines)) == ({}, {0, 1})
    assert store.commits == 2
    assert sorted(SqliteStore(store.path).load()[0].engines) == [0, 1]


def test_heartbeats_are_answered_while_the_store_fails_and_stored_once_it_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint due at every batch
    store, wall = GatedStore(tmp_path / "state.db"), Wall()
    store.gate.set()
    state = ExporterState(store, {}, wall)
    try:
        state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        store.fail = True
        with pytest.raises(StorageUnavailable):
            state.apply_ready(("d", "other"), 0, RESPONSE, PAYLOAD, "msgpack").result(timeout=10)
        for _ in range(2):
            wall.now += 3
            assert state.heartbeat(KEY, 30.0) is None  # answered at once, the store failing or not
        store.fail = False
        recovered = state.settled()  # None if the writer's own retry folded them in already
        if recovered is not None:
            recovered.result(timeout=10)
        assert state.snapshot()[KEY].last_seen == wall.now
    finally:
        state.close()
    assert stored_last_seen(store.path) == {KEY: (30.0, wall.now)}
    store.close()
