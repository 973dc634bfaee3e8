"""The writer's queue (exporter/state/write_queue.py): batches bounded by the ready responses they carry, and reads
that wait for the heartbeats heard without waiting behind the changes queued."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from exporter.state.exporter_state import ExporterState
from exporter.state.storage import SqliteStore
from exporter.state.write_queue import MAX_BATCH, Job, WriteQueue
from protocol import decode_ready_response
from tests.support import fixture_bytes

PAYLOAD = fixture_bytes("dp2-rank0")
RESPONSE = decode_ready_response(PAYLOAD)
KEY = ("d", "beating")


def job(weight: int) -> Job:
    return Job(lambda batch: None, Future(), weight=weight)


def weights(jobs: list[Job | None] | None) -> list[int | None] | None:
    return None if jobs is None else [None if job is None else job.weight for job in jobs]


def test_the_changes_of_one_turn_of_an_event_loop_reach_the_writer_together_at_its_end() -> None:
    jobs = WriteQueue()

    async def one_turn() -> tuple[list[int | None] | None, list[int | None] | None]:
        for weight in (1, 2, 3):
            jobs.put(job(weight))
        during = weights(jobs.batch(0))  # the turn is not over: the writer has nothing yet
        await asyncio.sleep(0)  # the next turn
        return during, weights(jobs.batch(0))

    assert asyncio.run(one_turn()) == (None, [1, 2, 3])


def test_a_stop_from_an_event_loop_goes_at_once_behind_the_changes_of_its_turn() -> None:
    """Whoever stops the writer from a loop waits for it to end, so the stop cannot wait for the turn's end; the
    changes the turn put before it still go first, and none is handed over twice."""
    jobs = WriteQueue()

    async def stopped_in_a_turn() -> tuple[list[int | None] | None, list[int | None] | None]:
        for weight in (1, 2):
            jobs.put(job(weight))
        jobs.put(None)
        at_once = weights(jobs.batch(0))
        await asyncio.sleep(0)  # the turn's end hands over nothing more
        return at_once, weights(jobs.batch(0))

    assert asyncio.run(stopped_in_a_turn()) == ([1, 2, None], None)


def test_a_turn_past_max_batch_is_taken_in_several_batches_in_its_order() -> None:
    jobs = WriteQueue()

    async def one_turn() -> None:
        for weight in (MAX_BATCH - 1, 1, 1, 2):
            jobs.put(job(weight))

    asyncio.run(one_turn())
    jobs.put(job(5))  # a thread without a loop: queued at once, after the turn's
    assert weights(jobs.batch(0)) == [MAX_BATCH - 1, 1], "at MAX_BATCH"
    assert weights(jobs.batch(0)) == [1, 2, 5], "one past it begins the next batch"
    assert jobs.batch(0) is None


def test_a_batch_takes_changes_until_they_carry_max_batch_ready_responses() -> None:
    jobs = WriteQueue()
    for weight in (300, 200, 100, MAX_BATCH + 100, 1, 1):
        jobs.put(job(weight))
    jobs.put(None)
    assert weights(jobs.batch(0.01)) == [300, 200]
    assert weights(jobs.batch(0.01)) == [100]
    assert weights(jobs.batch(0.01)) == [MAX_BATCH + 100], "an array larger than a batch is a batch of its own"
    assert weights(jobs.batch(0.01)) == [1, 1, None], "stopping comes last, after every change queued"
    assert jobs.batch(0.01) is None


def test_a_read_that_waits_for_a_fold_wakes_the_writer_and_is_answered_by_the_next_batch() -> None:
    jobs = WriteQueue()
    jobs.put(job(1))
    settled = jobs.settle()
    assert jobs.settling()
    assert weights(jobs.batch(0.01)) == [1], "the wake-up is no change of the batch"
    assert jobs.begin() == [settled] and not jobs.settling()
    assert jobs.batch(0.01) is None


class SteppedStore(SqliteStore):
    """A store whose write transactions, once ``stepping``, each wait for a permit; ``waiting`` counts them."""

    def __init__(self, path: Path) -> None:
        self.stepping = False
        self.permits = threading.Semaphore(0)
        self.waiting = threading.Semaphore(0)
        super().__init__(path)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self.stepping:
            self.waiting.release()
            assert self.permits.acquire(timeout=30)
        with super().transaction():
            yield


def test_a_read_waits_for_the_batch_under_way_not_for_the_changes_queued_behind_it(tmp_path: Path) -> None:
    store = SteppedStore(tmp_path / "state.db")
    state = ExporterState(store, {}, time.time)
    try:
        state.apply_ready(KEY, 0, RESPONSE, PAYLOAD, "msgpack", 30.0).result(timeout=10)
        store.stepping = True
        under_way = state.apply_ready(("d", "under-way"), 0, RESPONSE, PAYLOAD, "msgpack")
        assert store.waiting.acquire(timeout=10), "its transaction began"
        queued = [state.apply_ready(("d", f"queued-{n}"), 0, RESPONSE, PAYLOAD, "msgpack") for n in range(3)]
        assert state.heartbeat(KEY, 45.0) is None
        settled = state.settled()
        assert settled is not None
        store.permits.release()  # the batch under way commits; the queued changes still wait for theirs
        settled.result(timeout=5)
        assert under_way.done() and not any(future.done() for future in queued)
        assert state.snapshot()[KEY].heartbeat_seconds == 45.0, "the read shows the heartbeat answered before it"
    finally:
        store.permits.release(10)
        state.close()
        store.close()
