"""The writer's queue: changes taken in their order, in batches bounded by the ready responses they carry, and
reads waiting for the heartbeats heard, which no queued change holds up.

A batch is one transaction: group commit makes eight clients cost about one fsync. But a change's time grows with
the ready responses it takes (an array carries up to 1,024), and everything that arrives meanwhile waits for the
whole batch. So a batch takes changes until they carry ``MAX_BATCH`` responses (a larger array is a batch of its
own). A read waits for the heartbeats answered before it to be folded in, which any batch begun after it does
(``settle``): the writer begins one of no change for it before taking the next queued changes, so a read waits
for at most the batch under way, never for the changes queued behind it.

Changes submitted from an event loop reach the queue once per turn of that loop (``put`` from a loop's thread):
the requests parsed in one turn wake the writer once, as one batch, rather than each in turn, which would hand
the interpreter's lock to the writer thread between them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

# Ready responses one batch takes at most (the first change whatever it carries): bounds the latency a commit adds.
MAX_BATCH = 512


class Job(NamedTuple):
    """A queued change (run on the writer's ``Batch``) and its future; ``writes=False``: it only reads or touches
    (a batch of such alone takes no write lock); ``weight``: the ready responses it takes."""

    change: Callable[[Any], object]
    future: Future[object]
    writes: bool = True
    weight: int = 1


def _wake(batch: object) -> None:
    """What a writer waiting for changes is woken with to begin a batch for the reads that wait (no change)."""


_WAKE = Job(_wake, Future(), writes=False, weight=0)


class WriteQueue:
    """Jobs in their order, taken in batches by ``batch``; ``None`` put in it asks the writer to stop."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[list[Job | None]] = queue.SimpleQueue()
        # Jobs taken from the queue for the next batches: the next would have taken this one past ``MAX_BATCH``.
        self._held: list[Job | None] = []
        self._settling: list[Future[object]] = []
        self._lock = threading.Lock()
        # The jobs put by each event loop during its current turn, handed over together at the turn's end.
        self._turns: dict[asyncio.AbstractEventLoop, list[Job | None]] = {}

    def put(self, job: Job | None) -> None:
        """Queue ``job``: at once from a thread without an event loop, at the end of the loop's turn from one.

        ``None`` (stop) goes at once, behind what this loop's turn put: whoever stops the writer waits for it, and
        the turn's end would never come while it waits."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._jobs.put([job])
            return
        if job is None:
            self._jobs.put([*self._turns.pop(loop, []), None])
            return
        turn = self._turns.get(loop)
        if turn is None:
            turn = self._turns[loop] = []
            loop.call_soon(self._hand_over, loop)
        turn.append(job)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        turn = self._turns.pop(loop, None)
        if turn is not None:  # None: a stop took it along
            self._jobs.put(turn)

    def settle(self) -> Future[object]:
        """A future done once a batch begun after this call is committed (or failed with its error)."""
        future: Future[object] = Future()
        with self._lock:
            self._settling.append(future)
        self._jobs.put([_WAKE])
        return future

    def settling(self) -> bool:
        """Whether reads wait for a batch to begin."""
        return bool(self._settling)

    def begin(self) -> list[Future[object]]:
        """A batch begins: the futures of the reads waiting for it, theirs to answer."""
        with self._lock:
            settling, self._settling = self._settling, []
        return settling

    def batch(self, timeout: float) -> list[Job | None] | None:
        """The next batch's jobs in order, up to ``MAX_BATCH`` ready responses, and ``None`` last when the writer
        is to stop; ``None`` when nothing came within ``timeout`` seconds."""
        if not self._held:
            try:
                self._held = self._jobs.get(timeout=timeout)
            except queue.Empty:
                return None
        jobs: list[Job | None] = []
        weight = 0
        while True:
            for place, job in enumerate(self._held):
                if job is None:
                    self._held = []
                    return [*jobs, None]
                if job is _WAKE:
                    continue
                if jobs and weight + job.weight > MAX_BATCH:
                    self._held = self._held[place:]
                    return jobs
                jobs.append(job)
                weight += job.weight
            try:
                self._held = self._jobs.get_nowait()
            except queue.Empty:
                self._held = []
                return jobs
