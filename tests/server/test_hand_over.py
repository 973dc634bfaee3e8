"""Awaiting another thread's future with the interpreter's lock handed over (``exporter/server/hand_over.py``):
the result or the exception comes back as it was set, and the loop keeps turning between the waits, so a future
that only the loop itself completes is still awaited, not deadlocked on."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from exporter.server.hand_over import handed_over


def test_a_result_set_by_another_thread_comes_back() -> None:
    future: Future[str] = Future()
    threading.Thread(target=future.set_result, args=("caught up",)).start()
    assert asyncio.run(handed_over(future)) == "caught up"


def test_an_exception_set_by_another_thread_is_raised() -> None:
    future: Future[str] = Future()
    threading.Thread(target=future.set_exception, args=(OSError("database is locked"),)).start()
    with pytest.raises(OSError, match="database is locked"):
        asyncio.run(handed_over(future))


def test_the_loop_serves_its_other_callbacks_between_the_waits() -> None:
    """The future is completed by a callback of the loop that awaits it, after several turns of it."""

    async def main() -> str:
        future: Future[str] = Future()
        loop = asyncio.get_running_loop()
        turns = [0]

        def turn() -> None:
            turns[0] += 1
            if turns[0] == 5:
                future.set_result("after five turns")
            else:
                loop.call_soon(turn)

        loop.call_soon(turn)
        return await handed_over(future)

    assert asyncio.run(main()) == "after five turns"
