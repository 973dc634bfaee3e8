"""The exporter's rules for changing its state: what each request does to the replicas, and expiry.

Each rule is a function of a ``Batch`` (exporter/state/writer.py) run by the writer
thread: it checks the limits, builds the new replica (the sync may refuse it)
and stages the writes that store it, or refuses with nothing staged. They take
the clocks from ``Rules``, so tests drive them on a batch with fake clocks.

Replicas that promised heartbeats expire after missing ``missed_heartbeats``
of them, counted on the monotonic clock (``Replica.seen``): a step of the wall
clock neither expires a live replica nor keeps a silent one. Wall time
(``last_seen``, shown and stored) counts only across a restart, and there a
replica gets a full expiry period from start-up anyway (see ``seen_at_load``).
The others stay until deleted.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from exporter.errors import UnknownReplica
from exporter.state.engine_inputs import EngineInputs
from exporter.state.limits import ByteBudget, Limits
from exporter.state.ready_arrays import EngineReady, ReadyArray, Taken, within_budget
from exporter.state.replicas import Replica, ReplicaKey, build_replica, stored_engine, stored_replica
from exporter.state.storage import Store, StoredEngine
from exporter.state.writer import Batch

log = logging.getLogger("cache_config_exporter.state")


@dataclass(frozen=True)
class Rules:
    """What the change functions need besides the batch: the labels, the limits, the clocks."""

    base_labels: Mapping[str, str]
    limits: Limits = field(default_factory=Limits)
    # Unix seconds: what ``last_seen`` and ``received_at`` show.
    wall: Callable[[], float] = time.time
    # This process's monotonic seconds: what expiry counts on.
    monotonic: Callable[[], float] = time.monotonic
    budget: ByteBudget | None = None
    missed_heartbeats: int = 3
    # Several processes share the store: each one's expiry reads the others' heartbeats from it, so a heartbeat
    # is committed like any change rather than kept in memory until a checkpoint.
    store_heartbeats: bool = False
    # The sync inputs of the engines of the replicas changed lately (the writer's alone): a change of one engine
    # reads its siblings' inputs from here rather than decoding their responses again.
    inputs: EngineInputs = field(default_factory=EngineInputs)


@dataclass(frozen=True)
class ReadyOutcome:
    """What ``ready`` did: the replica as committed (``None`` when every engine was refused and there was no
    replica before), and each refused engine's reason (``SyncConflict``, ``InvalidPayload``, ``LimitExceeded``)."""

    replica: Replica | None
    refused: Mapping[int, Exception]


def _promised(current: Replica | None, heartbeat_seconds: float | None) -> float | None:
    """The heartbeat interval a change promises, else the one the replica promised before."""
    if heartbeat_seconds is not None or current is None:
        return heartbeat_seconds
    return current.heartbeat_seconds


def _save(replica: Replica) -> Callable[[Store], None]:
    stored = stored_replica(replica)
    return lambda store: store.save_replica(stored)


def _remove(key: ReplicaKey) -> Callable[[Store], None]:
    return lambda store: store.delete_replica(*key)


def _measured(rules: Rules, batch: Batch, key: ReplicaKey, updated: Replica) -> int | None:
    """What ``updated`` takes, refused past the byte budget; ``None`` without a budget."""
    return rules.budget.check(batch, key, updated) if rules.budget is not None else None


def _existing_or_room(rules: Rules, batch: Batch, key: ReplicaKey) -> Replica | None:
    """The replica, or ``None`` for a new one once the caps leave room for it."""
    current = batch.get(key)
    if current is None:
        rules.limits.check_new_replica(batch, key)
    return current


