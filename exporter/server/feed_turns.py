"""Turns of an event loop shared among the connections that have read more than they may parse at once.

A connection pipelining cheap requests (heartbeats, answered as they are parsed) has more to parse than one turn
of the loop should take: a read of uvloop's is up to 256 KiB, some 2,500 heartbeats. If each such connection
parsed a share of its own in every turn, a turn would grow with the number of them (16 connections at 4 KiB:
some 700 heartbeats, tens of milliseconds), and a fresh request, which needs a few turns (its accept, its read,
the app's task, a reply from the writer thread), would wait for each. Here they queue instead: a turn parses
at most ``shares_per_turn`` shares, one per connection, in the order they queued, and the connections whose
bytes outlast their share queue again behind the others. So a turn costs at most a fixed amount whatever the
number of busy connections, and each of them is served in turn: n of them share the loop's time evenly.

Knows no uvicorn and no clock: a connection is a callable that parses its next share.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# Schedules a callable for the loop's next turn (``loop.call_soon``).
CallSoon = Callable[[Callable[[], None]], object]


class FeedTurns:
    """Connections waiting to parse their next share, served in the order they queued, ``shares_per_turn`` per
    turn of one event loop. ``wait`` is given the loop's ``call_soon``, kept only while connections wait: idle, it
    refers to no loop (a loop may key it weakly)."""

    def __init__(self, shares_per_turn: int) -> None:
        self._shares_per_turn = shares_per_turn
        self._waiting: deque[Callable[[], None]] = deque()
        self._call_soon: CallSoon | None = None

    def wait(self, feed: Callable[[], None], call_soon: CallSoon) -> None:
        """Queue ``feed``, which parses one share of a connection's bytes (and queues it again with ``wait`` when
        more are left); it runs in a later turn, never in this one."""
        self._waiting.append(feed)
        if self._call_soon is None:  # no turn is scheduled
            self._call_soon = call_soon
            call_soon(self._turn)

    def _turn(self) -> None:
        """Serve the first ``shares_per_turn`` waiting; those they queue again, and the rest, wait for the next."""
        call_soon, self._call_soon = self._call_soon, None
        try:
            for _ in range(min(self._shares_per_turn, len(self._waiting))):
                self._waiting.popleft()()
        finally:  # a share that fails (a bug) leaves the others their turns
            if self._waiting and self._call_soon is None and call_soon is not None:
                self._call_soon = call_soon
                call_soon(self._turn)
