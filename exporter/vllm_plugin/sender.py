"""The client side of the exporter's ingest API, shared by ``cache-config-exporter push`` and the vLLM plugin.

It knows the API's paths and queries (ready responses, cache configs, heartbeats, goodbyes), the content
type of each wire format and the bearer token, makes a call (``send`` on a connection of its
own, ``Connection`` on one kept across calls) and says what came of it:
``Accepted`` with the exporter's JSON answer, ``Rejected`` with the status, the problem's ``detail`` and
``field`` and the wait its ``Retry-After`` asks for, or ``Unreachable`` with the reason. A request of several
engines' ready responses names each one it refused (``item_refusals``). What to do next (print, retry, warn) is
the caller's.

Whatever answers at the URL, a call is bounded: one deadline, the timeout, for the whole exchange (connecting,
sending, every byte of the answer), and at most ``ANSWER_BYTES`` of the answer read (``STATE_BYTES`` by
``push``). Inside vLLM a server that withholds or trickles its answer, or sends one without end, must cost
neither time nor memory.

Imports only the standard library and ``retry_after``: it runs inside vLLM's frontend.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter import __version__
from exporter.vllm_plugin import retry_after

# Shared by ``push --timeout`` and the plugin's ``CACHE_CONFIG_EXPORTER_TIMEOUT``.
DEFAULT_TIMEOUT_SECONDS = 2.0
# The most the plugin reads of any answer: status line, headers and body together. What it uses of an answer is
# its status, ``Retry-After``, a problem's ``detail`` and ``field`` and a batch's refusals: a few hundred bytes each.
ANSWER_BYTES = 16 * 1024
# The most ``push`` reads: it prints the replica's synced state, about 1.1 KB an engine, of up to 1,024 engines.
STATE_BYTES = 8 * 1024 * 1024
CONTENT_TYPES = {"json": "application/json", "msgpack": "application/vnd.msgpack"}
_URL_SEPARATORS = re.compile(r"[\s,]+")
# How much of a refusal's detail a message carries.
_DETAIL_LENGTH = 200


@dataclass(frozen=True)
class Call:
    """One request of the ingest API: ``path`` is below the exporter's base URL, with its query."""

    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class Accepted:
    """A 2xx answer; ``state`` is its JSON (the synced deployment for a ready response), ``None`` when empty or
    ``unread``: a JSON answer announced longer than ``ANSWER_BYTES`` (the state of a replica of many engines) is
    taken as the exporter's acceptance and left unread."""

    state: Any
    unread: bool = False


@dataclass(frozen=True)
class Rejected:
    """An HTTP error answer: ``detail`` and ``field`` come from the exporter's problem document; ``items``, for a
    request of several ready responses none of which was taken, each one's refusal by its place in the request."""

    status: int
    detail: str
    field: str | None
    items: dict[int, Rejected] = field(default_factory=dict, compare=False)
    # The seconds its ``Retry-After`` asks to wait (``retry_after.seconds_of``), ``None`` without one.
    retry_after: float | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return (
            f"HTTP {self.status}"
            + (f": {self.detail}" if self.detail else "")
            + (f" (field {self.field})" if self.field else "")
            + (f" (Retry-After: {self.retry_after:g} s)" if self.retry_after is not None else "")
        )


@dataclass(frozen=True)
class Unreachable:
    """No answer: refused connection, timeout, TLS or protocol failure, or an answer that is not the API's."""

    reason: str

    def __str__(self) -> str:
        return self.reason


CallResult = Accepted | Rejected | Unreachable


def split_urls(value: str) -> list[str]:
    """The base URLs of a comma- or space-separated list, without trailing slashes."""
    return [url for url in (entry.rstrip("/") for entry in _URL_SEPARATORS.split(value.strip())) if url]


def _deployment_path(deployment: str) -> str:
    return f"/api/v1/deployments/{urllib.parse.quote(deployment, safe='/')}"


def _query(**values: object) -> str:
    """The query of the given values; ``None`` ones are left out, seconds written as ``30`` rather than ``30.0``."""
    return urllib.parse.urlencode(
        {
            name: f"{value:g}" if isinstance(value, float) else value
            for name, value in values.items()
            if value is not None
        }
    )


def ready_call(
    deployment: str,
    body: bytes,
    wire_format: str,
    replica: str,
    *,
    engine: int | None = None,
    heartbeat: float | None = None,
) -> Call:
    """Ingest one engine's ready response (``wire_format`` ``json`` or ``msgpack``); with ``heartbeat``, the
    replica promises heartbeats at that interval."""
    query = _query(replica=replica, engine=engine, heartbeat=heartbeat)
    return Call("POST", f"{_deployment_path(deployment)}/ready?{query}", body, CONTENT_TYPES[wire_format])


