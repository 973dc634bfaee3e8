"""Cardinality limits: how many deployments, replicas, engines and bytes the exporter holds at most.

A change past a limit is refused (429, ``LimitExceeded``) and every existing
series stays as it was. A change that shrinks a replica always passes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from exporter.errors import LimitExceeded
from exporter.replicas import Replica, ReplicaKey


class Staged(Protocol):
    """What the limits look at: the committed replicas and the changes staged on them (the writer's batch)."""

    current: Mapping[ReplicaKey, Replica]
    # What the staged replicas take, once a ``ByteBudget`` has summed them.
    used_bytes: int | None

    def get(self, key: ReplicaKey) -> Replica | None: ...
    def replicas(self) -> set[ReplicaKey]: ...


@dataclass(frozen=True)
class Limits:
    """The caps of ``--limits.*``."""

    deployments: int = 10_000
    replicas_per_deployment: int = 1_024
    engines_per_replica: int = 1_024
    # Bytes of exposition and JSON state all replicas may take, as a ``ByteBudget`` measures them.
    bytes: int | None = None

    def check_new_replica(self, batch: Staged, key: ReplicaKey) -> None:
        """Refuse a new replica once its deployment, or the deployments, are at their caps."""
        keys = batch.replicas()
        siblings = sum(1 for other in keys if other[0] == key[0])
        if siblings == 0 and len({other[0] for other in keys}) >= self.deployments:
            raise LimitExceeded("deployment", f"the exporter holds its limit of {self.deployments} deployments")
        if siblings >= self.replicas_per_deployment:
            raise LimitExceeded(
                "replica", f"deployment {key[0]!r} holds its limit of {self.replicas_per_deployment} replicas"
            )

    def check_new_engine(self, key: ReplicaKey, engines: int) -> None:
        """Refuse one more engine for a replica that holds ``engines``."""
        if engines >= self.engines_per_replica:
            raise LimitExceeded(
                "engine", f"replica {key[1]!r} of {key[0]!r} holds its limit of {self.engines_per_replica} engines"
            )


class ByteBudget:
    """``--limits.bytes``: what all replicas take, as ``measure`` counts one (its exposition and JSON state).

    Each replica is measured once per change (replicas are immutable: the size is kept with the replica).
    Used by the writer thread only.
    """

    def __init__(self, budget: int, measure: Callable[[Replica], int]) -> None:
        self._budget = budget
        self._measure = measure
        self._sizes: dict[ReplicaKey, tuple[Replica, int]] = {}

    def _size(self, key: ReplicaKey, replica: Replica) -> int:
        known = self._sizes.get(key)
        if known is None or known[0] is not replica:
            known = self._sizes[key] = (replica, self._measure(replica))
        return known[1]

    def check(self, batch: Staged, key: ReplicaKey, updated: Replica) -> None:
        """Refuse a change that would take the replicas past the budget (a change that shrinks one passes)."""
        if batch.used_bytes is None:
            if len(self._sizes) > 2 * len(batch.current) + 64:  # forget removed replicas, now and then
                self._sizes = {known: size for known, size in self._sizes.items() if known in batch.current}
            batch.used_bytes = sum(self._size(other, replica) for other, replica in batch.current.items())
        current = batch.get(key)
        before = self._size(key, current) if current is not None else 0
        size = self._size(key, updated)
        used = batch.used_bytes - before + size
        if size > before and used > self._budget:
            raise LimitExceeded(
                "bytes",
                f"replica {key[1]!r} of {key[0]!r} would take the exposition and JSON state to {used} bytes, past "
                f"the budget of {self._budget} bytes (--limits.bytes)",
            )
        batch.used_bytes = used
