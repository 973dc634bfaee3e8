"""The exporter's state: every replica's inputs and synced config, in memory and in the store.

A replica is one vLLM server (a frontend and its data-parallel engines) of a
deployment. Replicas that promise heartbeats are expired after missing
``missed_heartbeats`` of them; the others stay until deleted.

All changes go through one writer thread. It takes every change waiting in
its queue, runs the sync for each (which may refuse it), writes the accepted
ones in ONE transaction (group commit: eight clients cost about one fsync),
and only after the commit swaps them into memory and answers their futures.
So memory never shows what was not committed, and nothing is acknowledged
before it is durable. Readers take the current immutable snapshot.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType

import msgspec

from exporter.limits import Limits
from exporter.storage import StorageError, Store, StoredEngine, StoredReplica
from protocol import (
    EngineCoreReadyResponse,
    EngineFigures,
    InvalidPayload,
    SyncedConfig,
    decode_as_sent,
    decode_ready_response,
    decode_static_labels,
    is_set,
    sync,
)

log = logging.getLogger("cache_config_exporter.state")

_static_encoder = msgspec.json.Encoder()
# Changes taken into one transaction at most; bounds the latency one commit adds.
MAX_BATCH = 512
# While the store is failing, how often the writer probes it to notice recovery.
PROBE_INTERVAL_SECONDS = 0.5
# How often the writer looks for replicas whose heartbeats stopped: the precision of expiry.
EXPIRY_CHECK_SECONDS = 1.0
# The replica of a sender that names none: one vLLM server per deployment, as before replicas existed.
DEFAULT_REPLICA = "default"

ReplicaKey = tuple[str, str]


def _catch_up(batch: _Batch) -> None:
    """The change of a refresh: none; its batch only loads what other processes committed."""


class StorageUnavailable(RuntimeError):
    """A write could not be committed; nothing was changed."""


class LimitExceeded(InvalidPayload):
    """A change would pass a cardinality limit; existing series stay as they are."""


class UnknownReplica(LookupError):
    """A heartbeat for a replica the exporter does not hold: its sender must send its state again."""


class EngineReport(msgspec.Struct, frozen=True):
    """One engine's latest ready response: the bytes as received, decoded, and when (Unix seconds)."""

    engine: int
    received_at: float
    response: EngineCoreReadyResponse
    payload: bytes
    wire_format: str