def ready_batch_call(
    deployment: str, payloads: Sequence[bytes], replica: str, *, heartbeat: float | None = None
) -> Call:
    """Ingest several engines' msgpack ready responses of one replica in one request (one commit).

    The body is a msgpack array of the responses, each exactly as its engine encoded it.
    """
    query = _query(replica=replica, heartbeat=heartbeat)
    body = _msgpack_array_header(len(payloads)) + b"".join(payloads)
    return Call("POST", f"{_deployment_path(deployment)}/ready?{query}", body, CONTENT_TYPES["msgpack"])


def _msgpack_array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def cache_config_call(deployment: str, labels: dict[str, str], replica: str, *, heartbeat: float | None = None) -> Call:
    """Set the replica's static labels (vLLM's ``metrics_info()``)."""
    query = _query(replica=replica, heartbeat=heartbeat)
    path = f"{_deployment_path(deployment)}/cache-config?{query}"
    return Call("PUT", path, json.dumps(labels).encode(), CONTENT_TYPES["json"])


def heartbeat_call(deployment: str, replica: str, interval: float) -> Call:
    """Keep the replica alive; a 404 answer means the exporter does not hold it. The empty body is sent with
    its length, as proxies in front of the exporter may require."""
    return Call("POST", f"{_deployment_path(deployment)}/heartbeat?{_query(replica=replica, interval=interval)}", b"")


def goodbye_call(deployment: str, replica: str) -> Call:
    """Remove the replica at once (its server shuts down cleanly)."""
    return Call("DELETE", f"{_deployment_path(deployment)}?{_query(replica=replica)}")


def send(
    base_url: str,
    call: Call,
    timeout: float,
    *,
    authorization: str | None = None,
    client: str,
    answer_bytes: int = STATE_BYTES,
) -> CallResult:
    """Make ``call`` to the exporter at ``base_url`` on a connection of its own, within ``timeout`` seconds in
    all, reading at most ``answer_bytes`` of the answer; never raises. ``client`` (``push``, ``vllm-plugin``) names
    the sender in the ``User-Agent``."""
    connection = Connection(base_url, timeout, client=client, answer_bytes=answer_bytes)
    try:
        return connection.send(call, authorization=authorization)
    finally:
        connection.close()


class AnswerTooLong(http.client.HTTPException):
    """The answer goes on past the cap: the rest is not read."""

    def __init__(self, cap: int) -> None:
        super().__init__(f"the answer is longer than {cap} bytes")


class Exchange:
    """The bounds of one call: a deadline for the whole exchange, and the bytes of its answer still to be read.

    ``clock`` is monotonic seconds (a fake one in tests); every step of the exchange asks ``remaining`` for the
    time it may take, and every read asks ``allowance`` how much it may read.
    """

    def __init__(
        self, timeout: float, clock: Callable[[], float] = time.monotonic, answer_bytes: int = ANSWER_BYTES
    ) -> None:
        self.timeout = timeout
        self._clock = clock
        self._deadline = clock() + timeout
        self.cap = answer_bytes
        self.left = answer_bytes

    def remaining(self) -> float:
        """The seconds left until the deadline; raises ``TimeoutError`` once it has passed."""
        left = self._deadline - self._clock()
        if left <= 0:
            raise TimeoutError(f"timed out: no whole answer within {self.timeout:g} s")
        return left

    def allowance(self, wanted: int) -> int:
        """How many of ``wanted`` bytes the next read may take: what is left of the cap; at the cap, one byte,
        which tells an answer that goes on from one that ends right there."""
        return min(wanted, self.left) if self.left > 0 else 1

    def read(self, count: int) -> None:
        """``count`` bytes of the answer were read; raises ``AnswerTooLong`` once they go past the cap."""
        self.left -= count
        if self.left < 0:
            raise AnswerTooLong(self.cap)


class _BoundedReader(io.RawIOBase):
    """The answer's bytes as they arrive on the socket, each read within the exchange's deadline and cap."""

    def __init__(self, owner: _BoundedSocket, exchange: Exchange) -> None:
        super().__init__()
        self._owner = owner
        self._exchange = exchange

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as view:
            wanted = self._exchange.allowance(len(view))
            self._owner.sock.settimeout(self._exchange.remaining())
            count = self._owner.sock.recv_into(view[:wanted])
        self._exchange.read(count)
        return count

    def close(self) -> None:
        if not self.closed:
            self._owner.reader_closed()
        super().close()


