"""Turns of the event loop shared among connections with more to parse (``FeedTurns``), on a hand-driven queue
of turns, and the exporter's protocol sharing them, in process: the shares of at most ``SHARES_PER_TURN``
connections a turn, in the order they queued, however many connections pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.server.feed_turns import FeedTurns
from exporter.server.uvicorn_adapter import FEED_BYTES, SHARES_PER_TURN
from tests.server.test_slow_readers import HEARTBEAT, InProcess


class Turns:
    """A loop's next turn, run by hand: what ``call_soon`` scheduled runs when the test says."""

    def __init__(self) -> None:
        self.scheduled: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.scheduled.append(callback)

    def run(self) -> None:
        due, self.scheduled = self.scheduled, []
        for callback in due:
            callback()


def connection(name: str, shares: int, turns: FeedTurns, loop: Turns, fed: list[str]) -> Callable[[], None]:
    """A connection with ``shares`` shares to parse: each feed records its name and queues it again while more
    are left."""
    left = [shares]

    def feed() -> None:
        fed.append(name)
        left[0] -= 1
        if left[0]:
            turns.wait(feed, loop.call_soon)

    return feed


def test_a_turn_serves_exactly_its_shares_oldest_first_and_those_left_queue_behind() -> None:
    loop, turns, fed = Turns(), FeedTurns(2), []
    for name in "abc":
        turns.wait(connection(name, 2, turns, loop, fed), loop.call_soon)
    assert fed == [] and len(loop.scheduled) == 1  # nothing in the turn it was queued in; one turn scheduled
    loop.run()
    assert fed == ["a", "b"]  # two shares: the third waits
    loop.run()
    assert fed == ["a", "b", "c", "a"]  # c first, then a, queued again behind it
    loop.run()
    assert fed == ["a", "b", "c", "a", "b", "c"]
    assert loop.scheduled == []  # nothing left: no turn scheduled


def test_a_failing_share_leaves_the_others_their_turns() -> None:
    loop, turns, fed = Turns(), FeedTurns(1), []

    def failing() -> None:
        raise RuntimeError("a bug")

    turns.wait(failing, loop.call_soon)
    turns.wait(connection("b", 1, turns, loop, fed), loop.call_soon)
    with pytest.raises(RuntimeError):
        loop.run()
    loop.run()
    assert fed == ["b"]


async def shares_parsed(tmp_path: Path, connections: int) -> list[int]:
    """``connections`` connections each read a run of pipelined heartbeats at once, then one turn of the loop: the
    bytes each has parsed."""
    exporter = InProcess(tmp_path)
    read = HEARTBEAT * (4 * FEED_BYTES // len(HEARTBEAT))
    opened = [exporter.connect(high=1 << 30) for _ in range(connections)]
    for protocol, _ in opened:
        protocol.data_received(read)
    await asyncio.sleep(0)  # one turn
    parsed = [len(read) - len(protocol._connection.held or b"") for protocol, _ in opened]
    for protocol, _ in opened:
        protocol.connection_lost(None)
    exporter.state.close()
    return parsed


def test_one_turn_parses_the_shares_of_exactly_shares_per_turn_connections_in_the_order_they_read(
    tmp_path: Path,
) -> None:
    """Each read parses one share at once; the turn after, the first ``SHARES_PER_TURN`` parse one more and the
    connection one past them waits for the next turn."""
    parsed = asyncio.run(shares_parsed(tmp_path, SHARES_PER_TURN + 1))
    assert parsed == [2 * FEED_BYTES] * SHARES_PER_TURN + [FEED_BYTES]
