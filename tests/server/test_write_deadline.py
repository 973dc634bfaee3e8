"""The exporter's protocol in process, over transports whose peer reads nothing, on an event loop with a fake clock:
the write deadline, the connection cap making room, and the bound on pipelined requests, each at its bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from exporter.server.uvicorn_adapter import PIPELINED_AT_MOST, write_stalled
from tests.server.test_slow_readers import HEALTHY, STATUS_LINE, BackedUpTransport, InProcess

WRITE_TIMEOUT = 10.0
HEADER_TIMEOUT = 5.0
# The start of a head, never finished.
PARTIAL_HEAD = b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


class FakeClock:
    """The event loop's time, moved by the test alone."""

    def __init__(self) -> None:
        self.now = 1000.0


def on_fake_clock(test: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    """Run ``test`` on a new event loop whose clock is a ``FakeClock``: its timers run once the test moves it."""
    loop = asyncio.new_event_loop()
    clock = FakeClock()
    loop.time = lambda: clock.now  # type: ignore[method-assign]
    try:
        loop.run_until_complete(test(clock))
    finally:
        loop.close()


async def until(condition: Callable[[], bool], turns: int = 1000) -> bool:
    """Whether ``condition`` holds within ``turns`` turns of the loop (polled: no clock involved)."""
    for _ in range(turns):
        if condition():
            return True
        await asyncio.sleep(0)
    return condition()


async def turns(count: int = 50) -> None:
    """Let the loop run what is due now (timers whose time the fake clock reached, the app's tasks)."""
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_stalled_answer_is_aborted_at_the_write_deadline_and_not_before(tmp_path: Path) -> None:
    async def test(clock: FakeClock) -> None:
        exporter = InProcess(tmp_path, write_timeout=WRITE_TIMEOUT)
        protocol, transport = exporter.connect(high=0)  # every answer waits for a peer that reads nothing
        protocol.data_received(HEALTHY)
        assert await until(lambda: transport.paused)
        clock.now += WRITE_TIMEOUT - 0.001
        await turns()
        assert not transport.closed
        clock.now += 0.001
        await turns()
        assert transport.aborted
        protocol.connection_lost(None)
        exporter.state.close()

    on_fake_clock(test)


def test_a_reader_that_takes_some_within_each_deadline_is_kept(tmp_path: Path) -> None:
    """It reads a byte within each deadline, its buffer never dropping below the mark: kept; then it stops, and
    the next deadline aborts it."""

    async def test(clock: FakeClock) -> None:
        exporter = InProcess(tmp_path, write_timeout=WRITE_TIMEOUT)
        protocol, transport = exporter.connect(high=0)
        protocol.data_received(HEALTHY)
        assert await until(lambda: transport.paused)
        for _ in range(3):
            transport.drain(left=transport.pending - 1)
            clock.now += WRITE_TIMEOUT
            await turns()
            assert not transport.closed
        clock.now += WRITE_TIMEOUT
        await turns()
        assert transport.aborted
        protocol.connection_lost(None)
        exporter.state.close()

    on_fake_clock(test)


def test_a_reader_stalls_when_it_took_nothing() -> None:
    assert write_stalled(buffered_before=5000, buffered_now=5000)
    assert not write_stalled(buffered_before=5000, buffered_now=4999)


def test_at_the_cap_the_connection_stalled_on_writing_longest_makes_room(tmp_path: Path) -> None:
    async def test(clock: FakeClock) -> None:
        exporter = InProcess(tmp_path, write_timeout=WRITE_TIMEOUT, max_connections=4)
        stalled: list[BackedUpTransport] = []
        for _ in range(2):
            protocol, transport = exporter.connect(high=0)
            protocol.data_received(HEALTHY)
            assert await until(lambda: transport.paused)  # noqa: B023  # polled before the next is made
            stalled.append(transport)
            clock.now += 1
        # Four connections fill the cap of four: nothing closed; the fifth is past it, the older stalled writer goes.
        _, third = exporter.connect(high=1 << 20)
        _, fourth = exporter.connect(high=1 << 20)
        assert not any(transport.closed for transport in [*stalled, third, fourth])
        _, fifth = exporter.connect(high=1 << 20)
        assert stalled[0].aborted and not stalled[1].closed
        assert not third.closed and not fourth.closed and not fifth.closed
        exporter.state.close()

    on_fake_clock(test)


def test_at_the_cap_the_head_incomplete_longest_makes_room_but_not_one_of_this_turn(tmp_path: Path) -> None:
    async def test(clock: FakeClock) -> None:
        exporter = InProcess(tmp_path, header_timeout=HEADER_TIMEOUT, max_connections=3)
        protocol, slow = exporter.connect(high=1 << 20)
        protocol.data_received(PARTIAL_HEAD)
        clock.now += 1
        _, fresh = exporter.connect(high=1 << 20)  # accepted this turn: it has sent nothing yet
        _, filling = exporter.connect(high=1 << 20)  # three open: the cap is full, nothing closed
        assert not any(transport.closed for transport in (slow, fresh, filling))
        _, at_the_cap = exporter.connect(high=1 << 20)
        assert slow.closed and bytes(slow.written).startswith(STATUS_LINE + b"503 ")
        assert not fresh.closed and not filling.closed and not at_the_cap.closed
        _, one_more = exporter.connect(high=1 << 20)  # nothing left to close: the heads open are of this turn
        assert one_more.closed and bytes(one_more.written).startswith(STATUS_LINE + b"503 ")
        assert not fresh.closed and not filling.closed and not at_the_cap.closed
        exporter.state.close()

    on_fake_clock(test)


async def pipelined(tmp_path: Path, requests: int) -> tuple[int, bool, int]:
    """``requests`` sent one read each to a connection whose peer reads nothing: the requests queued behind the one
    answered, whether a read is held unparsed, and the answers once the peer reads everything."""
    exporter = InProcess(tmp_path)
    protocol, transport = exporter.connect(high=0)
    for _ in range(requests):
        protocol.data_received(HEALTHY)
        await until(lambda: transport.paused)
    queued, held = len(protocol.pipeline), protocol._connection.held is not None
    for _ in range(100 * requests):  # the peer reads everything, each turn, until every request is answered
        if bytes(transport.written).count(STATUS_LINE) >= requests:
            break
        transport.drain()
        await asyncio.sleep(0)
    answers = bytes(transport.written).count(STATUS_LINE)
    protocol.connection_lost(None)
    exporter.state.close()
    return queued, held, answers


def test_pipelined_requests_up_to_the_bound_are_parsed_and_one_more_is_held_until_they_drain(tmp_path: Path) -> None:
    """One answered, ``PIPELINED_AT_MOST`` queued behind it: all parsed. One more: held unparsed, and answered
    once the queue drains."""
    assert asyncio.run(pipelined(tmp_path, 1 + PIPELINED_AT_MOST)) == (PIPELINED_AT_MOST, False, 1 + PIPELINED_AT_MOST)
    assert asyncio.run(pipelined(tmp_path, 2 + PIPELINED_AT_MOST)) == (PIPELINED_AT_MOST, True, 2 + PIPELINED_AT_MOST)