def ready(
    rules: Rules, batch: Batch, key: ReplicaKey, reports: Sequence[EngineReady], heartbeat_seconds: float | None
) -> ReadyOutcome:
    """Take engines' ready responses, each checked alone, the accepted ones staged together.

    As if each were taken in turn: a new ``instance_id`` drops the replica's previous run's engines (and no
    other replica's), a later response of an engine replaces an earlier one. A refused response changes
    nothing and the next ones go on from the last accepted state. One pass takes them, and the replica they
    make is synced once and measured once; past the byte budget the array is cut where it crosses it
    (``exporter/state/ready_arrays.py``).
    """
    array = ReadyArray(rules.limits, batch, key, reports, rules.wall(), rules.inputs)
    taken = array.take()
    current = array.current
    if not taken.accepted:
        return ReadyOutcome(current, taken.refused)
    static = current.static_labels if current else {}
    heartbeat, seen = _promised(current, heartbeat_seconds), rules.monotonic()

    def replica_of(taken: Taken) -> Replica:
        return build_replica(key, taken.instance_id, static, heartbeat, array.now, taken.engines, rules.base_labels,
                             seen=seen, inputs=taken.inputs, previous=current)  # fmt: skip

    if rules.budget is None:
        updated, size = replica_of(taken), None
    else:
        taken, updated, size = within_budget(rules.budget, array, taken, replica_of)
    if updated is None:
        return ReadyOutcome(current, taken.refused)
    rules.inputs.keep(key, updated.engines, taken.inputs)
    writes: list[Callable[[Store], None]] = [functools.partial(_delete_engines, key)] if taken.drops_stored else []
    writes.extend(
        functools.partial(_save_engine, key, engine, stored_engine(updated.engines[engine])) for engine in taken.saved
    )
    batch.stage(key, updated, _save(updated), *writes, size=size)
    batch.counts["accepted"] += taken.accepted
    return ReadyOutcome(updated, taken.refused)


def _delete_engines(key: ReplicaKey, store: Store) -> None:
    store.delete_engines(*key)


def _save_engine(key: ReplicaKey, engine: int, stored: StoredEngine, store: Store) -> None:
    store.save_engine(*key, engine, stored)


def static_labels(
    rules: Rules, batch: Batch, key: ReplicaKey, labels: Mapping[str, str], heartbeat_seconds: float | None
) -> Replica:
    """Replace a replica's static labels (its frontend's ``metrics_info()``), creating it if needed."""
    current = _existing_or_room(rules, batch, key)
    engines = current.engines if current else {}
    updated = build_replica(
        key,
        current.instance_id if current else None,
        dict(labels),
        _promised(current, heartbeat_seconds),
        rules.wall(),
        engines,
        rules.base_labels,
        seen=rules.monotonic(),
        inputs=rules.inputs.of(key, engines),
        previous=current,
    )
    batch.stage(key, updated, _save(updated), size=_measured(rules, batch, key, updated))
    return updated


def heartbeat(rules: Rules, batch: Batch, key: ReplicaKey, heartbeat_seconds: float) -> Replica:
    """The replica is alive and promises the next heartbeat within ``heartbeat_seconds``.

    Raises ``UnknownReplica`` when the exporter does not hold it (a new or restarted exporter): the sender then
    sends its whole state again. Only "last seen" and the promise change: kept in memory until the writer's
    next checkpoint, unless the store is shared (``Rules.store_heartbeats``). In a single process heartbeats
    take the quicker way of ``Liveness.hear`` instead.
    """
    current = batch.get(key)
    if current is None:
        raise unknown_replica(key)
    updated = _alive(current, heartbeat_seconds, rules.wall(), rules.monotonic())
    if rules.store_heartbeats:
        batch.stage(key, updated, _save(updated))
    else:
        batch.touch(key, updated)
    return updated


def unknown_replica(key: ReplicaKey) -> UnknownReplica:
    return UnknownReplica("replica", f"no replica {key[1]!r} of {key[0]!r}: send its state")


def _alive(replica: Replica, heartbeat_seconds: float, wall: float, monotonic: float) -> Replica:
    return msgspec.structs.replace(replica, heartbeat_seconds=heartbeat_seconds, last_seen=wall, seen=monotonic)


def goodbye(batch: Batch, key: ReplicaKey) -> bool:
    """Forget a replica (its sender said goodbye); whether there was one."""
    if batch.get(key) is None:
        return False
    batch.stage(key, None, _remove(key))
    return True


def delete_deployment(batch: Batch, deployment: str) -> bool:
    """Forget every replica of exactly ``deployment`` (not of ``deployment/...``); whether there was one."""
    names = sorted(batch.names(deployment))
    for name in names:
        batch.stage((deployment, name), None, _remove((deployment, name)))
    return bool(names)


def delete_engine(rules: Rules, batch: Batch, key: ReplicaKey, engine: int) -> Replica | None:
    """Forget one engine; the updated replica, or ``None`` if there was no such engine."""
    current = batch.get(key)
    if current is None or engine not in current.engines:
        return None
    engines = {index: report for index, report in current.engines.items() if index != engine}
    updated = build_replica(key, current.instance_id, current.static_labels, current.heartbeat_seconds,
                            current.last_seen, engines, rules.base_labels, seen=current.seen,
                            inputs=rules.inputs.of(key, engines), previous=current)  # fmt: skip
    batch.stage(
        key, updated, lambda store: store.delete_engine(*key, engine), size=_measured(rules, batch, key, updated)
    )
    return updated


