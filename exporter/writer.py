"""The one writer thread: every change is committed by it, in groups, before anyone hears of it.

It takes every change waiting in its queue, runs each on a ``Batch`` (a change
may refuse itself), writes the accepted ones in ONE transaction (group commit:
eight clients cost about one fsync), and only after the commit swaps them into
memory and answers their futures. So memory never shows what was not
committed, and nothing is acknowledged before it is durable. Readers take the
current immutable snapshot.

Several processes may share one store: each batch first loads what the others
committed. While the store fails, the writer probes it to notice recovery.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from exporter.errors import Refused, StorageUnavailable
from exporter.replicas import Replica, ReplicaKey
from exporter.storage import Store
from protocol import InvalidPayload

log = logging.getLogger("cache_config_exporter.writer")

# Changes taken into one transaction at most; bounds the latency one commit adds.
MAX_BATCH = 512
# While the store is failing, how often the writer probes it to notice recovery.
PROBE_INTERVAL_SECONDS = 0.5
# How often an idle writer runs its housekeeping (heartbeat expiry): the precision of expiry.
HOUSEKEEPING_SECONDS = 1.0

Replicas = MappingProxyType[ReplicaKey, Replica]


@dataclass
class Batch:
    """The changes of one transaction: staged replicas, the writes that store them, and what they count."""

    current: Replicas
    changed: dict[ReplicaKey, Replica | None] = field(default_factory=dict)
    writes: list[Callable[[Store], None]] = field(default_factory=list)
    # Events to count once committed (``"accepted"``, ``"expired"``).
    counts: Counter[str] = field(default_factory=Counter)
    # Bytes the staged replicas take, once a change needed to know (see ``ByteBudget``).
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


Change = Callable[[Batch], object]


def _catch_up(batch: Batch) -> None:
    """The change of a refresh: none; its batch only loads what other processes committed."""


class Housekeeping(Protocol):
    """Changes due without a request (heartbeat expiry); asked at most once per ``HOUSEKEEPING_SECONDS``."""

    def due(self, replicas: Replicas) -> bool: ...
    def run(self, batch: Batch) -> None: ...


class Writer:
    """Commits changes on its own thread; ``replicas`` is the last committed state.

    ``load`` reads the whole state from the store; ``committed`` hears the counts of each committed batch.
    """

    def __init__(
        self,
        store: Store,
        load: Callable[[], Replicas],
        housekeeping: Housekeeping,
        committed: Callable[[Counter[str]], None],
    ) -> None:
        self._store = store
        self._load = load
        self._housekeeping = housekeeping
        self._committed = committed
        self._next_housekeeping = time.monotonic()
        self.replicas: Replicas = load()
        # Bumped whenever what the replicas show may have changed; caches key on it.
        self.version = 0
        self.storage_error: str | None = None
        self._queue: queue.SimpleQueue[tuple[Change, Future[object]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cache-config-writer", daemon=True)
        self._thread.start()

    def submit(self, change: Change) -> Future[object]:
        """Queue a change; its future gets the change's result once committed, or its refusal."""
        future: Future[object] = Future()
        self._queue.put((change, future))
        return future

    def refresh(self) -> Future[object]:
        """Load what other processes committed; a batch of refreshes alone reads in a read transaction,
        so it never waits for another process's write lock."""
        return self.submit(_catch_up)

    def close(self) -> None:
        """Finish every queued change, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                timeout = PROBE_INTERVAL_SECONDS if self.storage_error else HOUSEKEEPING_SECONDS
                first = self._queue.get(timeout=timeout)
            except queue.Empty:
                due = self._housekeeping_is_due()
                if self.storage_error or due:
                    self._commit([], due)
                continue
            jobs = [first]
            while len(jobs) < MAX_BATCH and jobs[-1] is not None:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = jobs[-1] is None
            self._commit([job for job in jobs if job is not None], self._housekeeping_is_due())
            if stop:
                return

    def _commit(self, jobs: list[tuple[Change, Future[object]]], housekeeping: bool) -> None:
        outcomes: list[tuple[Future[object], object, BaseException | None]] = []
        writing = housekeeping or any(change is not _catch_up for change, _ in jobs)
        try:
            with self._store.transaction() if writing else self._store.read_transaction():
                current = self._load() if self._store.changed_elsewhere() else self.replicas
                batch = Batch(current)
                if housekeeping:
                    self._housekeeping.run(batch)
                for change, future in jobs:
                    try:
                        outcomes.append((future, change(batch), None))
                    except (InvalidPayload, Refused) as refused:
                        outcomes.append((future, None, refused))
                    except Exception as bug:  # fails this change alone (a 500), never the writer thread
                        log.exception("change failed")
                        outcomes.append((future, None, bug))
                for write in batch.writes:
                    write(self._store)
        except Exception as error:
            if isinstance(error, StorageUnavailable):
                if self.storage_error is None:
                    log.error("storage failing, writes refused until it recovers: %s", error)
                self.storage_error = str(error)
            else:
                log.exception("batch failed, nothing committed")
            answered = {id(future) for future, _, _ in outcomes}
            for future, _, refused in outcomes:
                future.set_exception(refused or error)
            for _, future in jobs:
                if id(future) not in answered:
                    future.set_exception(error)
            return
        # Only a committed write shows that the store takes writes again: a batch without one
        # (a refresh, refused changes, or none at all) also commits on a full disk.
        if self.storage_error is not None and (batch.writes or self._probe()):
            log.warning("storage recovered")
            self.storage_error = None
        if current is not self.replicas or batch.changed:
            merged = current.copy()  # the underlying dict at C speed; dict(proxy) goes key by key
            for key, replica in batch.changed.items():
                if replica is None:
                    merged.pop(key, None)
                else:
                    merged[key] = replica
            self.replicas = MappingProxyType(merged)
            self.version += 1
        if batch.counts:
            self._committed(batch.counts)
        for future, result, refused in outcomes:
            if refused is None:
                future.set_result(result)
            else:
                future.set_exception(refused)

    def _housekeeping_is_due(self) -> bool:
        """Asked at most once per ``HOUSEKEEPING_SECONDS``: it looks at every replica."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return False
        self._next_housekeeping = now + HOUSEKEEPING_SECONDS
        return self._housekeeping.due(self.replicas)

    def _probe(self) -> bool:
        """Commit one probe write; True when it went through."""
        try:
            with self._store.transaction():
                self._store.probe()
        except StorageUnavailable as error:
            self.storage_error = str(error)
            return False
        return True
