"""The state's rules driven on a writer ``Batch`` directly: no writer thread, no store, fake clocks.

A ``Fleet`` commits a batch in memory the way the writer does after its transaction, and records the store
writes each batch staged, so a test sees both what memory and what the store would hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from exporter.state import changes
from exporter.state.changes import EngineReady, Rules
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import ReplicaKey
from exporter.state.writer import Batch, Census
from protocol import decode_ready_response, encode_ready_response
from tests.support import fixture_bytes

RANK0 = fixture_bytes("dp2-rank0")
RANK1 = fixture_bytes("dp2-rank1")
CONFLICTING = fixture_bytes("dp2-rank1-conflicting-stats-address")
KEY = ("d", "r1")


def ready(engine: int, payload: bytes = RANK0, **changed: Any) -> EngineReady:
    """An engine's ready response as the route hands it over (decoded from its bytes); ``changed`` fields are in
    its bytes."""
    if changed:
        payload = encode_ready_response(msgspec.structs.replace(decode_ready_response(payload), **changed))
    return EngineReady(engine, decode_ready_response(payload), payload, "msgpack")


class Clock:
    """A clock that moves only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingStore:
    """Records the store calls a batch's writes make."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *arguments: self.calls.append((name, arguments))


class Fleet:
    """The committed state and its census, committed in memory as the writer does once the store has committed."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.replicas = ReplicaMap()
        measure = rules.budget.measure if rules.budget else None
        self.census = Census(self.replicas, measure)
        self.liveness = changes.Liveness(rules)
        self.store = RecordingStore()

    def batch(self) -> Batch:
        """A batch as the writer begins it: what was heard folded in first."""
        batch = Batch(self.replicas, self.census)
        self.liveness.fold(batch)
        return batch

    def commit(self, batch: Batch) -> None:
        for write in batch.writes:
            write(self.store)
        self.census.apply(batch)
        self.liveness.committed(batch.changed, reloaded=False)
        self.replicas = self.replicas.with_changes(batch.changed)

    def run(self, change: Callable[..., Any], *arguments: Any) -> Any:
        """One change alone in a batch, committed; its result (or its refusal, raised, with nothing committed)."""
        batch = self.batch()
        result = change(self.rules, batch, *arguments) if change in RULED else change(batch, *arguments)
        self.commit(batch)
        return result

    def ready(self, key: ReplicaKey, *reports: EngineReady, heartbeat: float | None = None) -> changes.ReadyOutcome:
        return self.run(changes.ready, key, reports, heartbeat)


# The rules that take ``Rules`` first; the others take the batch alone.
RULED = {changes.ready, changes.static_labels, changes.heartbeat, changes.delete_engine}
