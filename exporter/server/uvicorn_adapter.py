"""Every reach into uvicorn's non-public code: the exporter's HTTP/1.1 protocol, built on uvicorn's httptools one.

uvicorn's public ground (``uvicorn.run``, ``uvicorn.Config``, ASGI) offers no cap on a request's head, no
header-phase timeout, no bound on pipelined requests, no write deadline, no closing of an idle or stalled
connection at the connection cap and no way to answer a request beneath the app. Those are done here, in three
layers of one protocol: ``PipelineBoundProtocol`` (pipelining bounded, a connection's reads parsed a turn's worth
at a time), ``GuardedHttpToolsProtocol`` (the head's limits, the write deadline and the connection cap) and
``HeartbeatAnsweringProtocol`` (heartbeats answered beneath the app; what it answers and how is decided by
``exporter/server/quick_heartbeats.py``, which knows no uvicorn). pyproject.toml pins the uvicorn releases tested,
and ``tests/server/test_uvicorn_internals.py`` reads the list below and checks each name against the installed
uvicorn, and that this module uses no name of uvicorn's the list leaves out.

Non-public names relied on, and why:

- ``HttpToolsProtocol``: subclassed, from ``uvicorn.protocols.http.httptools_impl`` (a module of no public API).
- ``HttpToolsProtocol.__init__``: its parameters passed through, for the per-connection state.
- ``HttpToolsProtocol.connection_made``: extended: the flow control replaced, the connection cap, the head timer.
- ``HttpToolsProtocol.connection_lost``: extended: timers and queued requests dropped (reference cycles).
- ``HttpToolsProtocol.data_received``: overridden to feed the parser in pieces; uvicorn's called for each piece.
- ``HttpToolsProtocol.on_message_begin``: extended: a request's head begins.
- ``HttpToolsProtocol.on_headers_complete``: extended: the head's limits end.
- ``HttpToolsProtocol.on_message_complete``: extended: a waiting heartbeat is answered, the head's room renewed.
- ``HttpToolsProtocol.on_response_complete``: extended: a read held back is fed once the queue drains; a
  connection left waiting idle is kept among those that may make room at the cap.
- ``HttpToolsProtocol.pause_writing``: extended: the write deadline armed.
- ``HttpToolsProtocol.resume_writing``: extended: the write deadline disarmed.
- ``HttpToolsProtocol._start_asgi_task``: overridden: where a heartbeat is answered instead of starting the app.
- ``HttpToolsProtocol.timeout_keep_alive_handler``: called to close an idle connection at the connection cap.
- ``HttpToolsProtocol.timeout_keep_alive_task``: read: set while a connection waits idle for its next request.
- ``HttpToolsProtocol.access_log``: read: with the access log on, every request goes to the app (it logs them).
- ``HttpToolsProtocol.app``: read: only requests to the app itself are answered beneath it.
- ``HttpToolsProtocol.connections``: read and changed: the server's set of open connections (the cap).
- ``HttpToolsProtocol.cycle``: read and dropped: the current request's cycle.
- ``HttpToolsProtocol.scope``: dropped with the cycle once a heartbeat is answered.
- ``HttpToolsProtocol.headers``: dropped with the cycle once a heartbeat is answered.
- ``HttpToolsProtocol.flow``: replaced by ``BoundedFlow``; its ``write_paused`` read.
- ``HttpToolsProtocol.logger``: the server's logger, for the cap's and the refusals' warnings.
- ``HttpToolsProtocol.loop``: timers and the end of a heartbeat's answer scheduled on it.
- ``HttpToolsProtocol.pipeline``: read and cleared: the requests queued behind the one answered.
- ``HttpToolsProtocol.tasks``: a heartbeat's answer waiting for the transport to drain is kept in it.
- ``HttpToolsProtocol.transport``: written to and closed: a refusal before a request exists; reset past the
  write deadline.
- ``RequestResponseCycle``: the request a heartbeat is answered on.
- ``RequestResponseCycle.send``: uvicorn's own send, driven by hand: it writes the 204 as the app's would be.
- ``RequestResponseCycle.disconnected``: read: a client gone is left to the app.
- ``RequestResponseCycle.more_body``: read: a heartbeat whose message is not complete waits for it.
- ``RequestResponseCycle.response_complete``: read: a head timer waits while the request before it is answered.
- ``RequestResponseCycle.scope``: read: the request's ASGI scope.
- ``FlowControl``: subclassed, from ``uvicorn.protocols.http.flow_control``, to resume reading only within bounds.
- ``FlowControl.__init__``: its parameter passed through.
- ``FlowControl.pause_reading``: called once the pipelined requests reach their bound.
- ``FlowControl.resume_reading``: overridden to resume only within the bound.
- ``FlowControl.write_paused``: read: a transport past its high-water mark.
- ``STATUS_LINE``: the status lines of the refusals written before a request exists.

Besides, CPython keeps an instance's ``__dict__`` as values of keys shared by every instance only up to 29 keys:
uvicorn's protocol has 28 attributes, so what the exporter keeps per connection is one attribute with slots
(``ConnectionState``): each attribute more would cost every idle connection a fleet keeps a dict of its own
(docs/PERFORMANCE.md, "Kept connections against new ones").
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import socket
import struct
import termios
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Self

from starlette.types import ASGIApp, Message
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from exporter.config.settings import flag_of
from exporter.errors import HeadersTooLarge, HeaderTimeout, Refused, TooManyConnections
from exporter.server import gc_freeze
from exporter.server.feed_turns import FeedTurns
from exporter.server.oldest_first import OldestFirst
from exporter.server.problems import PROBLEM_JSON, problem_document, problem_for
from exporter.server.quick_heartbeats import QuickHeartbeats

# Requests a connection may have waiting behind the one answered before it is no longer read.
PIPELINED_AT_MOST = 8
# Bytes parsed at once: the requests waiting are counted between two feeds (a heartbeat's head is about 200). Also a
# connection's share of a turn of the event loop: the rest of a read waits for a later turn (``FeedTurns``).
FEED_BYTES = 4096
# Shares parsed in one turn of the event loop, whatever the number of connections with more to parse: the bytes of
# a turn's flood of pipelined heartbeats (8 KiB, about 85), so that a fresh request, which needs a few turns, is
# answered within milliseconds however many connections pipeline (exporter/server/feed_turns.py).
SHARES_PER_TURN = 2
# ``SO_LINGER`` on, for 0 seconds: a close resets the connection, dropping what is unsent.
LINGER_NONE = struct.pack("ii", 1, 0)
# At the connection cap, one warning per this many seconds at most, with the counts refused and closed since the last.
CAP_LOG_SECONDS = 10.0


class ConnectionState:
    """What the exporter's protocol keeps per connection beyond uvicorn's, in one attribute with slots (see the
    module: CPython's key-sharing dicts)."""

    __slots__ = (
        "feed_waiting", "head_begun", "header_room", "header_timer", "held", "waiting", "write_buffered",
        "write_timer",
    )  # fmt: skip

    def __init__(self, header_room: int) -> None:
        # Bytes read but not parsed, until the requests waiting drain or the connection's next share of a turn.
        self.held: bytes | memoryview | None = None
        # Queued for a share of a turn (``FeedTurns``).
        self.feed_waiting = False
        # Bytes the current request's line and headers may still take; None once they are in.
        self.header_room: int | None = header_room
        self.header_timer: asyncio.TimerHandle | None = None
        # A request's first bytes are in and its headers are not yet complete.
        self.head_begun = False
        # A heartbeat whose head is in, answered when its message completes (at once: it has no body).
        self.waiting: tuple[RequestResponseCycle, ASGIApp] | None = None
        # Armed while the transport is paused for writing (its peer reads too little); with the bytes it held then.
        self.write_timer: asyncio.TimerHandle | None = None
        self.write_buffered = 0


class BoundedFlow(FlowControl):
    """uvicorn's flow control, resuming reads only while the connection may be read: nothing is held and fewer
    than ``PIPELINED_AT_MOST`` requests wait."""

    def __init__(self, transport: Any, pipeline: deque[Any], state: ConnectionState) -> None:
        super().__init__(transport)
        self._pipeline = pipeline
        self._state = state

    def resume_reading(self) -> None:
        if self._state.held is None and len(self._pipeline) < PIPELINED_AT_MOST:
            super().resume_reading()


class ConnectionsByAge:
    """An event loop's connections that may make room at the cap, each kind oldest first: those that wait idle
    (kept as they go idle, dropped when found busy again), those stalled on writing and those whose head is
    incomplete (kept while their timer is armed)."""

    __slots__ = ("heads", "idle", "writing")

    def __init__(self) -> None:
        self.idle: OldestFirst[GuardedHttpToolsProtocol] = OldestFirst()
        self.writing: OldestFirst[GuardedHttpToolsProtocol] = OldestFirst()
        self.heads: OldestFirst[GuardedHttpToolsProtocol] = OldestFirst()


class PipelineBoundProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with HTTP/1.1 pipelining bounded per connection: a client that sends requests
    without reading the answers holds a bounded amount of the exporter's memory.

    uvicorn queues a request that arrives while the one before it is answered (``pipeline``) and pauses reading,
    but it resumes reading whenever an answer completes or the app reads, whatever its queue holds, and it parses
    every request of a read at once (what that cost, unbounded: docs/RELIABILITY.md, "Pipelining bounded"). Here
    the parser is fed ``FEED_BYTES`` at a time; once ``PIPELINED_AT_MOST`` requests wait, the rest of the read is
    kept unparsed and the connection is not read until the queue drains. So a connection holds at most the requests
    of one feed past the bound, and one read. A read is parsed ``FEED_BYTES`` a turn of the event loop: the rest is
    kept the same way and queued for a later turn (``FeedTurns``, one per loop), which parses the shares of at most
    ``SHARES_PER_TURN`` connections, in the order they queued.

    At close the queue is dropped: each queued request refers back to its protocol (a reference cycle), garbage that
    reference counting cannot free, and that frozen (``exporter/server/gc_freeze.py``) the collector would not see.
    ``_parse`` (a subclass's checks, then the parser) is given each piece of a read, and ``_fed`` is called once a
    read is parsed or kept.
    """

    _connection: ConnectionState
    flow: BoundedFlow
    # Each event loop's turns (weakly: an in-process test's loops come and go).
    _feed_turns: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FeedTurns]] = weakref.WeakKeyDictionary()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.flow = BoundedFlow(transport, self.pipeline, self._connection)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.held = None
        self.pipeline.clear()
        self.cycle = None  # type: ignore[assignment]  # it refers back to this protocol: a cycle

    def data_received(self, data: bytes) -> None:
        held = self._connection.held
        if held is not None:  # read as reading was paused
            self._connection.held = bytes(held) + data
            return
        self._feed(data)

    def _feed(self, data: bytes | memoryview) -> None:
        """Parse a share of ``data``, unless the requests waiting reach their bound; keep the rest."""
        view = memoryview(data)  # slices of it copy nothing: a read's rest is kept as it was read
        if len(self.pipeline) < PIPELINED_AT_MOST:
            self._parse(view[:FEED_BYTES])
            if self.transport.is_closing():
                return
            view = view[FEED_BYTES:]
        if view:
            self._connection.held = view
            self.flow.pause_reading()
            if len(self.pipeline) < PIPELINED_AT_MOST:  # this turn's share is parsed: the rest in a later one
                self._wait_for_a_turn()
        self._fed()

    def _parse(self, data: bytes | memoryview) -> None:
        HttpToolsProtocol.data_received(self, data)  # type: ignore[arg-type]  # the parser takes any buffer

    def _fed(self) -> None:
        """A read is parsed, or kept for later."""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._connection.held is not None and not self.transport.is_closing():
            # Not now: this may run within a parser callback (a quick heartbeat's answer), and the parser is busy.
            self._wait_for_a_turn()

    def _wait_for_a_turn(self) -> None:
        connection = self._connection
        if not connection.feed_waiting:
            connection.feed_waiting = True
            turns = self._feed_turns.get(self.loop)
            if turns is None:
                turns = self._feed_turns[self.loop] = FeedTurns(SHARES_PER_TURN)
            turns.wait(self._feed_held, self.loop.call_soon)

    def _feed_held(self) -> None:
        self._connection.feed_waiting = False
        held, self._connection.held = self._connection.held, None
        if held is None or self.transport.is_closing():
            return
        self._feed(held)
        self.flow.resume_reading()


class GuardedHttpToolsProtocol(PipelineBoundProtocol):
    """uvicorn's httptools protocol (its pipelining bounded) with 431 once a request's line and headers pass
    ``max_header_bytes``, and 408 when they take longer than ``header_timeout`` seconds (counted from the
    connection's start or the request's first byte), so neither a huge header nor a slow-header client can hold
    memory or a slot.
    An answer the client does not read is bounded by ``write_timeout``: once the transport pauses writing (its
    buffer past the high-water mark), the client must take some of it within that many seconds, again and again,
    or the connection is aborted, its buffers released (``write_stalled``); pipelined requests behind it go with it.
    A connection past the cap (``max_connections``; ``None``: none) makes room by closing, in this order, a
    kept-alive connection that waits idle for its next request (a client reconnects to send it; reset, as
    below, when the kernel still holds part of its last answer: ``unsent_bytes``), the connection
    stalled on writing longest (aborted), or the connection whose request head has been incomplete longest (answered
    503); only when none of them is open is it answered 503 and closed at once, before it sends anything. So idle
    connections cannot take every file descriptor, kept-alive ones (the plugin's, between heartbeats) never keep a
    scrape out, and neither clients that never read nor clients that never finish a head can hold every slot. The
    cap is this protocol's, not uvicorn's (``limit_concurrency``, left unset): uvicorn's also counts the app's tasks,
    and the task of a connection just closed to make room ends a turn of the loop later, so under a flood uvicorn's
    would answer 503 to a request that the room was made for."""

    # When the last warning of the cap was logged, and the connections refused and the stalled ones closed since
    # (one event loop per process).
    _cap_logged: ClassVar[float] = float("-inf")
    _cap_refused: ClassVar[int] = 0
    _cap_closed: ClassVar[int] = 0
    # Each event loop's connections that may make room, by age (weakly: an in-process test's loops come and go).
    _rooms: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ConnectionsByAge]] = (
        weakref.WeakKeyDictionary()
    )
    # The server's settings, the same for each connection: class attributes (see ``ConnectionState``).
    max_header_bytes: ClassVar[int]
    header_timeout: ClassVar[float]
    write_timeout: ClassVar[float]
    max_connections: ClassVar[int | None] = None

    @classmethod
    def configured(cls, **settings: object) -> Callable[..., Self]:
        """This protocol with a server's settings (``max_header_bytes``, ``header_timeout``, ``write_timeout``,
        ``max_connections``, a subclass's), for uvicorn's ``http``, which makes one per connection. A partial of a
        module-level function: it pickles, as uvicorn's worker processes (``--web.workers``) need."""
        return functools.partial(_configured_protocol, cls, tuple(sorted(settings.items())))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connection = ConnectionState(self.max_header_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        gc_freeze.connection_opened()
        limit = self.max_connections
        # uvicorn counts this connection already: it is past the cap when the others fill it.
        if limit is not None and len(self.connections) > limit and not self._make_room(limit):
            self._at_cap(limit)
            return
        self._arm_header_timer()

    def _make_room(self, limit: int) -> bool:
        """At the cap: close the oldest idle connection, else the one stalled on writing longest, else the one whose
        head has been incomplete longest; False if none is open. The one closed leaves the count at once."""
        room = self._room()
        idle = room.idle.oldest(lambda connection: connection._is_idle() and connection in self.connections)
        if idle is not None:
            room.idle.discard(idle)
            if unsent_bytes(idle.transport):  # its peer reads nothing: a close would leave the rest to the kernel
                reset(idle.transport)
            else:
                idle.timeout_keep_alive_handler()
            self.connections.discard(idle)
            return True
        stalled = room.writing.oldest(lambda connection: connection in self.connections)
        if stalled is not None:
            room.writing.discard(stalled)
            reset(stalled.transport)
        else:
            stalled = room.heads.oldest(lambda connection: connection in self.connections)
            # A head timed from this turn of the loop is left alone: its connection was accepted with this one, and
            # what it sent is read after it. Those younger are timed from this turn too.
            timer = None if stalled is None else stalled._connection.header_timer
            if timer is None or timer.when() >= self.loop.time() + self.header_timeout:
                return False
            room.heads.discard(stalled)
            detail = "the exporter is at its connection cap and the request's head is still incomplete"
            stalled._refuse(TooManyConnections(None, detail), log=False)
        self.connections.discard(stalled)
        GuardedHttpToolsProtocol._cap_closed += 1
        self._warn_of_the_cap(limit)
        return True

    def _room(self) -> ConnectionsByAge:
        room = self._rooms.get(self.loop)
        if room is None:
            room = self._rooms[self.loop] = ConnectionsByAge()
        return room

    def _is_idle(self) -> bool:
        """Waiting for its next request (its keep-alive timer runs)."""
        return self.timeout_keep_alive_task is not None and not self.transport.is_closing()

    def _at_cap(self, limit: int) -> None:
        GuardedHttpToolsProtocol._cap_refused += 1
        self._warn_of_the_cap(limit)
        detail = f"the exporter serves at most {limit} connections at once; retry later"
        self._refuse(TooManyConnections(None, detail), log=False)

    def _warn_of_the_cap(self, limit: int) -> None:
        """At most one warning each ``CAP_LOG_SECONDS``, with the connections refused and closed since the last."""
        cls = GuardedHttpToolsProtocol
        now = time.monotonic()
        if now - cls._cap_logged >= CAP_LOG_SECONDS:
            self.logger.warning("At the connection cap of %d (%s): refused %d connection(s) with 503 and closed %d "
                                "stalled one(s) since the last such warning", limit, flag_of("max_connections"),
                                cls._cap_refused, cls._cap_closed)  # fmt: skip
            cls._cap_logged, cls._cap_refused, cls._cap_closed = now, 0, 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_write_timer()
        self._room().idle.discard(self)
        super().connection_lost(exc)
        gc_freeze.connection_closed()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:
            self._room().idle.add(self)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._connection.write_timer is None:
            self._arm_write_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write_timer()

    def _arm_write_timer(self) -> None:
        connection = self._connection
        connection.write_buffered = self.transport.get_write_buffer_size()
        connection.write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)
        self._room().writing.add(self)

    def _disarm_write_timer(self) -> None:
        connection = self._connection
        if connection.write_timer is not None:
            connection.write_timer.cancel()
            connection.write_timer = None
            self._room().writing.discard(self)

    def _write_timed_out(self) -> None:
        connection = self._connection
        connection.write_timer = None
        self._room().writing.discard(self)
        if self.transport.is_closing():
            return
        if write_stalled(connection.write_buffered, self.transport.get_write_buffer_size()):
            reset(self.transport)
        else:  # the client reads, slowly: its next stretch is timed from now
            self._arm_write_timer()

    def _fed(self) -> None:
        """A head still incomplete after a read is timed from now on.

        Timed here rather than as the head begins: a request whose head comes in one read (a heartbeat, most
        requests) then arms and cancels no timer."""
        connection = self._connection
        if connection.head_begun and connection.header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def _parse(self, data: bytes) -> None:
        """Parse ``data`` within the header room."""
        connection = self._connection
        room = connection.header_room
        if room is None or len(data) <= room:
            if room is not None:
                connection.header_room = room - len(data)
            super()._parse(data)
            return
        connection.header_room = 0
        super()._parse(data[:room])
        if self.transport.is_closing():
            return
        if connection.header_room == 0:  # the headers are still not complete, and their room is used up
            detail = f"the request line and headers are limited to {self.max_header_bytes} bytes"
            self._refuse(HeadersTooLarge("headers", detail))
            return
        self._parse(data[room:])

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._connection.head_begun = True

    def on_headers_complete(self) -> None:
        connection = self._connection
        connection.header_room = None
        connection.head_begun = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._connection.header_room = self.max_header_bytes  # what follows is the next request's head

    def _arm_header_timer(self) -> None:
        self._connection.header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)
        self._room().heads.add(self)

    def _disarm_header_timer(self) -> None:
        connection = self._connection
        if connection.header_timer is not None:
            connection.header_timer.cancel()
            connection.header_timer = None
            self._room().heads.discard(self)

    def _header_timed_out(self) -> None:
        self._connection.header_timer = None
        self._room().heads.discard(self)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # answer the request before it first
            self._arm_header_timer()
            return
        self._refuse(
            HeaderTimeout("headers", f"the request line and headers did not arrive within {self.header_timeout} s")
        )

    def _refuse(self, error: Refused, log: bool = True) -> None:
        """Answer with the error's problem and close: no request exists yet, so the answer is written here."""
        problem = problem_for(error)
        body = problem_document(problem)
        headers = {"content-type": PROBLEM_JSON, "content-length": str(len(body)), **problem.headers}
        head = "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items()).encode("latin-1")
        if log:
            self.logger.warning("Refused a request: %s", problem.detail)
        self.transport.write(STATUS_LINE[problem.status] + head + b"\r\n" + body)
        self.transport.close()


def reset(transport: asyncio.Transport) -> None:
    """Abort a connection with a reset (``SO_LINGER`` of 0): a plain close of a socket whose peer reads nothing
    leaves the kernel holding what is unsent, in an orphan that waits for the peer's window for minutes, the peer
    none the wiser; a reset frees it at once and tells the peer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_NONE)
    transport.abort()


def unsent_bytes(transport: asyncio.Transport) -> int:
    """What the kernel still holds of what was written to the connection, unsent or not yet acknowledged by the
    peer (Linux's ``SIOCOUTQ``): more than a little once a peer that reads nothing has closed its window; 0 where
    that cannot be asked. An answer that fits in the kernel's buffers (a few MB on loopback) leaves the transport
    at once: its connection then waits idle while the kernel holds the answer, and a plain close would leave it
    there, in an orphan socket, for minutes. A thousand such hold gigabytes of the kernel's memory for TCP, whose
    pressure then slows every connection."""
    sock = transport.get_extra_info("socket")
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0] if sock else 0
    except (OSError, AttributeError):
        return 0


def write_stalled(buffered_before: int, buffered_now: int) -> bool:
    """Whether a client took none of its answer in a write deadline: the transport buffers as many bytes as when
    the deadline was armed, or more (what was sent since was written behind them, none taken)."""
    return buffered_now >= buffered_before


def _configured_protocol(
    protocol: type[GuardedHttpToolsProtocol], settings: tuple[tuple[str, object], ...], *args: Any, **kwargs: Any
) -> GuardedHttpToolsProtocol:
    return _configured_class(protocol, settings)(*args, **kwargs)


@functools.cache
def _configured_class(
    protocol: type[GuardedHttpToolsProtocol], settings: tuple[tuple[str, object], ...]
) -> type[GuardedHttpToolsProtocol]:
    """The protocol with the settings as class attributes: one class per server."""
    return type(protocol.__name__, (protocol,), dict(settings))


class HeartbeatAnsweringProtocol(GuardedHttpToolsProtocol):
    """The guarded protocol, answering the heartbeats that ``heartbeats`` hears without starting the app
    (``None``: none; set by ``configured``), through uvicorn's own ``send``: when the 204's head takes the transport
    past its high-water mark (a client slower to read than the exporter answers), its end is sent as the app's
    would be, once the transport drains."""

    heartbeats: ClassVar[QuickHeartbeats | None] = None

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGIApp) -> None:  # type: ignore[override]
        heartbeats = self.heartbeats
        if heartbeats is None or app is not self.app or self.access_log or not heartbeats.may_answer(cycle.scope):
            super()._start_asgi_task(cycle, app)  # type: ignore[arg-type]
        elif cycle.more_body:
            self._connection.waiting = (cycle, app)
        else:  # a pipelined heartbeat, started after the request before it
            self._answer(cycle, app)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        connection = self._connection
        waiting = connection.waiting
        if waiting is not None and waiting[0] is self.cycle:
            connection.waiting = None
            self._answer(*waiting)

    def _answer(self, cycle: RequestResponseCycle, app: ASGIApp) -> None:
        assert self.heartbeats is not None
        headers = None if cycle.disconnected or self.flow.write_paused else self.heartbeats.answer(cycle.scope)
        if headers is None:
            super()._start_asgi_task(cycle, app)  # type: ignore[arg-type]
            return
        # uvicorn's send, which awaits only a paused transport: it completes at once here.
        _complete_at_once(cycle.send({"type": "http.response.start", "status": 204, "headers": headers}))
        if self.flow.write_paused:  # the head took the transport past its mark: the end waits for it to drain
            ending = self.loop.create_task(cycle.send(_END))
            ending.add_done_callback(self.tasks.discard)
            self.tasks.add(ending)
            return
        _complete_at_once(cycle.send(_END))
        # Nothing reads it again (it had no body): an idle connection holds less (docs/PERFORMANCE.md, "Kept
        # connections against new ones"). Unless the next request's head is begun: its scope and headers are
        # being parsed.
        if cycle is self.cycle and not self._connection.head_begun:
            self.cycle = self.scope = self.headers = None  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.waiting = None  # it refers back to this protocol: a cycle


# The end of a 204: no body.
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def _complete_at_once(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine that never suspends to its end."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("a send that was to complete at once suspended")
