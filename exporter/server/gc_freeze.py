"""Full garbage collections kept short on a fleet's heap: the survivors of each are frozen until the heap grows.

Each kept connection holds dozens of objects that the cycle collector tracks (uvicorn's, uvloop's and the
heartbeat protocol's), so a fleet's kept connections hold hundreds of thousands. CPython examines every tracked
object in a full (generation-2) collection, and it runs one each time the objects promoted to the oldest generation
since the last one reach a quarter of it: at a fleet's size one holds the event loop long enough to delay the
scrapes and heartbeats arriving meanwhile. The objects examined live as long as their connection and are freed by
reference counting when it closes, so the collector finds next to no garbage among them (the figures:
docs/PERFORMANCE.md, "Known limits", garbage collection tails).

So after each full collection its survivors are frozen (``gc.freeze``: out of the collector's reach, still freed by
reference counting), and the next one examines only the objects that came after them. What freezing can keep is
garbage in cycles among frozen objects, which only a complete collection frees. Frozen objects die where
connections close, and a closing connection drops its protocol's cycles (``exporter/server/uvicorn_adapter.py``): then
reference counting frees it. Still, all are thawed, and the next full collection examines everything:

- as soon as as many connections closed as were open at the last complete collection: a turnover of the
  connections (the flood of a few that left, a fleet's restarts) costs one complete collection, of the heap as it
  is then;
- once the frozen objects are half as many again as the last complete collection found alive: a growing heap.
  Counting them walks them all (its cost: the same section), so they are counted only once the survivors
  frozen since the last count could have made them twice as many.

A fleet that keeps its connections and does not grow never pays for a complete collection.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class FreezePacing:
    """When to thaw: once as many connections closed as were open at the last complete collection, or the frozen
    objects are half as many again as it found alive.

    ``alive`` is ``None`` when nothing is frozen: the next full collection examines every tracked object.
    ``frozen`` is at least the frozen objects: those counted last, plus every survivor frozen since (some of
    which reference counting may have freed). ``opened`` and ``closed`` count connections.
    """

    alive: int | None = None
    frozen: int = 0
    opened: int = 0
    closed: int = 0
    # Connections open at the last complete collection, and closed before it.
    open_then: int = 0
    closed_then: int = 0

    def connection_opened(self) -> None:
        self.opened += 1

    def connection_closed(self) -> bool:
        """Count a closed connection; whether it completes a turnover of those open at the last complete collection
        (the frozen objects are to be thawed at once: the next full collection examines everything)."""
        self.closed += 1
        if self.alive is None or self.closed - self.closed_then < max(self.open_then, 1):
            return False
        self.alive = None
        return True

    def thaw_after(self, survivors: int, count_frozen: Callable[[], int]) -> bool:
        """Whether a full collection's ``survivors`` are thawed with the frozen objects, rather than frozen too.

        ``count_frozen`` counts the frozen objects, by walking them: called only when it may say to thaw.
        """
        if self.alive is None:
            self.alive = self.frozen = survivors
            self.open_then, self.closed_then = self.opened - self.closed, self.closed
            return False
        self.frozen += survivors
        if self.frozen < 2 * self.alive:
            return False
        self.frozen = count_frozen() + survivors
        if 2 * self.frozen < 3 * self.alive:
            return False
        self.alive = None
        return True


# The serving process's pacing while it freezes: its protocol tells it of each connection.
_pacing: FreezePacing | None = None


def connection_opened() -> None:
    if _pacing is not None:
        _pacing.connection_opened()


def connection_closed() -> None:
    if _pacing is not None and _pacing.connection_closed():
        gc.unfreeze()


def freeze_survivors(pacing: FreezePacing | None = None) -> Callable[[], None]:
    """From now on, freeze the survivors of every full collection, thawing as ``pacing`` says; returns the undo.

    For a serving process: the collector is the process's own.
    """
    global _pacing
    pacing = _pacing = FreezePacing() if pacing is None else pacing

    def after_collection(phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info["generation"] != 2:
            return
        # The survivors are the oldest generation now: counting them walks them, not the frozen objects.
        if pacing.thaw_after(len(gc.get_objects(2)), gc.get_freeze_count):
            gc.unfreeze()
        else:
            gc.freeze()

    gc.callbacks.append(after_collection)

    def undo() -> None:
        global _pacing
        gc.callbacks.remove(after_collection)
        gc.unfreeze()
        _pacing = None

    return undo
