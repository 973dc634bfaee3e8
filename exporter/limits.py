"""Cardinality limits: how many deployments, replicas, engines and bytes the exporter holds at most.

A change past a limit is refused (429) and every existing series stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The caps of ``--limits.*``."""

    deployments: int = 10_000
    replicas_per_deployment: int = 1_024
    engines_per_replica: int = 1_024
    # Bytes of exposition and JSON state all replicas may take, as the state's ``measure`` counts them.
    bytes: int | None = None
