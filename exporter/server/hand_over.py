"""Waiting on the event loop for work of another thread (the writer's catch-up that a read waits for), with the
interpreter's lock handed over to it.

uvloop gives the lock up around each poll and takes it back for each callback: while the loop is busy (a flood of
pipelined requests), it gives it up and takes it back thousands of times a second. A thread that waits for the
lock is woken by each give-up, finds it taken again and begins its wait anew, so its request that the loop drop
the lock (due after ``sys.getswitchinterval()`` of waiting) never comes: the writer's catch-up that a scrape
waited for, 0.2 ms of work, began 50 to 150 ms after it was asked for, or took 70 to 165 ms, during such a flood
(docs/RELIABILITY.md, "Readers that never read"). Here the loop's thread blocks on the awaited future for
at most ``HAND_OVER_SECONDS`` in each turn until it is done: the lock is free for that long, and the thread that
does the work takes it at once. A loop that waits costs every other request at most that much a turn.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

# The longest the loop's thread blocks in one turn, waiting for another thread's future: the interpreter's lock is
# free meanwhile. Longer than a small fleet's catch-up (fold and render ahead, a few hundred microseconds), far
# shorter than what a fresh request may wait.
HAND_OVER_SECONDS = 0.002

T = TypeVar("T")


async def handed_over(future: Future[T]) -> T:
    """``future``'s result (or its exception), the loop's thread blocking on it ``HAND_OVER_SECONDS`` at most a
    turn of the loop, the turns between serving everything else."""
    while True:
        try:
            future.exception(timeout=HAND_OVER_SECONDS)
        except FutureTimeout:
            await asyncio.sleep(0)  # one turn of the loop for everything else, then block again
        else:
            return future.result()