class _BoundedSocket:
    """A connection's socket as ``http.client`` uses it (``sendall``, ``makefile``, ``close``), each step of the
    current ``exchange`` within its bounds. ``socket.sendall`` would time each send of an SSL socket alone.

    As with ``socket.makefile``, the socket closes once it and every reader made of it are closed: an answer that
    ends the connection is read after ``http.client`` closed it."""

    def __init__(self, sock: socket.socket, exchange: Exchange) -> None:
        self.sock = sock
        self.exchange = exchange
        self._readers = 0
        self._closed = False

    def sendall(self, data: bytes) -> None:
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                self.sock.settimeout(self.exchange.remaining())
                sent += self.sock.send(view[sent:])

    def makefile(self, mode: str) -> io.BufferedReader:
        """The answer's reader (``mode`` is ``rb``, the one ``http.client`` asks for)."""
        self._readers += 1
        return io.BufferedReader(_BoundedReader(self, self.exchange))

    def reader_closed(self) -> None:
        self._readers -= 1
        self._close_when_unused()

    def close(self) -> None:
        self._closed = True
        self._close_when_unused()

    def _close_when_unused(self) -> None:
        if self._closed and not self._readers:
            self.sock.close()


class _Bounded(http.client.HTTPConnection):
    """An HTTP connection whose every step keeps to ``exchange``'s bounds: connecting, sending, reading."""

    def __init__(self, host: str, port: int | None) -> None:
        super().__init__(host, port)
        self.exchange = Exchange(0.0)  # until ``bound_by``: no time at all

    def connect(self) -> None:
        self.timeout = self.exchange.remaining()
        super().connect()
        self._bound()

    def _bound(self) -> None:
        """From now on the socket answers to the exchange of each call."""
        self.sock = _BoundedSocket(self.sock, self.exchange)

    def bound_by(self, exchange: Exchange) -> None:
        """The bounds of the next call."""
        self.exchange = exchange
        if isinstance(self.sock, _BoundedSocket):
            self.sock.exchange = exchange


class _BoundedTLS(_Bounded):
    """``_Bounded`` over TLS: the handshake too within the deadline."""

    def __init__(self, host: str, port: int | None, context: ssl.SSLContext) -> None:
        super().__init__(host, port or http.client.HTTPS_PORT)
        self._context = context

    def _bound(self) -> None:
        self.sock.settimeout(self.exchange.remaining())
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)
        super()._bound()


