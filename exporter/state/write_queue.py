"""The writer's queue: changes taken in their order, in batches bounded by the ready responses they carry, and
reads waiting for the heartbeats heard, which no queued change holds up.

A batch is one transaction: group commit makes eight clients cost about one fsync. But a change's time grows with
the ready responses it takes (an array carries up to 1,024), and everything that arrives meanwhile waits for the
whole batch. So a batch takes changes until they carry ``MAX_BATCH`` responses (a larger array is a batch of its
own). A read waits for the heartbeats answered before it to be folded in, which any batch begun after it does
(``settle``): the writer begins one of no change for it before taking the next queued changes, so a read waits
for at most the batch under way, never for the changes queued behind it.
"""

from __future__ import annotations

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
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # A job taken from the queue for the next batch: it would have taken this one past ``MAX_BATCH``.
        self._held: Job | None = None
        self._settling: list[Future[object]] = []
        self._lock = threading.Lock()

    def put(self, job: Job | None) -> None:
        self._jobs.put(job)

    def settle(self) -> Future[object]:
        """A future done once a batch begun after this call is committed (or failed with its error)."""
        future: Future[object] = Future()
        with self._lock:
            self._settling.append(future)
        self._jobs.put(_WAKE)
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
        job, self._held = self._held, None
        if job is None:
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                return None
        jobs: list[Job | None] = []
        weight = 0
        while True:
            if job is None:
                return [*jobs, None]
            if job is not _WAKE:
                if jobs and weight + job.weight > MAX_BATCH:
                    self._held = job
                    return jobs
                jobs.append(job)
                weight += job.weight
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return jobs
