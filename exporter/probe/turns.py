"""The probes' work on the event loop, in slices: however much a target makes them parse, the loop turns.

A probe's parsing (h11 reading a response, the scan of its body) is a generator that yields after each small
step. ``Turns.run`` runs such work for at most ``SLICE_SECONDS``, then rests as long as the slice took before
the next one: the loop serves its sockets meanwhile, and, idle in its poll, lets the threads that render
``/metrics`` have the interpreter (a thread waits up to 5 ms for it from a loop that never pauses). One lock
makes every probe's slices take turns, first come first served, so at most one probe works at a time and
probe work never takes more than about half of the loop's time, however many probes parse. Work stops where
it stands when its probe is cancelled (its deadline): nothing of it runs on, as it would in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from typing import TypeVar

# The most a slice keeps the event loop; a step of work takes well under it (16 KiB of lines, one h11 event).
SLICE_SECONDS = 0.002
# A slice shorter than this (a few h11 events of a healthy response) needs no rest.
REST_AFTER_SECONDS = 0.0005
T = TypeVar("T")


class Turns:
    """Slices of the probes' work, one at a time, each at most ``slice_seconds`` long and followed by a rest."""

    def __init__(self, slice_seconds: float = SLICE_SECONDS) -> None:
        self.slice_seconds = slice_seconds
        self._lock = asyncio.Lock()

    async def run(self, work: Generator[None, None, T]) -> T:
        """``work``'s result, computed in slices that take turns with other probes' and leave the loop time."""
        try:
            while True:
                async with self._lock:
                    started = time.perf_counter()
                    try:
                        while time.perf_counter() - started < self.slice_seconds:
                            next(work)
                    finally:
                        took = time.perf_counter() - started
                        if took > REST_AFTER_SECONDS:
                            await asyncio.sleep(took)
                await asyncio.sleep(0)  # others waiting for a turn get theirs
        except StopIteration as done:
            return done.value
        finally:
            work.close()