def deadline(rules: Rules, replica: Replica) -> float | None:
    """When the replica expires on the monotonic clock, or ``None`` if it never does."""
    if replica.heartbeat_seconds is None:
        return None
    return replica.seen + replica.heartbeat_seconds * rules.missed_heartbeats


class Liveness:
    """Heartbeats heard, and when to look for replicas whose heartbeats stopped.

    A heartbeat changes only "last seen", which stays in memory until a checkpoint anyway: so in a single
    process it needs no turn of the writer of its own. ``hear`` records it (a dict write under a lock) and the
    request is answered at once; every batch ``fold``s what was heard before anything else, so expiry, the
    checkpoint and the next read see it. What was heard is forgotten only once a batch that folded it is
    committed (a failed batch leaves it for the next). A replica gone meanwhile takes no heartbeat (its
    sender's next one is told to send its state).

    Expiry keeps a lower bound of the earliest deadline: a deadline moves later with each heartbeat, and one that
    comes sooner (a new replica, a shorter promise) is heard of as it is committed. Only once the bound has
    passed are all replicas looked at (and the bound taken again from them): with 30 s heartbeats about once
    a minute rather than once a second.
    """

    def __init__(self, rules: Rules) -> None:
        self._rules = rules
        self._earliest = -math.inf  # unknown: look
        self._heard: dict[ReplicaKey, tuple[float, float, float]] = {}
        self._folded: dict[ReplicaKey, tuple[float, float, float]] = {}
        self._lock = threading.Lock()

    def hear(self, key: ReplicaKey, heartbeat_seconds: float) -> None:
        """A heartbeat of a replica the state holds; the next batch folds it in."""
        heard = (heartbeat_seconds, self._rules.wall(), self._rules.monotonic())
        with self._lock:
            self._heard[key] = heard

    def pending(self) -> bool:
        """Whether heartbeats wait to be folded in and committed."""
        return bool(self._heard)

    def fold(self, batch: Batch) -> None:
        """Stage the heartbeats heard and not yet committed, kept in memory as ``heartbeat`` keeps them."""
        with self._lock:
            self._folded = dict(self._heard)
        for key, (heartbeat_seconds, wall, monotonic) in self._folded.items():
            current = batch.get(key)
            if current is not None:
                batch.touch(key, _alive(current, heartbeat_seconds, wall, monotonic))

    def due(self, replicas: Mapping[ReplicaKey, Replica]) -> bool:
        """Whether any replica's heartbeats stopped (or one heard may have: its batch folds it in first)."""
        now = self._rules.monotonic()
        if now <= self._earliest:
            return False
        deadlines = (deadline(self._rules, replica) for replica in replicas.values())
        self._earliest = min((when for when in deadlines if when is not None), default=math.inf)
        return now > self._earliest

    def run(self, batch: Batch) -> None:
        expire(self._rules, batch)

    def committed(self, changed: Mapping[ReplicaKey, Replica | None], reloaded: bool) -> None:
        """Hear of committed changes; ``reloaded``: the replicas were loaded again (another process wrote)."""
        with self._lock:  # what the batch folded is in: forget it, unless heard again since
            for key, heard in self._folded.items():
                if self._heard.get(key) is heard:
                    del self._heard[key]
            self._folded = {}
        if reloaded:
            self._earliest = -math.inf
            return
        for replica in changed.values():
            when = None if replica is None else deadline(self._rules, replica)
            if when is not None and when < self._earliest:
                self._earliest = when


def expire(rules: Rules, batch: Batch) -> None:
    """Stage the removal of every replica whose heartbeats stopped (but one changed in this batch)."""
    now = rules.monotonic()
    for key, replica in batch.current.items():
        when = deadline(rules, replica)
        if key in batch.changed or when is None or now <= when:
            continue
        log.warning("replica %r of %r expired: no heartbeat for %.0f s", key[1], key[0], now - replica.seen)
        batch.stage(key, None, _remove(key))
        batch.counts["expired"] += 1


def seen_at_load(last_seen: float, wall_now: float, monotonic_now: float, started: float) -> float:
    """A stored replica's ``last_seen`` (wall) on this process's monotonic clock.

    Never before ``started``: a replica gets a full expiry period from start-up, as it cannot have sent heartbeats
    to a stopped exporter; never after now, whatever a wall clock that went back says.
    """
    return max(started, monotonic_now - max(0.0, wall_now - last_seen))
