"""The exporter's rules for changing its state: what each request does to the replicas, and expiry.

Every change is a function run by the writer thread (``exporter/writer.py``)
on a batch: it checks the limits, builds the new replica (the sync may refuse
it) and stages the writes that store it. Replicas that promised heartbeats
expire after missing ``missed_heartbeats`` of them; the others stay until
deleted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import MappingProxyType
from typing import Generic, TypeVar

import msgspec

from exporter.errors import StorageUnavailable, UnknownReplica
from exporter.limits import ByteBudget, Limits
from exporter.replicas import (
    EngineReport,
    Replica,
    ReplicaKey,
    build_replica,
    restored,
    stored_engine,
    stored_replica,
)
from exporter.storage import StorageError, Store
from exporter.writer import Batch, Replicas, Writer
from protocol import EngineCoreReadyResponse, InvalidPayload, is_set

log = logging.getLogger("cache_config_exporter.state")


def _promised(current: Replica | None, heartbeat_seconds: float | None) -> float | None:
    """The heartbeat interval a change promises, else the one the replica promised before."""
    if heartbeat_seconds is not None or current is None:
        return heartbeat_seconds
    return current.heartbeat_seconds


def _save(replica: Replica) -> Callable[[Store], None]:
    stored = stored_replica(replica)
    return lambda store: store.save_replica(stored)


class Expiry:
    """The writer's housekeeping: replicas whose heartbeats stopped are removed.

    A replica gets a full expiry period from start-up: it cannot have sent heartbeats to a stopped exporter.
    """

    def __init__(self, clock: Callable[[], float], missed_heartbeats: int) -> None:
        self._clock = clock
        self._missed_heartbeats = missed_heartbeats
        self._started = clock()

    def _deadline(self, replica: Replica) -> float | None:
        if replica.heartbeat_seconds is None:
            return None
        return max(replica.last_seen, self._started) + replica.heartbeat_seconds * self._missed_heartbeats

    def due(self, replicas: Replicas) -> bool:
        now = self._clock()
        return any(now > deadline for deadline in map(self._deadline, replicas.values()) if deadline is not None)

    def run(self, batch: Batch) -> None:
        """Stage the removal of every replica whose heartbeats stopped."""
        now = self._clock()
        for key, replica in batch.current.items():
            deadline = self._deadline(replica)
            if key in batch.changed or deadline is None or now <= deadline:
                continue
            log.warning("replica %r of %r expired: no heartbeat for %.0f s", key[1], key[0], now - replica.last_seen)
            batch.stage(key, None, lambda store, key=key: store.delete_replica(*key))
            batch.counts["expired"] += 1


class ExporterState:
    """All replicas: changed through the writer, read as immutable snapshots.

    ``measure`` counts a replica's bytes for ``limits.bytes``; ``committed`` hears what each commit
    counted (``"accepted"`` ready responses, ``"expired"`` replicas).
    """

    def __init__(
        self,
        store: Store,
        base_labels: Mapping[str, str],
        clock: Callable[[], float],
        limits: Limits | None = None,
        missed_heartbeats: int = 3,
        measure: Callable[[Replica], int] | None = None,
        committed: Callable[[Counter[str]], None] = lambda counts: None,
    ) -> None:
        self._base_labels = dict(base_labels)
        self._clock = clock
        self._limits = limits or Limits()
        self._budget = ByteBudget(self._limits.bytes, measure) if self._limits.bytes and measure else None

        def load() -> Replicas:
            stored = store.load()
            return MappingProxyType({(one.deployment, one.replica): restored(one, self._base_labels) for one in stored})

        try:
            self._writer = Writer(store, load, Expiry(clock, missed_heartbeats), committed)
        except (StorageUnavailable, InvalidPayload, msgspec.DecodeError) as error:
            raise StorageError(f"cannot load storage {store.path}: {error}") from None

    # Reading -----------------------------------------------------------------

    def snapshot(self) -> Replicas:
        """Every replica by (deployment, replica); a consistent view that later changes never touch."""
        return self._writer.replicas

    @property
    def version(self) -> int:
        """Bumped whenever what the replicas show may have changed; caches key on it."""
        return self._writer.version

    @property
    def storage_error(self) -> str | None:
        """Why the store fails, while it does."""
        return self._writer.storage_error

    def replicas_of(self, deployment: str) -> list[Replica]:
        return [replica for key, replica in sorted(self.snapshot().items()) if key[0] == deployment]

    def refresh(self) -> Future[object]:
        """Load what other worker processes committed."""
        return self._writer.refresh()

    def close(self) -> None:
        """Finish every queued change, then stop the writer."""
        self._writer.close()

    # Changing ----------------------------------------------------------------

    def apply_ready(
        self,
        key: ReplicaKey,
        engine: int,
        response: EngineCoreReadyResponse,
        payload: bytes,
        wire_format: str,
        heartbeat_seconds: float | None = None,
    ) -> Future[object]:
        """Take one engine's ready response (decoded, and its bytes as received).

        A new ``instance_id`` drops the replica's previous run's engines, and no other replica's.
        The future fails with ``SyncConflict`` or ``LimitExceeded`` (nothing changed) when
        the change is refused, and with ``StorageUnavailable`` when it cannot be committed.
        """

        def change(batch: Batch) -> Replica:
            current = self._existing_or_room(batch, key)
            engines = dict(current.engines) if current else {}
            instance_id = current.instance_id if current else None
            restarted = is_set(response.instance_id) and response.instance_id != instance_id
            if restarted:
                engines.clear()
                instance_id = response.instance_id
            if engine not in engines:
                self._limits.check_new_engine(key, len(engines))
            now = self._clock()
            report = EngineReport(engine, now, response, payload, wire_format)
            engines[engine] = report
            static_labels = current.static_labels if current else {}
            heartbeat = _promised(current, heartbeat_seconds)
            updated = build_replica(key, instance_id, static_labels, heartbeat, now, engines, self._base_labels)
            self._check_bytes(batch, key, updated)
            writes = [_save(updated)]
            if restarted:
                writes.append(lambda store: store.delete_engines(*key))
            stored = stored_engine(report)
            writes.append(lambda store: store.save_engine(*key, engine, stored))
            batch.stage(key, updated, *writes)
            batch.counts["accepted"] += 1
            return updated

        return self._writer.submit(change)

    def set_static_labels(
        self, key: ReplicaKey, static_labels: Mapping[str, str], heartbeat_seconds: float | None = None
    ) -> Future[object]:
        """Replace a replica's static labels (its frontend's ``metrics_info()``), creating it if needed."""

        def change(batch: Batch) -> Replica:
            current = self._existing_or_room(batch, key)
            updated = build_replica(
                key,
                current.instance_id if current else None,
                dict(static_labels),
                _promised(current, heartbeat_seconds),
                self._clock(),
                current.engines if current else {},
                self._base_labels,
            )
            self._check_bytes(batch, key, updated)
            batch.stage(key, updated, _save(updated))
            return updated

        return self._writer.submit(change)

    def heartbeat(self, key: ReplicaKey, heartbeat_seconds: float) -> Future[object]:
        """The replica is alive and promises the next heartbeat within ``heartbeat_seconds``.

        The future fails with ``UnknownReplica`` when the exporter does not hold it
        (a new or restarted exporter): the sender then sends its whole state again.
        """

        def change(batch: Batch) -> Replica:
            current = batch.get(key)
            if current is None:
                raise UnknownReplica("replica", f"no replica {key[1]!r} of {key[0]!r}: send its state")
            updated = msgspec.structs.replace(current, heartbeat_seconds=heartbeat_seconds, last_seen=self._clock())
            batch.stage(key, updated, _save(updated))
            return updated

        return self._writer.submit(change)

    def delete_replica(self, key: ReplicaKey) -> Future[object]:
        """Forget a replica (its sender said goodbye); the future's result says whether there was one."""

        def change(batch: Batch) -> bool:
            if batch.get(key) is None:
                return False
            batch.stage(key, None, lambda store: store.delete_replica(*key))
            return True

        return self._writer.submit(change)

    def delete_deployment(self, deployment: str) -> Future[object]:
        """Forget every replica of a deployment; the future's result says whether there was one."""

        def change(batch: Batch) -> bool:
            keys = [key for key in batch.replicas() if key[0] == deployment]
            for key in keys:
                batch.stage(key, None, lambda store, key=key: store.delete_replica(*key))
            return bool(keys)

        return self._writer.submit(change)

    def delete_engine(self, key: ReplicaKey, engine: int) -> Future[object]:
        """Forget one engine; the future's result is the updated replica, or ``None`` if there was no such engine."""

        def change(batch: Batch) -> Replica | None:
            current = batch.get(key)
            if current is None or engine not in current.engines:
                return None
            engines = {index: report for index, report in current.engines.items() if index != engine}
            updated = build_replica(key, current.instance_id, current.static_labels, current.heartbeat_seconds,
                                    current.last_seen, engines, self._base_labels)  # fmt: skip
            batch.stage(key, updated, lambda store: store.delete_engine(*key, engine))
            return updated

        return self._writer.submit(change)

    def _existing_or_room(self, batch: Batch, key: ReplicaKey) -> Replica | None:
        """The replica, or ``None`` for a new one once the caps leave room for it."""
        current = batch.get(key)
        if current is None:
            self._limits.check_new_replica(batch, key)
        return current

    def _check_bytes(self, batch: Batch, key: ReplicaKey, updated: Replica) -> None:
        if self._budget is not None:
            self._budget.check(batch, key, updated)


T = TypeVar("T")


class PerVersion(Generic[T]):
    """A value derived from the state's snapshot, built at most once per state version.

    ``fresh()`` is a cheap look (for the event loop); ``current()`` builds when the state moved on, under a
    lock, so readers that arrive meanwhile wait for that one build.
    """

    def __init__(self, state: ExporterState, build: Callable[[Replicas], T]) -> None:
        self._state = state
        self._build = build
        self._built: tuple[int, T] | None = None
        self._lock = threading.Lock()

    def fresh(self) -> T | None:
        """The value if it is of the current version, else ``None``."""
        built = self._built
        return built[1] if built is not None and built[0] == self._state.version else None

    def current(self) -> T:
        built = self._built
        if built is not None and built[0] == self._state.version:
            return built[1]
        with self._lock:
            # Read the version before the snapshot: the snapshot is then at least that new.
            version = self._state.version
            if self._built is None or self._built[0] != version:
                self._built = (version, self._build(self._state.snapshot()))
            return self._built[1]
