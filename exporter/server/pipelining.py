"""HTTP/1.1 pipelining bounded per connection: a client that sends requests without reading the answers holds a
bounded amount of the exporter's memory.

uvicorn queues a request that arrives while the one before it is answered (``pipeline``) and pauses reading, but
it resumes reading whenever an answer completes or the app reads, whatever its queue holds, and it parses every
request of a read at once. One connection sending ``GET /-/healthy`` in batches of 100 without reading took the
exporter from 55 to 732 MiB in 14 s. Here the parser is fed ``FEED_BYTES`` at a time; once ``PIPELINED_AT_MOST``
requests wait, the rest of the read is kept unparsed and the connection is not read until the queue drains. So a
connection holds at most the requests of one feed past the bound, and one read.

At close the queue is dropped: each queued request refers back to its protocol (a reference cycle), garbage that
reference counting cannot free, and that frozen (``exporter/server/gc_freeze.py``) the collector would not see.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Requests a connection may have waiting behind the one answered before it is no longer read.
PIPELINED_AT_MOST = 8
# Bytes parsed at once: the requests waiting are counted between two feeds (a heartbeat's head is about 200).
FEED_BYTES = 4096


class PipelineState:
    """What the protocol keeps per connection for the bound (slots: see ``request_guard.ConnectionState``)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        # Bytes read but not parsed, until the requests waiting drain.
        self.held: bytes | None = None


class BoundedFlow(FlowControl):
    """uvicorn's flow control, resuming reads only while the connection may be read: nothing is held and fewer
    than ``PIPELINED_AT_MOST`` requests wait."""

    def __init__(self, transport: Any, pipeline: deque[Any], state: PipelineState) -> None:
        super().__init__(transport)
        self._pipeline = pipeline
        self._state = state

    def resume_reading(self) -> None:
        if self._state.held is None and len(self._pipeline) < PIPELINED_AT_MOST:
            super().resume_reading()


class PipelineBoundProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with pipelining bounded; ``_parse`` (a subclass's checks, then the parser)
    is given each piece of a read, and ``_fed`` is called once a read is parsed or kept."""

    _connection: PipelineState
    flow: BoundedFlow

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
            self._connection.held = held + data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        for start in range(0, len(data), FEED_BYTES):
            if len(self.pipeline) >= PIPELINED_AT_MOST:
                self._connection.held = data[start:]
                self.flow.pause_reading()
                break
            self._parse(data[start : start + FEED_BYTES])
            if self.transport.is_closing():
                return
        self._fed()

    def _parse(self, data: bytes) -> None:
        HttpToolsProtocol.data_received(self, data)

    def _fed(self) -> None:
        """A read is parsed, or kept for later."""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._connection.held is not None and not self.transport.is_closing():
            # Not now: this may run within a parser callback (a quick heartbeat's answer), and the parser is busy.
            self.loop.call_soon(self._feed_held)

    def _feed_held(self) -> None:
        held, self._connection.held = self._connection.held, None
        if held is None or self.transport.is_closing():
            return
        self._feed(held)
        self.flow.resume_reading()
