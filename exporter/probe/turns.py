"""The probes' work on the event loop, in slices: however much a target makes them parse, the loop turns.

A probe's parsing (h11 reading a response, the check of its body) is a generator that yields after each small
step. It runs in slices of at most ``SLICE_SECONDS``, one probe's slice at a time, each followed by a rest as
long as it took: the loop serves its sockets meanwhile and, idle in its poll, lets the threads that render
``/metrics`` have the interpreter (a thread waits up to 5 ms for it from a loop that never pauses). So probe
work takes at most about half of the loop's time, however many probes parse. Turns go first to probes that
have worked less than ``LIGHT_SECONDS`` (a healthy vLLM server's whole body is a few milliseconds), then to
the others, each in the order they asked: a target that makes its probe parse for seconds does not slow the
probes of healthy ones. Work stops where it stands when its probe is cancelled (its deadline): nothing of it
runs on, as it would in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Generator
from typing import TypeVar

# The most a slice keeps the event loop; a step of work takes well under it (16 KiB of lines, one h11 event).
SLICE_SECONDS = 0.002
# A slice shorter than this (a few h11 events of a healthy response) needs no rest.
REST_AFTER_SECONDS = 0.0005
# A probe that has worked less than this gets its turns before those that have worked more.
LIGHT_SECONDS = 0.010
T = TypeVar("T")


class Turns:
    """Who works next: the slices of all probes, one at a time."""

    def __init__(self, slice_seconds: float = SLICE_SECONDS) -> None:
        self.slice_seconds = slice_seconds
        self._busy = False
        self._light: deque[asyncio.Future[None]] = deque()
        self._heavy: deque[asyncio.Future[None]] = deque()

    def of_probe(self) -> ProbeTurns:
        return ProbeTurns(self)

    async def take(self, worked: float) -> None:
        """Wait for the turn (at once when nobody works), behind those that worked less than ``LIGHT_SECONDS``
        if ``worked`` is more."""
        if not self._busy:
            self._busy = True
            return
        turn = asyncio.get_running_loop().create_future()
        (self._light if worked < LIGHT_SECONDS else self._heavy).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed over as the waiter was cancelled: hand it on
                self.hand_on()
            raise

    def hand_on(self) -> None:
        """Give the turn to the first waiting, light ones first; nobody waiting, nobody works."""
        for waiting in (self._light, self._heavy):
            while waiting:
                turn = waiting.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self._busy = False


class ProbeTurns:
    """One probe's work in ``Turns``' slices, and how long it has worked."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self.worked = 0.0

    async def run(self, work: Generator[None, None, T]) -> T:
        """``work``'s result, computed in slices that take turns with other probes' and leave the loop time."""
        try:
            while True:
                await self.turns.take(self.worked)
                started = time.perf_counter()
                try:
                    while time.perf_counter() - started < self.turns.slice_seconds:
                        next(work)
                finally:
                    took = time.perf_counter() - started
                    self.worked += took
                    try:
                        if took > REST_AFTER_SECONDS:
                            await asyncio.sleep(took)
                    finally:
                        self.turns.hand_on()
        except StopIteration as done:
            return done.value
        finally:
            work.close()
