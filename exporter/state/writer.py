"""The one writer thread: every change is committed by it, in groups, before anyone hears of it.

It takes every change waiting in its queue, runs each on a ``Batch`` (a change
may refuse itself), writes the accepted ones in ONE transaction (group commit:
eight clients cost about one fsync), and only after the commit swaps them into
memory and answers their futures. So memory never shows what was not
committed, and nothing is acknowledged before it is durable. Readers take the
current immutable snapshot (a ``ReplicaMap``: a commit copies only the shards
it changed).

One exception, by design: what a heartbeat changes ("last seen", the promised
interval) may be kept in memory only (``Batch.touch``) and is written for all
such replicas at once by a checkpoint every ``CHECKPOINT_SECONDS`` and when the
writer stops (docs/RELIABILITY.md, "Heartbeats and the expiry clock").

The limits need running totals (replicas per deployment, deployments, bytes
per replica); ``Census`` keeps them as commits land, so no change counts the
fleet. Several processes may share one store: each batch first loads what the
others committed (and counts it again). While the store fails, the writer
checks it takes writes again, to notice recovery.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

from exporter.errors import Refused, StorageUnavailable
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, ReplicaKey
from exporter.state.storage import LastSeen, Store
from exporter.state.write_queue import Job, WriteQueue
from protocol import InvalidPayload

log = logging.getLogger("cache_config_exporter.writer")

# While the store is failing, how often the writer checks that it takes writes again, to notice recovery.
STORAGE_CHECK_SECONDS = 0.5
# How often an idle writer runs its housekeeping (heartbeat expiry): the precision of expiry.
HOUSEKEEPING_SECONDS = 1.0
# How often an idle writer folds in the heartbeats heard: a read waits for the fold of at most this long's
# heartbeats (a scrape of 10,000 replicas at 30 s: about 33, not a second's 333).
FOLD_SECONDS = 0.1
# How often what heartbeats changed in memory is written to the store: what a crash may lose of "last seen".
# Short, so that each checkpoint is small: a read waits for the one under way (10,000 replicas at 30 s: about
# 333 rows, not 5 s worth of them; what those cost: docs/RELIABILITY.md, "Heartbeats and the expiry clock").
CHECKPOINT_SECONDS = 1.0

# Hears each commit that changed replicas: the map before it, the map after it, and the replicas it put in.
RenderAhead = Callable[[ReplicaMap, ReplicaMap, Sequence[Replica]], None]


class Census:
    """Running totals of the committed replicas: the names of each deployment's replicas, and each replica's
    bytes (as ``measure`` counts them) with their sum. Kept by the writer thread alone."""

    def __init__(self, replicas: Mapping[ReplicaKey, Replica], measure: Callable[[Replica], int] | None) -> None:
        self.members: dict[str, set[str]] = {}
        self.sizes: dict[ReplicaKey, int] = {}
        self.bytes = 0
        for key, replica in replicas.items():
            self.members.setdefault(key[0], set()).add(key[1])
            if measure is not None:
                self.sizes[key] = size = measure(replica)
                self.bytes += size

    def apply(self, batch: Batch) -> None:
        """Count a committed batch: each of its changes once."""
        for key, replica in batch.changed.items():
            names = self.members.get(key[0])
            if replica is None:
                if names is not None:
                    names.discard(key[1])
                    if not names:
                        del self.members[key[0]]
                self.sizes.pop(key, None)
            else:
                if names is None:
                    self.members[key[0]] = {key[1]}
                else:
                    names.add(key[1])
                if key in batch.sizes:
                    self.sizes[key] = batch.sizes[key]
        self.bytes = batch.used_bytes


class Batch:
    """The changes of one transaction: staged replicas, the writes that store them, and what they count.

    It answers what the limits ask (how many replicas a deployment holds, how many deployments, what a
    replica takes) from the committed ``Census`` and its own staged changes: never by counting the fleet.
    """

    def __init__(self, current: ReplicaMap, census: Census) -> None:
        self.current = current
        self.census = census
        self.changed: dict[ReplicaKey, Replica | None] = {}
        self.writes: list[Callable[[Store], None]] = []
        # Replicas staged by ``touch``: their last seen is stored by a checkpoint, not by this batch.
        self.touched: set[ReplicaKey] = set()
        # Events to count once committed (``"accepted"``, ``"expired"``).
        self.counts: Counter[str] = Counter()
        # Bytes of the replicas staged with a size; those staged without keep their committed size.
        self.sizes: dict[ReplicaKey, int] = {}
        self.used_bytes = census.bytes
        self._members: dict[str, int] = {}
        self._deployments = len(census.members)

    def get(self, key: ReplicaKey) -> Replica | None:
        return self.changed[key] if key in self.changed else self.current.get(key)

    def replicas_in(self, deployment: str) -> int:
        """How many replicas ``deployment`` holds with the staged changes."""
        committed = len(self.census.members.get(deployment, ()))
        return committed + self._members.get(deployment, 0)

    def deployments(self) -> int:
        """How many deployments hold a replica with the staged changes."""
        return self._deployments

    def names(self, deployment: str) -> set[str]:
        """The names of ``deployment``'s replicas with the staged changes (a scan of this batch's changes only)."""
        names = set(self.census.members.get(deployment, ()))
        for key, replica in self.changed.items():
            if key[0] == deployment:
                (names.discard if replica is None else names.add)(key[1])
        return names

    def size(self, key: ReplicaKey) -> int:
        """What the replica takes, as last measured (0 for none)."""
        if key in self.sizes:
            return self.sizes[key]
        return self.census.sizes.get(key, 0)

    def stage(
        self, key: ReplicaKey, replica: Replica | None, *writes: Callable[[Store], None], size: int | None = None
    ) -> None:
        """Stage ``replica`` (``None``: its removal) with the writes that store it; ``size``, what it takes when
        measured (a removal takes nothing; without one a replica keeps what it took)."""
        before = self.get(key)
        if replica is None:
            size = 0
        if size is not None:
            self.used_bytes += size - self.size(key)
            self.sizes[key] = size
        if (before is None) != (replica is None):
            count = self.replicas_in(key[0])
            delta = 1 if before is None else -1
            self._members[key[0]] = self._members.get(key[0], 0) + delta
            if count == 0 or count + delta == 0:
                self._deployments += delta
        self.changed[key] = replica
        self.writes.extend(writes)

    def touch(self, key: ReplicaKey, replica: Replica) -> None:
        """Stage an existing replica of which only what a heartbeat changes changed: kept in memory, stored by the
        next checkpoint."""
        self.changed[key] = replica
        self.touched.add(key)


Change = Callable[[Batch], object]


def _catch_up(batch: Batch) -> None:
    """The change of a refresh: none; its batch only loads what other processes committed."""


class Housekeeping(Protocol):
    """Changes due without a request: what was heard outside the queue (heartbeats), folded first into every
    batch and within ``FOLD_SECONDS`` when idle; heartbeat expiry, asked at most once per
    ``HOUSEKEEPING_SECONDS``; told of every commit (``reloaded``: the replicas were loaded again from the store)."""

    def pending(self) -> bool: ...
    def fold(self, batch: Batch) -> None: ...
    def due(self, replicas: ReplicaMap) -> bool: ...
    def run(self, batch: Batch) -> None: ...
    def committed(self, changed: Mapping[ReplicaKey, Replica | None], reloaded: bool) -> None: ...


# How one change settles: its future, its result and its refusal (``None`` when it was taken).
Settlement = tuple[Future[object], object, BaseException | None]


def _answer(settlements: list[Settlement]) -> None:
    """Each change's future gets its result, or its refusal."""
    for future, result, refused in settlements:
        if refused is None:
            future.set_result(result)
        else:
            future.set_exception(refused)


