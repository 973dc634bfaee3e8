"""The sync inputs of the engines of the replicas changed lately, kept by the writer so that a change of one engine
syncs its replica without decoding the others' responses again.

A replica keeps only its engines' responses as bytes (``EngineReport``): decoded, they would take about one and a
half times their memory again for every engine of the fleet. A sync reads a few fields of each response
(``protocol.EngineInput``), so a ready response of one engine of a DP=8 replica would decode and read seven
unchanged responses besides its own. ``EngineInputs`` keeps each engine's input beside the report it was read
from, for the replicas changed lately (``INPUTS_KEPT`` engines at most, those changed longest ago dropped first):
an input is good while the replica holds the very same report (reports are immutable and replaced, never changed).
Used by the writer thread alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.state.replicas import EngineReport, ReplicaKey
from protocol import EngineInput, engine_input

# Engines whose inputs are kept: those of the replicas changed lately (a bound, so that a fleet's replicas leave
# little behind; a storm's replicas each change once anyway).
INPUTS_KEPT = 8192


class EngineInputs:
    """Each kept engine's input and the report it was read from, by replica (the most lately used last)."""

    def __init__(self, kept: int = INPUTS_KEPT) -> None:
        self._kept = kept
        self._replicas: dict[ReplicaKey, dict[int, tuple[EngineReport, EngineInput]]] = {}
        self._engines = 0

    def of(self, key: ReplicaKey, engines: Mapping[int, EngineReport]) -> dict[int, EngineInput]:
        """The inputs of the replica's ``engines``: kept ones where their report is the same, others read from
        the report's bytes."""
        known = self._replicas.get(key, {})
        inputs = {}
        for index, report in engines.items():
            held = known.get(index)
            inputs[index] = held[1] if held is not None and held[0] is report else engine_input(report.response())
        return inputs

    def keep(self, key: ReplicaKey, engines: Mapping[int, EngineReport], inputs: Mapping[int, EngineInput]) -> None:
        """Keep the inputs of the replica's ``engines`` (as built), dropping those kept before for it."""
        self._engines -= len(self._replicas.pop(key, {}))
        self._replicas[key] = {index: (report, inputs[index]) for index, report in engines.items()}
        self._engines += len(engines)
        while self._engines > self._kept:  # the replicas changed longest ago go first, this one last
            self._engines -= len(self._replicas.pop(next(iter(self._replicas))))
