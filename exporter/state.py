"""The exporter's state: every deployment's inputs and synced config, in memory and in the store.

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

from exporter.storage import StorageError, Store, StoredDeployment, StoredEngine
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


def _catch_up(batch: _Batch) -> None:
    """The change of a refresh: none; its batch only loads what other processes committed."""


class StorageUnavailable(RuntimeError):
    """A write could not be committed; nothing was changed."""


class LimitExceeded(InvalidPayload):
    """A change would pass a cardinality limit; existing series stay as they are."""


class EngineReport(msgspec.Struct, frozen=True):
    """One engine's latest ready response: the bytes as received, decoded, and when (Unix seconds)."""

    engine: int
    received_at: float
    response: EngineCoreReadyResponse
    payload: bytes
    wire_format: str


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment's inputs and the config synced from them; never changed, only replaced."""

    name: str
    instance_id: str | None
    static_labels: dict[str, str]
    engines: Mapping[int, EngineReport]
    synced: SyncedConfig


class EngineView(msgspec.Struct, kw_only=True):
    """What the JSON API shows of one engine: its figures and every key it sent."""

    engine: int
    received_at: float
    wire_format: str
    figures: EngineFigures
    response: object


class DeploymentView(msgspec.Struct, kw_only=True):
    """What the JSON API shows of a deployment."""

    deployment: str
    instance_id: str | None
    vllm_release: str
    mamba_cache_mode: str
    labels: dict[str, str]
    max_model_len: int | None
    dp_stats_address: str | None
    data_parallel_size: int | None
    distinct_values: dict[str, int]
    static_labels: dict[str, str]
    engines: list[EngineView]


def view(deployment: Deployment) -> DeploymentView:
    synced = deployment.synced
    return DeploymentView(
        deployment=deployment.name,
        instance_id=deployment.instance_id,
        vllm_release=synced.release,
        mamba_cache_mode=synced.mamba_cache_mode,
        labels=synced.labels,
        max_model_len=synced.max_model_len,
        dp_stats_address=synced.dp_stats_address,
        data_parallel_size=synced.data_parallel_size,
        distinct_values=synced.distinct_values,
        static_labels=deployment.static_labels,
        engines=[
            EngineView(
                engine=index,
                received_at=report.received_at,
                wire_format=report.wire_format,
                figures=synced.engines[index],
                response=decode_as_sent(report.payload, report.wire_format),
            )
            for index, report in sorted(deployment.engines.items())
        ],
    )


@dataclass(frozen=True)
class Limits:
    """Cardinality caps: a change past them is refused and existing series stay."""

    deployments: int = 10_000
    engines_per_deployment: int = 1_024
    # Bytes of exposition and JSON state all deployments may take (as ``ExporterState``'s ``measure`` counts them).
    bytes: int | None = None


@dataclass
class _Batch:
    """The changes of one transaction: staged deployments and the writes that store them."""

    current: Mapping[str, Deployment]
    changed: dict[str, Deployment | None] = field(default_factory=dict)
    writes: list[Callable[[Store], None]] = field(default_factory=list)
    # Bytes the staged deployments take, once a change needed to know (see ``ExporterState._check_bytes``).
    used_bytes: int | None = None

    def get(self, name: str) -> Deployment | None:
        return self.changed[name] if name in self.changed else self.current.get(name)

    def count(self) -> int:
        added = sum(1 for name, d in self.changed.items() if d is not None and name not in self.current)
        removed = sum(1 for name, d in self.changed.items() if d is None and name in self.current)
        return len(self.current) + added - removed

    def stage(self, name: str, deployment: Deployment | None, *writes: Callable[[Store], None]) -> None:
        self.changed[name] = deployment
        self.writes.extend(writes)


Change = Callable[[_Batch], object]


