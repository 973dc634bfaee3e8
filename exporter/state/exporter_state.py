"""The exporter's state: its replicas, changed only through the writer by the rules of state/changes.py, read as
immutable snapshots.

Each method submits one change function (with this state's ``Rules``) to the
writer thread and returns the future of its result.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

import msgspec

from exporter.errors import StorageUnavailable
from exporter.state import changes
from exporter.state.changes import EngineReady, Rules
from exporter.state.limits import ByteBudget, Limits
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, ReplicaKey, restored
from exporter.state.storage import StorageError, Store
from exporter.state.writer import Batch, RenderAhead, Writer
from protocol import EngineCoreReadyResponse, InvalidPayload


class ExporterState:
    """All replicas: changed through the writer, read as immutable snapshots.

    ``clock`` gives Unix seconds (what is shown and stored), ``monotonic`` what expiry counts on; ``measure``
    counts a replica's bytes for ``limits.bytes``; ``committed`` hears what each commit counted (``"accepted"``
    ready responses, ``"expired"`` replicas); ``render_ahead`` each commit that changed replicas. ``shared_store``:
    other processes write the same store (``serve --web.workers N``), so heartbeats are committed rather than kept
    in memory until a checkpoint.
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
        monotonic: Callable[[], float] = time.monotonic,
        shared_store: bool = False,
        render_ahead: RenderAhead | None = None,
    ) -> None:
        limits = limits or Limits()
        budget = ByteBudget(limits.bytes, measure) if limits.bytes and measure else None
        self._rules = Rules(dict(base_labels), limits, clock, monotonic, budget, missed_heartbeats, shared_store)
        started = monotonic()

        def load() -> ReplicaMap:
            wall, now = clock(), monotonic()
            return ReplicaMap.of(
                restored(one, self._rules.base_labels, changes.seen_at_load(one.last_seen, wall, now, started))
                for one in store.load()
            )

        try:
            self._liveness = changes.Liveness(self._rules)
            self._writer = Writer(
                store, load, self._liveness, committed, budget.measure if budget else None, shared_store,
                render_ahead,
            )  # fmt: skip
        except (StorageUnavailable, InvalidPayload, msgspec.DecodeError) as error:
            # One line whatever the stored input holds: a control character shows escaped.
            shown = str(error).encode("unicode_escape").decode("ascii")
            raise StorageError(f"cannot load storage {store.path}: {shown}") from None

    # Reading -----------------------------------------------------------------

    def snapshot(self) -> ReplicaMap:
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
        """Finish every queued change, store what heartbeats changed, then stop the writer."""
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
        shown: bytes | None = None,
    ) -> Future[object]:
        """Take one engine's ready response (decoded, its bytes as received and, when the decode made them, as
        JSON: ``shown``); the future's result is the replica.

        A new ``instance_id`` drops the replica's previous run's engines, and no other replica's.
        The future fails with ``SyncConflict`` or ``LimitExceeded`` (nothing changed) when
        the change is refused, and with ``StorageUnavailable`` when it cannot be committed.
        """
        report = EngineReady(engine, response, payload, wire_format, shown)

        def change(batch: Batch) -> Replica | None:
            outcome = changes.ready(self._rules, batch, key, (report,), heartbeat_seconds)
            if outcome.refused:
                raise outcome.refused[engine]
            return outcome.replica

        return self._writer.submit(change)

    def apply_ready_many(
        self, key: ReplicaKey, reports: Sequence[EngineReady], heartbeat_seconds: float | None = None
    ) -> Future[object]:
        """Take several engines' ready responses of one replica in ONE commit; the result is a ``ReadyOutcome``.

        As if ``apply_ready`` were called for each ``(engine, response, payload, wire_format)`` in order (a new
        ``instance_id`` drops the engines before it; an engine's later response replaces its earlier one), but
        each is checked alone (caps, sync): a refused one is named in ``ReadyOutcome.refused`` and the others go
        on; past the byte budget the array is cut where it crosses it (``exporter/state/ready_arrays.py``). The
        future fails only with ``StorageUnavailable``: then nothing was accepted.
        """
        return self._submit(changes.ready, key, tuple(reports), heartbeat_seconds, weight=len(reports))

    def set_static_labels(
        self, key: ReplicaKey, static_labels: Mapping[str, str], heartbeat_seconds: float | None = None
    ) -> Future[object]:
        """Replace a replica's static labels (its frontend's ``metrics_info()``), creating it if needed."""
        return self._submit(changes.static_labels, key, static_labels, heartbeat_seconds)

    def heartbeat(self, key: ReplicaKey, heartbeat_seconds: float) -> Future[object] | None:
        """The replica is alive and promises the next heartbeat within ``heartbeat_seconds``.

        Refused with ``UnknownReplica`` when the exporter does not hold it (a new or restarted exporter): the
        sender then sends its whole state again. In a single process it is heard at once (``None``) and folded
        into the next batch (``settled``); with a shared store it is committed, and the future tells when.
        """
        if self._rules.store_heartbeats:
            return self._submit(changes.heartbeat, key, heartbeat_seconds)
        if key not in self._writer.replicas:
            raise changes.unknown_replica(key)
        self._liveness.hear(key, heartbeat_seconds)
        return None

    def settled(self) -> Future[object] | None:
        """``None`` when every heartbeat heard is in the state; else a future done once they are (a read waits
        for it, so it shows what was answered)."""
        return self._writer.settle() if self._liveness.pending() else None

    def delete_replica(self, key: ReplicaKey) -> Future[object]:
        """Forget a replica (its sender said goodbye); the future's result says whether there was one."""
        return self._writer.submit(functools.partial(changes.goodbye, key=key))

    def delete_deployment(self, deployment: str) -> Future[object]:
        """Forget every replica of a deployment; the future's result says whether there was one."""
        return self._writer.submit(functools.partial(changes.delete_deployment, deployment=deployment))

    def delete_engine(self, key: ReplicaKey, engine: int) -> Future[object]:
        """Forget one engine; the future's result is the updated replica, or ``None`` if there was no such engine."""
        return self._submit(changes.delete_engine, key, engine)

    def _submit(self, rule: Callable[..., object], *arguments: object, weight: int = 1) -> Future[object]:
        """Submit ``rule(rules, batch, *arguments)``, which takes ``weight`` ready responses."""
        return self._writer.submit(lambda batch: rule(self._rules, batch, *arguments), weight=weight)


T = TypeVar("T")


class PerVersion(Generic[T]):
    """A value derived from the state's snapshot, built at most once per state version.

    ``fresh()`` is a cheap look (for the event loop); ``current()`` builds when the state moved on, under a
    lock, so readers that arrive meanwhile wait for that one build.
    """

    def __init__(self, state: ExporterState, build: Callable[[ReplicaMap], T]) -> None:
        self._state = state
        self._build = build
        self._built: tuple[int, T] | None = None
        self._lock = threading.Lock()

    def fresh(self) -> T | None:
        """The value if it is of the current version, else ``None``."""
        built = self._built
        return built[1] if built is not None and built[0] == self._state.version else None

    def last(self) -> T | None:
        """The value last built, of whichever version; ``None`` before the first build."""
        built = self._built
        return built[1] if built is not None else None

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
