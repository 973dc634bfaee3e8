"""Fetching a target's ``/metrics`` for a probe: one bounded HTTP/1.1 GET, on the event loop.

The exporter has no HTTP client dependency of its own; uvicorn's, h11 (a sans-I/O HTTP/1.1 parser), reads the
response, over asyncio's streams. Everything a target controls is bounded: the response head (16 KiB, the 1xx
answers before it included), the body (``--probe.max-body-bytes``, checked against ``Content-Length`` before a
byte of it is read, and against the bytes on the wire, chunk framing included, as they come), the time (the
caller's deadline covers resolving, connecting, TLS and reading) and the event loop (h11's events, about
13 us each for endless 1-byte chunks, are taken in the probes' turns, ``turns.py``). A body is never decoded:
identity is asked for, any other ``Content-Encoding`` is refused unread. Redirects are not followed: they
could lead outside the allowlist. A message says what broke and where, never the target's bytes. TLS and
credentials for protected ``/metrics`` come from the settings; the secrets from files, read again when they
change.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import h11

from exporter import __version__
from exporter.flags.option import SettingsError
from exporter.flags.watched_files import Watched
from exporter.probe.allowlist import ProbeTarget
from exporter.probe.options import ProbeSettings, probe_flag
from exporter.probe.turns import ProbeTurns
from exporter.secret_files import read_secret
from protocol import tokens

# The response line and headers of a target; vLLM's are a few hundred bytes.
MAX_HEAD_BYTES = 16 << 10
_READ_BYTES = 64 << 10
# Prometheus text, as Prometheus itself asks for it; never compressed, so the body cap is what is read.
_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_MAX_BODY_FLAG = probe_flag("probe_max_body_bytes")


class ProbeFailed(Exception):
    """The probe cannot show the target's cache config; ``result`` says why in one word (a label value)."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


def _authorization(settings: ProbeSettings) -> Watched[str] | None:
    """The ``Authorization`` header value, from the secret file of the settings; ``None`` without one."""
    if settings.probe_bearer_token_file is not None:
        flag, path = probe_flag("probe_bearer_token_file"), settings.probe_bearer_token_file

        def load() -> tuple[str, tuple[Path, ...]]:
            try:
                return tokens.bearer(read_secret(flag, path)), (path,)
            except tokens.TokenError as error:
                raise SettingsError(f"{flag} {path}: {error}") from None

    elif settings.probe_basic_auth_password_file is not None:
        flag, path = probe_flag("probe_basic_auth_password_file"), settings.probe_basic_auth_password_file

        def load() -> tuple[str, tuple[Path, ...]]:
            pair = f"{settings.probe_basic_auth_username}:{read_secret(flag, path)}".encode()
            return f"Basic {base64.b64encode(pair).decode()}", (path,)

    else:
        return None
    return Watched(f"{flag} {path}", load)


def _tls_context(settings: ProbeSettings) -> ssl.SSLContext:
    """The system's trust store, or ``--probe.tls-ca-file``; verification off only when asked for."""
    flag = probe_flag("probe_tls_ca_file")
    try:
        context = ssl.create_default_context(cafile=settings.probe_tls_ca_file)
    except (OSError, ssl.SSLError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise SettingsError(f"{flag} {settings.probe_tls_ca_file}: {reason}") from None
    if settings.probe_tls_insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True)
class MetricsClient:
    """How the probe reads targets: scheme, TLS, credentials and the body cap, from the settings."""

    max_body_bytes: int
    tls: ssl.SSLContext | None
    server_name: str | None
    authorization: Watched[str] | None

    @classmethod
    def from_settings(cls, settings: ProbeSettings) -> MetricsClient:
        """Reads the CA and secret files now: a wrong one stops start-up (``SettingsError``)."""
        return cls(
            max_body_bytes=settings.probe_max_body_bytes,
            tls=_tls_context(settings) if settings.probe_scheme == "https" else None,
            server_name=settings.probe_tls_server_name or None,
            authorization=_authorization(settings),
        )

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    async def fetch(
        self, target: ProbeTarget, addresses: list[str], log: Callable[[str], None], turns: ProbeTurns, body: BodyReader
    ) -> None:
        """``GET /metrics`` from the first of ``addresses`` that takes the connection, its body given to ``body``
        as it comes, in ``turns``' slices."""
        streams = None
        for address in addresses:
            try:
                streams = await asyncio.open_connection(
                    address,
                    target.port,
                    ssl=self.tls,
                    server_hostname=(self.server_name or target.host) if self.tls else None,
                    limit=_READ_BYTES,
                )
                log(f"connected to {address} port {target.port}")
                break
            except ssl.SSLError as error:
                raise ProbeFailed("unreachable", f"TLS with {address} failed: {error}") from None
            except OSError as error:
                log(f"cannot connect to {address} port {target.port}: {error.strerror or error}")
        if streams is None:
            raise ProbeFailed("unreachable", f"no address of {target.text} takes a connection")
        reader, writer = streams
        connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        response = _Response(connection, self.max_body_bytes, body)
        try:
            writer.write(connection.send(self._request(target)) + (connection.send(h11.EndOfMessage()) or b""))
            while not await turns.run(response.events()):
                response.receive(await reader.read(_READ_BYTES))
        except (h11.RemoteProtocolError, h11.LocalProtocolError):
            raise ProbeFailed("unreachable", response.where_it_broke()) from None
        except OSError as error:
            raise ProbeFailed("unreachable", f"the connection failed: {error.strerror or error}") from None
        finally:
            writer.transport.abort()  # no waiting for a TLS close_notify from a target that may never send it

    def _request(self, target: ProbeTarget) -> h11.Request:
        headers = [
            ("Host", target.normalized),
            ("User-Agent", f"cache-config-exporter/{__version__}"),
            ("Accept", _ACCEPT),
            ("Accept-Encoding", "identity"),
            ("Connection", "close"),
        ]
        if self.authorization is not None:
            headers.append(("Authorization", self.authorization.current()))
        return h11.Request(method="GET", target="/metrics", headers=headers)