class ExporterState:
    """All deployments, changed by one writer thread and read as immutable snapshots."""

    def __init__(
        self,
        store: Store,
        base_labels: Mapping[str, str],
        clock: Callable[[], float],
        limits: Limits | None = None,
        measure: Callable[[Deployment], int] | None = None,
    ) -> None:
        self._store = store
        self._base_labels = dict(base_labels)
        self._clock = clock
        self._limits = limits or Limits()
        self._measure = measure
        # Each deployment's measured bytes, kept with the (immutable) deployment they were measured on.
        self._sizes: dict[str, tuple[Deployment, int]] = {}
        try:
            self._deployments: Mapping[str, Deployment] = self._load()
        except (sqlite3.Error, InvalidPayload, msgspec.DecodeError) as error:
            raise StorageError(f"cannot load storage {store.path}: {error}") from None
        # Bumped whenever what /metrics shows may have changed; caches key on it.
        self.version = 0
        self.storage_error: str | None = None
        self._queue: queue.SimpleQueue[tuple[Change, Future[object]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="cache-config-writer", daemon=True)
        self._writer.start()

    # Reading -----------------------------------------------------------------

    def snapshot(self) -> Mapping[str, Deployment]:
        """Every deployment by name; a consistent view that later changes never touch."""
        return self._deployments

    def get(self, name: str) -> Deployment | None:
        return self._deployments.get(name)

    # Changing ----------------------------------------------------------------

    def apply_ready(
        self, name: str, engine: int, response: EngineCoreReadyResponse, payload: bytes, wire_format: str
    ) -> Future[object]:
        """Take one engine's ready response (decoded, and its bytes as received).

        A new ``instance_id`` drops the previous run's engines.

        The future fails with ``SyncConflict`` or ``LimitExceeded`` (nothing changed) when
        the change is refused, and with ``StorageUnavailable`` when it cannot be committed.
        """

        def change(batch: _Batch) -> Deployment:
            current = batch.get(name)
            if current is None:
                self._check_room(batch)
            static_labels = current.static_labels if current else {}
            engines = dict(current.engines) if current else {}
            instance_id = current.instance_id if current else None
            restarted = is_set(response.instance_id) and response.instance_id != instance_id
            if restarted:
                engines.clear()
                instance_id = response.instance_id
            if engine not in engines and len(engines) >= self._limits.engines_per_deployment:
                raise LimitExceeded(
                    "engine", f"deployment {name!r} holds its limit of {self._limits.engines_per_deployment} engines"
                )
            report = EngineReport(engine, self._clock(), response, payload, wire_format)
            engines[engine] = report
            updated = self._build(name, instance_id, static_labels, engines)
            self._check_bytes(batch, name, updated)
            stored = StoredEngine(payload, wire_format, report.received_at)
            static = _static_encoder.encode(static_labels)

            def write_deployment(store: Store) -> None:
                store.save_deployment(name, static, instance_id)
                if restarted:
                    store.delete_engines(name)

            batch.stage(
                name,
                updated,
                write_deployment,
                lambda store: store.save_engine(name, engine, stored),
            )
            return updated

        return self._submit(change)

    def set_static_labels(self, name: str, static_labels: Mapping[str, str]) -> Future[object]:
        """Replace a deployment's static labels (its frontend's ``metrics_info()``), creating it if needed."""

        def change(batch: _Batch) -> Deployment:
            current = batch.get(name)
            if current is None:
                self._check_room(batch)
            instance_id = current.instance_id if current else None
            updated = self._build(name, instance_id, static_labels, current.engines if current else {})
            self._check_bytes(batch, name, updated)
            static = _static_encoder.encode(static_labels)
            batch.stage(name, updated, lambda store: store.save_deployment(name, static, instance_id))
            return updated

        return self._submit(change)

    def delete_deployment(self, name: str) -> Future[object]:
        """Forget a deployment; the future's result says whether there was one."""

        def change(batch: _Batch) -> bool:
            if batch.get(name) is None:
                return False
            batch.stage(name, None, lambda store: store.delete_deployment(name))
            return True

        return self._submit(change)

    def delete_engine(self, name: str, engine: int) -> Future[object]:
        """Forget one engine; the future's result is the updated deployment, or ``None`` if there was no such engine."""

        def change(batch: _Batch) -> Deployment | None:
            current = batch.get(name)
            if current is None or engine not in current.engines:
                return None
            engines = {index: report for index, report in current.engines.items() if index != engine}
            updated = self._build(name, current.instance_id, current.static_labels, engines)
            batch.stage(name, updated, lambda store: store.delete_engine(name, engine))
            return updated

        return self._submit(change)

    def _check_room(self, batch: _Batch) -> None:
        """Refuse a new deployment once the limit is reached."""
        if batch.count() >= self._limits.deployments:
            raise LimitExceeded("deployment", f"the exporter holds its limit of {self._limits.deployments} deployments")

    def _size(self, name: str, deployment: Deployment) -> int:
        assert self._measure is not None
        known = self._sizes.get(name)
        if known is None or known[0] is not deployment:
            known = self._sizes[name] = (deployment, self._measure(deployment))
        return known[1]

    def _check_bytes(self, batch: _Batch, name: str, updated: Deployment) -> None:
        """Refuse a change that would take the deployments past the byte budget (a change that shrinks one passes)."""
        budget = self._limits.bytes
        if budget is None or self._measure is None:
            return
        if batch.used_bytes is None:
            self._sizes = {key: known for key, known in self._sizes.items() if key in batch.current}
            batch.used_bytes = sum(self._size(key, deployment) for key, deployment in batch.current.items())
        current = batch.get(name)
        before = self._size(name, current) if current is not None else 0
        size = self._size(name, updated)
        used = batch.used_bytes - before + size
        if size > before and used > budget:
            raise LimitExceeded(
                "bytes",
                f"deployment {name!r} would take the exposition and JSON state to {used} bytes, past the budget of "
                f"{budget} bytes (--limits.bytes)",
            )
        batch.used_bytes = used

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
                first = self._queue.get(timeout=PROBE_INTERVAL_SECONDS if self.storage_error else None)
            except queue.Empty:
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
            writing = any(change is not _catch_up for change, _ in jobs)
            with self._store.transaction() if writing else self._store.read_transaction():
                current = self._load() if self._store.changed_elsewhere() else self._deployments
                batch = _Batch(current)
                for change, future in jobs:
                    try:
                        outcomes.append((future, change(batch), None))
                    except InvalidPayload as refused:
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
        if current is not self._deployments or batch.changed:
            merged = current.copy()  # the underlying dict at C speed; dict(proxy) goes key by key
            for name, deployment in batch.changed.items():
                if deployment is None:
                    merged.pop(name, None)
                else:
                    merged[name] = deployment
            self._deployments = MappingProxyType(merged)
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

    # Building deployments ----------------------------------------------------

    def _load(self) -> Mapping[str, Deployment]:
        return MappingProxyType({stored.name: self._restore(stored) for stored in self._store.load()})

    def _restore(self, stored: StoredDeployment) -> Deployment:
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
        return self._build(stored.name, stored.instance_id, static_labels, engines)

    def _build(
        self,
        name: str,
        instance_id: str | None,
        static_labels: Mapping[str, str],
        engines: Mapping[int, EngineReport],
    ) -> Deployment:
        synced = sync(
            {**self._base_labels, **static_labels}, {index: report.response for index, report in engines.items()}
        )
        return Deployment(
            name=name,
            instance_id=instance_id,
            static_labels=dict(static_labels),
            engines=MappingProxyType(dict(engines)),
            synced=synced,
        )
