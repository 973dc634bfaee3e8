"""The writer (exporter/writer.py): group commit, nothing shown or acknowledged before it is durable, a failing
store or a failing change refused alone."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from exporter.errors import StorageUnavailable
from exporter.state import ExporterState
from exporter.storage import SqliteStore
from protocol import decode_ready_response
from tests.support import fixture_bytes


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