class Replica(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's inputs and the config synced from them; never changed, only replaced."""

    deployment: str
    name: str
    instance_id: str | None
    static_labels: dict[str, str]
    # Seconds between the heartbeats its sender promised; None for one-off pushes, which never expire.
    heartbeat_seconds: float | None
    last_seen: float
    engines: Mapping[int, EngineReport]
    synced: SyncedConfig

    @property
    def key(self) -> ReplicaKey:
        return (self.deployment, self.name)


class EngineView(msgspec.Struct, kw_only=True):
    """What the JSON API shows of one engine: its figures and every key it sent."""

    engine: int
    received_at: float
    wire_format: str
    figures: EngineFigures
    response: object


class ReplicaView(msgspec.Struct, kw_only=True):
    """What the JSON API shows of a replica."""

    deployment: str
    replica: str
    instance_id: str | None
    heartbeat_seconds: float | None
    last_seen: float
    vllm_release: str
    mamba_cache_mode: str
    labels: dict[str, str]
    max_model_len: int | None
    dp_stats_address: str | None
    data_parallel_size: int | None
    distinct_values: dict[str, int]
    static_labels: dict[str, str]
    engines: list[EngineView]


def view(replica: Replica) -> ReplicaView:
    synced = replica.synced
    return ReplicaView(
        deployment=replica.deployment,
        replica=replica.name,
        instance_id=replica.instance_id,
        heartbeat_seconds=replica.heartbeat_seconds,
        last_seen=replica.last_seen,
        vllm_release=synced.release,
        mamba_cache_mode=synced.mamba_cache_mode,
        labels=synced.labels,
        max_model_len=synced.max_model_len,
        dp_stats_address=synced.dp_stats_address,
        data_parallel_size=synced.data_parallel_size,
        distinct_values=synced.distinct_values,
        static_labels=replica.static_labels,
        engines=[
            EngineView(
                engine=index,
                received_at=report.received_at,
                wire_format=report.wire_format,
                figures=synced.engines[index],
                response=decode_as_sent(report.payload, report.wire_format),
            )
            for index, report in sorted(replica.engines.items())
        ],
    )


def _promised(current: Replica | None, heartbeat_seconds: float | None) -> float | None:
    """The heartbeat interval a change promises, else the one the replica promised before."""
    if heartbeat_seconds is not None or current is None:
        return heartbeat_seconds
    return current.heartbeat_seconds


@dataclass
class _Batch:
    """The changes of one transaction: staged replicas and the writes that store them."""

    current: Mapping[ReplicaKey, Replica]
    changed: dict[ReplicaKey, Replica | None] = field(default_factory=dict)
    writes: list[Callable[[Store], None]] = field(default_factory=list)
    # Bytes the staged replicas take, once a change needed to know (see ``ExporterState._check_bytes``).
    used_bytes: int | None = None

    def get(self, key: ReplicaKey) -> Replica | None:
        return self.changed[key] if key in self.changed else self.current.get(key)

    def replicas(self) -> set[ReplicaKey]:
        """Every replica after the staged changes."""
        keys = set(self.current)
        for key, replica in self.changed.items():
            if replica is None:
                keys.discard(key)
            else:
                keys.add(key)
        return keys

    def stage(self, key: ReplicaKey, replica: Replica | None, *writes: Callable[[Store], None]) -> None:
        self.changed[key] = replica
        self.writes.extend(writes)


Change = Callable[[_Batch], object]


class ExporterState:
    """All replicas, changed by one writer thread and read as immutable snapshots."""

    def __init__(
        self,
        store: Store,
        base_labels: Mapping[str, str],
        clock: Callable[[], float],
        limits: Limits | None = None,
        missed_heartbeats: int = 3,
        measure: Callable[[Replica], int] | None = None,
    ) -> None:
        self._store = store
        self._base_labels = dict(base_labels)
        self._clock = clock
        self._limits = limits or Limits()
        self._missed_heartbeats = missed_heartbeats
        self._measure = measure
        # Each replica's measured bytes, kept with the (immutable) replica they were measured on.
        self._sizes: dict[ReplicaKey, tuple[Replica, int]] = {}
        # A replica gets a full expiry period from start-up: it cannot have sent heartbeats to a stopped exporter.
        self._started = clock()
        self._next_expiry_check = self._started
        try:
            self._replicas: Mapping[ReplicaKey, Replica] = self._load()
        except (sqlite3.Error, InvalidPayload, msgspec.DecodeError) as error:
            raise StorageError(f"cannot load storage {store.path}: {error}") from None
        # Bumped whenever what /metrics shows may have changed; caches key on it.
        self.version = 0
        self.storage_error: str | None = None
        # Replicas this process removed because their heartbeats stopped.
        self.expired_total = 0
        self._queue: queue.SimpleQueue[tuple[Change, Future[object]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="cache-config-writer", daemon=True)
        self._writer.start()

    # Reading -----------------------------------------------------------------

    def snapshot(self) -> Mapping[ReplicaKey, Replica]:
        """Every replica by (deployment, replica); a consistent view that later changes never touch."""
        return self._replicas

    def replicas_of(self, deployment: str) -> list[Replica]:
        return [replica for key, replica in sorted(self._replicas.items()) if key[0] == deployment]

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

        def change(batch: _Batch) -> Replica:
            current = self._existing_or_room(batch, key)
            engines = dict(current.engines) if current else {}
            instance_id = current.instance_id if current else None
            restarted = is_set(response.instance_id) and response.instance_id != instance_id
            if restarted:
                engines.clear()
                instance_id = response.instance_id
            if engine not in engines and len(engines) >= self._limits.engines_per_replica:
                raise LimitExceeded(
                    "engine",
                    f"replica {key[1]!r} of {key[0]!r} holds its limit of {self._limits.engines_per_replica} engines",
                )
            now = self._clock()
            engines[engine] = EngineReport(engine, now, response, payload, wire_format)
            updated = self._build(
                key,
                instance_id,
                current.static_labels if current else {},
                _promised(current, heartbeat_seconds),
                now,
                engines,
            )
            self._check_bytes(batch, key, updated)
            stored = StoredEngine(payload, wire_format, now)
            writes = [self._save(updated)]
            if restarted:
                writes.append(lambda store: store.delete_engines(*key))
            writes.append(lambda store: store.save_engine(*key, engine, stored))
            batch.stage(key, updated, *writes)
            return updated

        return self._submit(change)

    def set_static_labels(
        self, key: ReplicaKey, static_labels: Mapping[str, str], heartbeat_seconds: float | None = None
    ) -> Future[object]:
        """Replace a replica's static labels (its frontend's ``metrics_info()``), creating it if needed."""

        def change(batch: _Batch) -> Replica:
            current = self._existing_or_room(batch, key)
            updated = self._build(
                key,
                current.instance_id if current else None,
                dict(static_labels),
                _promised(current, heartbeat_seconds),
                self._clock(),
                current.engines if current else {},
            )
            self._check_bytes(batch, key, updated)
            batch.stage(key, updated, self._save(updated))
            return updated

        return self._submit(change)

    def heartbeat(self, key: ReplicaKey, heartbeat_seconds: float) -> Future[object]:
        """The replica is alive and promises the next heartbeat within ``heartbeat_seconds``.

        The future fails with ``UnknownReplica`` when the exporter does not hold it
        (a new or restarted exporter): the sender then sends its whole state again.
        """

        def change(batch: _Batch) -> Replica:
            current = batch.get(key)
            if current is None:
                raise UnknownReplica(key)
            updated = msgspec.structs.replace(current, heartbeat_seconds=heartbeat_seconds, last_seen=self._clock())
            batch.stage(key, updated, self._save(updated))
            return updated

        return self._submit(change)

    def delete_replica(self, key: ReplicaKey) -> Future[object]:
        """Forget a replica (its sender said goodbye); the future's result says whether there was one."""

        def change(batch: _Batch) -> bool:
            if batch.get(key) is None:
                return False
            batch.stage(key, None, lambda store: store.delete_replica(*key))
            return True

        return self._submit(change)

    def delete_deployment(self, deployment: str) -> Future[object]:
        """Forget every replica of a deployment; the future's result says whether there was one."""

        def change(batch: _Batch) -> bool:
            keys = [key for key in batch.replicas() if key[0] == deployment]
            for key in keys:
                batch.stage(key, None, lambda store, key=key: store.delete_replica(*key))
            return bool(keys)

        return self._submit(change)

    def delete_engine(self, key: ReplicaKey, engine: int) -> Future[object]:
        """Forget one engine; the future's result is the updated replica, or ``None`` if there was no such engine."""

        def change(batch: _Batch) -> Replica | None:
            current = batch.get(key)
            if current is None or engine not in current.engines:
                return None
            engines = {index: report for index, report in current.engines.items() if index != engine}
            updated = msgspec.structs.replace(current, engines=MappingProxyType(engines), synced=self._sync(
                current.static_labels, engines))  # fmt: skip
            batch.stage(key, updated, lambda store: store.delete_engine(*key, engine))
            return updated

        return self._submit(change)

    def _existing_or_room(self, batch: _Batch, key: ReplicaKey) -> Replica | None:
        """The replica, or ``None`` for a new one once the caps leave room for it."""
        current = batch.get(key)
        if current is not None:
            return current
        keys = batch.replicas()
        siblings = sum(1 for other in keys if other[0] == key[0])
        if siblings == 0 and len({other[0] for other in keys}) >= self._limits.deployments:
            raise LimitExceeded("deployment", f"the exporter holds its limit of {self._limits.deployments} deployments")
        if siblings >= self._limits.replicas_per_deployment:
            raise LimitExceeded(
                "replica", f"deployment {key[0]!r} holds its limit of {self._limits.replicas_per_deployment} replicas"
            )
        return None

    def _size(self, key: ReplicaKey, replica: Replica) -> int:
        assert self._measure is not None
        known = self._sizes.get(key)
        if known is None or known[0] is not replica:
            known = self._sizes[key] = (replica, self._measure(replica))
        return known[1]

    def _check_bytes(self, batch: _Batch, key: ReplicaKey, updated: Replica) -> None:
        """Refuse a change that would take the replicas past the byte budget (a change that shrinks one passes)."""
        budget = self._limits.bytes
        if budget is None or self._measure is None:
            return
        if batch.used_bytes is None:
            self._sizes = {known: size for known, size in self._sizes.items() if known in batch.current}
            batch.used_bytes = sum(self._size(other, replica) for other, replica in batch.current.items())
        current = batch.get(key)
        before = self._size(key, current) if current is not None else 0
        size = self._size(key, updated)
        used = batch.used_bytes - before + size
        if size > before and used > budget:
            raise LimitExceeded(
                "bytes",
                f"replica {key[1]!r} of {key[0]!r} would take the exposition and JSON state to {used} bytes, past "
                f"the budget of {budget} bytes (--limits.bytes)",
            )
        batch.used_bytes = used

    def _expiry_due(self) -> bool:
        return self._clock() >= self._next_expiry_check and any(
            replica.heartbeat_seconds for replica in self._replicas.values()
        )

    def _expire(self, batch: _Batch) -> int:
        """Stage the removal of every replica whose heartbeats stopped; how many."""
        now = self._clock()
        if now < self._next_expiry_check:
            return 0
        self._next_expiry_check = now + EXPIRY_CHECK_SECONDS
        expired = 0
        for key, replica in batch.current.items():
            if key in batch.changed or replica.heartbeat_seconds is None:
                continue
            deadline = max(replica.last_seen, self._started) + replica.heartbeat_seconds * self._missed_heartbeats
            if now > deadline:
                log.warning(
                    "replica %r of %r expired: no heartbeat for %.0f s", key[1], key[0], now - replica.last_seen
                )
                batch.stage(key, None, lambda store, key=key: store.delete_replica(*key))
                expired += 1
        return expired

    def refresh(self) -> Future[object]:
        """Load what other worker processes committed (every batch does this first); a batch of refreshes
        alone reads in a read transaction, so it never waits for another process's write lock."""
        return self._submit(_catch_up)

    def close(self) -> None:
        """Finish every queued change, then stop the writer."""
        self._queue.put(None)
        self._writer.join()

    # The writer thread ---------------------------------------------------------

    def _submit(self, change: Change) -> Future[object]:
        future: Future[object] = Future()
        self._queue.put((change, future))
        return future

    def _write_loop(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=PROBE_INTERVAL_SECONDS if self.storage_error else EXPIRY_CHECK_SECONDS)
            except queue.Empty:
                # Idle: probe a failing store, or look for replicas whose heartbeats stopped.
                if self.storage_error or self._expiry_due():
                    self._commit([])
                continue
            jobs = [first]
            while len(jobs) < MAX_BATCH and jobs[-1] is not None:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = jobs[-1] is None
            self._commit([job for job in jobs if job is not None])
            if stop:
                return

    def _commit(self, jobs: list[tuple[Change, Future[object]]]) -> None:
        outcomes: list[tuple[Future[object], object, BaseException | None]] = []
        try:
            writing = self._expiry_due() or any(change is not _catch_up for change, _ in jobs)
            with self._store.transaction() if writing else self._store.read_transaction():
                current = self._load() if self._store.changed_elsewhere() else self._replicas
                batch = _Batch(current)
                expired = self._expire(batch) if writing else 0
                for change, future in jobs:
                    try:
                        outcomes.append((future, change(batch), None))
                    except (InvalidPayload, UnknownReplica) as refused:
                        outcomes.append((future, None, refused))
                    except Exception as bug:  # fails this change alone (a 500), never the writer thread
                        log.exception("change failed")
                        outcomes.append((future, None, bug))
                for write in batch.writes:
                    write(self._store)
        except Exception as error:
            failure: Exception = error
            if isinstance(error, sqlite3.Error):
                if self.storage_error is None:
                    log.error("storage failing, writes refused until it recovers: %s", error)
                self.storage_error = str(error)
                failure = StorageUnavailable(str(error))
            else:
                log.exception("batch failed, nothing committed")
            answered = {id(future) for future, _, _ in outcomes}
            for future, _, refused in outcomes:
                future.set_exception(refused or failure)
            for _, future in jobs:
                if id(future) not in answered:
                    future.set_exception(failure)
            return
        # Only a committed write shows that the store takes writes again: a batch without one
        # (a refresh, refused changes, or none at all) also commits on a full disk.
        if self.storage_error is not None and (batch.writes or self._probe()):
            log.warning("storage recovered")
            self.storage_error = None
        self.expired_total += expired
        if current is not self._replicas or batch.changed:
            merged = current.copy()  # the underlying dict at C speed; dict(proxy) goes key by key
            for key, replica in batch.changed.items():
                if replica is None:
                    merged.pop(key, None)
                else:
                    merged[key] = replica
            self._replicas = MappingProxyType(merged)
            self.version += 1
        for future, result, refused in outcomes:
            if refused is None:
                future.set_result(result)
            else:
                future.set_exception(refused)

    def _probe(self) -> bool:
        """Commit one probe write; True when it went through."""
        try:
            with self._store.transaction():
                self._store.probe()
        except sqlite3.Error as error:
            self.storage_error = str(error)
            return False
        return True

    # Building replicas ---------------------------------------------------------

    def _load(self) -> Mapping[ReplicaKey, Replica]:
        return MappingProxyType(
            {(stored.deployment, stored.replica): self._restore(stored) for stored in self._store.load()}
        )

    def _restore(self, stored: StoredReplica) -> Replica:
        engines = {
            engine: EngineReport(
                engine,
                row.received_at,
                decode_ready_response(row.payload, row.wire_format),
                row.payload,
                row.wire_format,
            )
            for engine, row in stored.engines.items()
        }
        # Version 1 stored typed JSON values; rendering them gives the strings vLLM shows.
        static_labels = decode_static_labels(stored.static_config)
        key = (stored.deployment, stored.replica)
        return self._build(key, stored.instance_id, static_labels, stored.heartbeat_seconds, stored.last_seen, engines)

    def _sync(self, static_labels: Mapping[str, str], engines: Mapping[int, EngineReport]) -> SyncedConfig:
        return sync(
            {**self._base_labels, **static_labels}, {index: report.response for index, report in engines.items()}
        )

    def _build(
        self,
        key: ReplicaKey,
        instance_id: str | None,
        static_labels: dict[str, str],
        heartbeat_seconds: float | None,
        last_seen: float,
        engines: Mapping[int, EngineReport],
    ) -> Replica:
        return Replica(
            deployment=key[0],
            name=key[1],
            instance_id=instance_id,
            static_labels=static_labels,
            heartbeat_seconds=heartbeat_seconds,
            last_seen=last_seen,
            engines=MappingProxyType(dict(engines)),
            synced=self._sync(static_labels, engines),
        )

    @staticmethod
    def _save(replica: Replica) -> Callable[[Store], None]:
        stored = StoredReplica(
            replica.deployment,
            replica.name,
            _static_encoder.encode(replica.static_labels),
            replica.instance_id,
            replica.heartbeat_seconds,
            replica.last_seen,
        )
        return lambda store: store.save_replica(stored)