class BodyReader(Protocol):
    """What takes a response's body as it comes, in steps (the probe's turns run them)."""

    def feed(self, data: bytes) -> Generator[None, None, None]: ...


class _Response:
    """One response as h11 reads it: its head checked, its body handed on, the bytes on the wire counted
    against the caps (the head's, then the body's with its chunk framing), and how far it got when it broke."""

    def __init__(self, connection: h11.Connection, max_body_bytes: int, body: BodyReader) -> None:
        self.connection = connection
        self.max_body_bytes = max_body_bytes
        self.body = body
        self.wire_bytes = 0
        self.head_bytes: int | None = None  # known once the head is read
        self.closed = False

    def receive(self, data: bytes) -> None:
        """Bytes off the wire (none: the target closed the connection)."""
        self.closed = not data
        self.wire_bytes += len(data)
        self.connection.receive_data(data)
        self._check_body_bytes()

    def events(self) -> Generator[None, None, bool]:
        """Take the events h11 has, one a step: ``True`` at the body's end, ``False`` when it needs more data.
        Informational responses are skipped; anything but a 200 is a ``ProbeFailed``."""
        while True:
            event = self.connection.next_event()
            if event is h11.NEED_DATA:
                return False
            if isinstance(event, h11.InformationalResponse | h11.Response):
                read = self.wire_bytes - len(self.connection.trailing_data[0])
                if read > MAX_HEAD_BYTES:  # h11 bounds one head; this, a head and the 1xx answers before it
                    raise ProbeFailed("unreachable", f"the response head passed {MAX_HEAD_BYTES} bytes")
                if isinstance(event, h11.Response):
                    self.head_bytes = read
                    _check_head(event, self.max_body_bytes)
                    self._check_body_bytes()
            elif isinstance(event, h11.Data):
                yield from self.body.feed(event.data)
            elif isinstance(event, h11.EndOfMessage):  # h11 raises for a connection closed before it
                return True
            yield

    def _check_body_bytes(self) -> None:
        if self.head_bytes is not None and self.wire_bytes - self.head_bytes > self.max_body_bytes:
            raise ProbeFailed("too_large", f"the body passed {_MAX_BODY_FLAG} ({self.max_body_bytes} bytes on the "
                                           "wire, chunk framing included)")  # fmt: skip

    def where_it_broke(self) -> str:
        """Why h11 refused the response, by how far it got; never its bytes (h11's messages quote them)."""
        if self.head_bytes is None:
            if self.wire_bytes > MAX_HEAD_BYTES:
                return f"the response head passed {MAX_HEAD_BYTES} bytes"
            if self.closed:
                return f"the target closed the connection after {self.wire_bytes} bytes, before a whole response head"
            return f"the response head is no HTTP/1.1 status line and headers (in its first {self.wire_bytes} bytes)"
        into = self.wire_bytes - self.head_bytes
        if self.closed:
            return f"the target closed the connection {into} bytes into the body, before its end"
        return f"the body's framing breaks HTTP/1.1 (Content-Length or chunked) {into} bytes into the body"


def _check_head(response: h11.Response, max_body_bytes: int) -> None:
    """A 200 of the identity encoding and a ``Content-Length`` within the cap, else a ``ProbeFailed``."""
    if response.status_code != 200:
        raise ProbeFailed("http_status", f"the target answered HTTP {response.status_code}")
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in response.headers}
    if headers.get("content-encoding", "identity").strip().lower() != "identity":
        raise ProbeFailed("not_vllm", "the body is encoded (Content-Encoding is not identity) though identity was "
                                      "asked for: it is not read")  # fmt: skip
    length = headers.get("content-length")
    if length is not None and int(length) > max_body_bytes:
        raise ProbeFailed("too_large", f"Content-Length {length} is over {_MAX_BODY_FLAG} ({max_body_bytes})")