# What a kept connection the exporter has closed meanwhile raises as it is used again, before any answer.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class Connection:
    """Calls to one exporter, one after another, on one kept-alive HTTP/1.1 connection (a plugin thread's).

    A request on a new TCP connection costs the exporter several times one on a kept connection
    (docs/PERFORMANCE.md), and a fleet's heartbeats are most of its requests. When the kept connection turns out
    to be closed by the exporter meanwhile (its keep-alive timeout, a restart, its connection cap) before any
    answer began, the call is made once more on a new connection, within the same deadline: every call of the
    ingest API may be repeated. A child process forked meanwhile opens a connection of its own. The exporter is
    reached directly, never through a proxy of the environment (``HTTP_PROXY``).
    """

    def __init__(self, base_url: str, timeout: float, *, client: str, answer_bytes: int = ANSWER_BYTES) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.answer_bytes = answer_bytes
        self._user_agent = f"cache-config-exporter-{client}/{__version__}"
        self._http: _Bounded | None = None
        self._tls: ssl.SSLContext | None = None
        self._prefix = ""
        self._pid = 0  # of the process that opened the kept connection

    def send(self, call: Call, *, authorization: str | None = None, timeout: float | None = None) -> CallResult:
        """Make ``call`` within ``timeout`` seconds in all (by default the connection's); never raises."""
        exchange = Exchange(self.timeout if timeout is None else timeout, answer_bytes=self.answer_bytes)
        headers = {"User-Agent": self._user_agent}
        if call.content_type:
            headers["Content-Type"] = call.content_type
        if authorization:
            headers["Authorization"] = authorization
        if self._pid != os.getpid():
            self._http = None  # the parent's socket: using it would interleave two processes' requests
        while True:
            reused = self._http is not None
            try:
                answer = self._exchange(call, headers, exchange)
            except _STALE as error:
                self.close()
                if reused:
                    continue
                return Unreachable(str(error) or type(error).__name__)
            except (OSError, http.client.HTTPException, ValueError) as error:
                self.close()
                return Unreachable(str(error) or type(error).__name__)
            break
        status, body, fields = answer
        if not 200 <= status < 300:
            return _refusal(status, body, retry_after.seconds_of(fields.get("Retry-After"), time.time()))
        if body is None:
            return Accepted(None, unread=True)
        if not body:
            return Accepted(None)
        try:
            return Accepted(json.loads(body))
        except ValueError:
            return Unreachable(f"the answer is not the exporter's JSON: {_excerpt(body)!r}")

    def _exchange(
        self, call: Call, headers: dict[str, str], exchange: Exchange
    ) -> tuple[int, bytes | None, http.client.HTTPMessage]:
        """One request within ``exchange``'s bounds, and its answer's status, body and headers.

        Of a refusal, the body's first bytes up to the cap. A 2xx answer longer than the cap is an error, unless
        it announces the exporter's JSON of that length: then its body is ``None``, unread.
        """
        if self._http is None:
            self._http = self._open()
        self._http.bound_by(exchange)
        self._http.request(call.method, f"{self._prefix}{call.path}", body=call.body, headers=headers)
        response = self._http.getresponse()
        body: bytes | None
        if not 200 <= response.status < 300:
            body = _first_bytes(response, exchange.cap)
        elif response.length is not None and response.length > exchange.left:
            if not _is_json(response):
                raise AnswerTooLong(exchange.cap)
            body = None
        else:
            body = _first_bytes(response, exchange.cap)
            if not response.isclosed():
                raise AnswerTooLong(exchange.cap)
        if response.will_close or not response.isclosed():  # closing, or an unread rest
            response.close()
            self.close()
        return response.status, body, response.msg

    def _open(self) -> _Bounded:
        """A new connection to ``base_url``'s host; the URL's path is the prefix of every call's."""
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unknown url type: {parts.scheme or self.base_url!r}")
        if not parts.hostname:
            raise ValueError(f"no host given: {self.base_url!r}")
        self._prefix = parts.path.rstrip("/")
        self._pid = os.getpid()
        if parts.scheme == "http":
            return _Bounded(parts.hostname, parts.port)
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return _BoundedTLS(parts.hostname, parts.port, self._tls)

    def close(self) -> None:
        """Close the kept connection; the next call opens a new one."""
        if self._http is not None:
            self._http.close()
            self._http = None


def _first_bytes(response: http.client.HTTPResponse, cap: int) -> bytes:
    """The body up to the ``cap``, one read of the socket at a time (a length the server announces is no size to
    allocate), gathered in one buffer; the response is closed when that is all of it."""
    body = bytearray()
    try:
        while not response.isclosed() and response.length != 0:
            piece = response.read1(cap + 1 - len(body))
            if not piece:
                break
            body += piece
    except AnswerTooLong:
        pass  # what was read before is the body's first bytes
    if response.length == 0:
        response.close()  # all its announced length read (``read1`` leaves such a response open)
    return bytes(body)


def _is_json(response: http.client.HTTPResponse) -> bool:
    return response.getheader("Content-Type", "").split(";")[0].strip().lower() == CONTENT_TYPES["json"]


def _refusal(status: int, body: bytes, wait: float | None) -> Rejected:
    """The problem document's ``detail``, ``field`` and refused items; any other body is the detail as it is.
    ``wait`` is what its ``Retry-After`` asks for."""
    try:
        problem = json.loads(body)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        return Rejected(status, _excerpt(body), None, retry_after=wait)
    return _problem(status, problem, item_refusals(problem.get("refused")), wait)


def _problem(status: int, problem: dict[str, Any], items: dict[int, Rejected], wait: float | None = None) -> Rejected:
    field_name = problem.get("field")
    detail = str(problem.get("detail") or "")[:_DETAIL_LENGTH]
    return Rejected(status, detail, str(field_name) if field_name else None, items, wait)


def item_refusals(refused: object) -> dict[int, Rejected]:
    """The ``refused`` list of an answer to several ready responses: each refusal by its place in the request."""
    if not isinstance(refused, list):
        return {}
    return {
        item["index"]: _problem(item["status"], item, {})
        for item in refused
        if isinstance(item, dict) and isinstance(item.get("index"), int) and isinstance(item.get("status"), int)
    }


def _excerpt(body: bytes) -> str:
    return body.decode("utf-8", "replace").strip()[:_DETAIL_LENGTH]
