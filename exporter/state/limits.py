"""Cardinality limits: how many deployments, replicas, engines and bytes the exporter holds at most.

A change past a limit is refused (429, ``LimitExceeded``) and every existing
series stays as it was. A change that shrinks a replica always passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from exporter.errors import LimitExceeded
from exporter.state.replicas import Replica, ReplicaKey


class Staged(Protocol):
    """What the limits look at: the committed replicas with the changes staged on them (the writer's ``Batch``),
    counted as running totals, so that checking a change never counts the fleet."""

    # What the replicas take with the staged changes, as the ``ByteBudget`` measured them.
    used_bytes: int

    def get(self, key: ReplicaKey) -> Replica | None: ...
    def replicas_in(self, deployment: str) -> int: ...
    def deployments(self) -> int: ...
    def size(self, key: ReplicaKey) -> int: ...


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
        siblings = batch.replicas_in(key[0])
        if siblings == 0 and batch.deployments() >= self.deployments:
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

    A changed replica is measured once; the batch keeps the total as a running sum (see ``Staged``).
    """

    def __init__(self, budget: int, measure: Callable[[Replica], int]) -> None:
        self._budget = budget
        self.measure = measure

    def check(self, batch: Staged, key: ReplicaKey, updated: Replica) -> int:
        """What ``updated`` takes; refuse it when it would take the replicas past the budget (a change that
        does not grow the replica passes, even over a lowered budget)."""
        size = self.measure(updated)
        if size > self.room(batch, key):
            raise self.past(batch, key, size)
        return size

    def room(self, batch: Staged, key: ReplicaKey) -> int:
        """The most the replica may take: what the others leave of the budget, or at least what it takes now."""
        before = batch.size(key)
        return max(before, self._budget - batch.used_bytes + before)

    def past(self, batch: Staged, key: ReplicaKey, size: int) -> LimitExceeded:
        """The refusal of the replica taking ``size`` bytes, past its ``room``."""
        used = batch.used_bytes - batch.size(key) + size
        return LimitExceeded(
            "bytes",
            f"replica {key[1]!r} of {key[0]!r} would take the exposition and JSON state to {used} bytes, past "
            f"the budget of {self._budget} bytes (--limits.bytes; {batch.used_bytes} bytes in use now): raise "
            "--limits.bytes to hold more",
        )

    def full(self, batch: Staged, key: ReplicaKey) -> LimitExceeded:
        """The refusal of a response after the one that took the replica to the budget, in one array."""
        return LimitExceeded(
            "bytes",
            f"replica {key[1]!r} of {key[0]!r} is at the budget of {self._budget} bytes (--limits.bytes; "
            f"{batch.used_bytes} bytes in use now) with the responses before this one in its array, and one of "
            "them was refused for it: raise --limits.bytes to hold more",
        )