def _fail(jobs: list[Job], settlements: list[Settlement], error: BaseException) -> None:
    """A batch that did not commit: a change refused on its own keeps its refusal, every other fails with ``error``."""
    answered = {id(future) for future, _, _ in settlements}
    for future, _, refused in settlements:
        future.set_exception(refused or error)
    for job in jobs:
        if id(job.future) not in answered:
            job.future.set_exception(error)


def _last_seen(unsaved: set[ReplicaKey], batch: Batch) -> list[LastSeen]:
    """The rows of a checkpoint: every replica whose last seen is in memory only, as this batch leaves it."""
    rows = []
    for key in unsaved | batch.touched:
        replica = batch.get(key)
        if replica is not None:
            rows.append(LastSeen(key[0], key[1], replica.heartbeat_seconds, replica.last_seen))
    return rows


class Writer:
    """Commits changes on its own thread; ``replicas`` is the last committed state.

    ``load`` reads the whole state from the store; ``measure`` what a replica takes for the byte budget (``None``:
    no budget); ``committed`` hears the counts of each committed batch; ``render_ahead`` each one that changed
    replicas, on this thread and before the new state shows, so that scrapes of it need not render them.
    ``shared``: other processes write the store too, so every batch looks for their commits; else a batch that
    writes nothing (heartbeats kept in memory) touches no SQLite at all.
    """

    def __init__(
        self,
        store: Store,
        load: Callable[[], ReplicaMap],
        housekeeping: Housekeeping,
        committed: Callable[[Counter[str]], None],
        measure: Callable[[Replica], int] | None = None,
        shared: bool = False,
        render_ahead: RenderAhead | None = None,
    ) -> None:
        self._store = store
        self._render_ahead = render_ahead
        self._shared = shared
        self._load = load
        self._housekeeping = housekeeping
        self._committed = committed
        self._measure = measure
        self._next_housekeeping = time.monotonic()
        self._next_checkpoint = time.monotonic() + CHECKPOINT_SECONDS
        self.replicas: ReplicaMap = load()
        self._census = Census(self.replicas, measure)
        # Replicas whose last seen changed in memory since the last checkpoint.
        self._unsaved: set[ReplicaKey] = set()
        # Bumped whenever what the replicas show may have changed; caches key on it.
        self.version = 0
        self.storage_error: str | None = None
        self._queue = WriteQueue()
        self._thread = threading.Thread(target=self._run, name="cache-config-writer", daemon=True)
        self._thread.start()

    def submit(self, change: Change, writes: bool = True, weight: int = 1) -> Future[object]:
        """Queue a change; its future gets the change's result once committed, or its refusal.

        ``writes=False``: the change only reads or touches; a batch of such changes alone takes no write lock;
        ``weight``: the ready responses it takes (a batch takes ``MAX_BATCH`` at most)."""
        future: Future[object] = Future()
        self._queue.put(Job(change, future, writes, weight))
        return future

    def settle(self) -> Future[object]:
        """Done once what was heard before (heartbeats) is committed: it waits for the batch under way at most."""
        return self._queue.settle()

    def refresh(self) -> Future[object]:
        """Load what other processes committed; a batch of refreshes alone reads in a read transaction,
        so it never waits for another process's write lock."""
        return self.submit(_catch_up, writes=False)

    def close(self) -> None:
        """Finish every queued change, write what heartbeats changed (a checkpoint), then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            if self._queue.settling():  # reads wait for what was heard: a batch of no change for them first
                self._commit([], False, False)
            jobs = self._queue.batch(STORAGE_CHECK_SECONDS if self.storage_error else FOLD_SECONDS)
            if jobs is None:
                due = self._housekeeping_is_due()
                checkpoint = self._checkpoint_is_due()
                if self.storage_error or due or checkpoint or self._housekeeping.pending():
                    self._commit([], due, checkpoint)
                continue
            stop = bool(jobs) and jobs[-1] is None
            checkpoint = stop or self._checkpoint_is_due()
            self._commit([job for job in jobs if job is not None], self._housekeeping_is_due(), checkpoint)
            if stop:
                return

    def _commit(self, jobs: list[Job], housekeeping: bool, checkpoint: bool) -> None:
        settling = self._queue.begin()
        settlements: list[Settlement] = [(future, None, None) for future in settling]
        writing = housekeeping or checkpoint or any(job.writes for job in jobs)
        try:
            with self._transaction(writing):
                if self._shared and self._store.changed_elsewhere():
                    current = self._load()
                    census = Census(current, self._measure)
                else:
                    current, census = self.replicas, self._census
                batch = Batch(current, census)
                self._housekeeping.fold(batch)
                if housekeeping:
                    self._housekeeping.run(batch)
                for change, future, _, _ in jobs:
                    try:
                        settlements.append((future, change(batch), None))
                    except (InvalidPayload, Refused) as refused:
                        settlements.append((future, None, refused))
                    except Exception as bug:  # fails this change alone (a 500), never the writer thread
                        log.exception("change failed")
                        settlements.append((future, None, bug))
                for write in batch.writes:
                    write(self._store)
                rows = _last_seen(self._unsaved, batch) if checkpoint else []
                if rows:
                    self._store.save_last_seen(rows)
        except Exception as error:
            if isinstance(error, StorageUnavailable):
                if self.storage_error is None:
                    log.error("storage failing, writes refused until it recovers: %s", error)
                self.storage_error = str(error)
            else:
                log.exception("batch failed, nothing committed")
            _fail(jobs, settlements, error)
            return
        # Only a committed write shows that the store takes writes again: a batch without one
        # (a refresh, refused changes, or none at all) also commits on a full disk.
        if self.storage_error is not None and (batch.writes or self._check_storage()):
            log.warning("storage recovered")
            self.storage_error = None
        if checkpoint:  # removed replicas leave with it too
            self._unsaved.clear()
            self._next_checkpoint = time.monotonic() + CHECKPOINT_SECONDS
        else:
            self._unsaved.update(batch.touched)
        self._housekeeping.committed(batch.changed, reloaded=current is not self.replicas)
        if current is not self.replicas or batch.changed:
            census.apply(batch)
            self._census = census
            replicas = current.with_changes(batch.changed)
            if self._render_ahead is not None and batch.changed:  # before it shows: a scrape of it finds them
                self._render_ahead(current, replicas, [replica for replica in batch.changed.values() if replica])
            self.replicas = replicas
            self.version += 1
        if batch.counts:
            self._committed(batch.counts)
        _answer(settlements)

    def _transaction(self, writing: bool) -> contextlib.AbstractContextManager[None]:
        """A write transaction; for a batch that only reads, a read one when other processes write the store (it
        sees their commits), else none: this process's memory is the whole state."""
        if writing:
            return self._store.transaction()
        return self._store.read_transaction() if self._shared else contextlib.nullcontext()

    def _housekeeping_is_due(self) -> bool:
        """Asked at most once per ``HOUSEKEEPING_SECONDS``: it may look at every replica."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return False
        self._next_housekeeping = now + HOUSEKEEPING_SECONDS
        return self._housekeeping.due(self.replicas)

    def _checkpoint_is_due(self) -> bool:
        """Due every ``CHECKPOINT_SECONDS`` while there is something to write, but not while the store fails:
        heartbeats need no disk, and the first commit after the recovery writes them."""
        return self.storage_error is None and bool(self._unsaved) and time.monotonic() >= self._next_checkpoint

    def _check_storage(self) -> bool:
        """Commit one liveness write to the store; True when it went through."""
        try:
            with self._store.transaction():
                self._store.check_writable()
        except StorageUnavailable as error:
            self.storage_error = str(error)
            return False
        return True
