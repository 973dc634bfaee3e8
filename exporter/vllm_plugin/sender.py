"""The client side of the exporter's ingest API, shared by ``cache-config-exporter push`` and the vLLM plugin.

It knows the API's paths and queries (ready responses, cache configs, heartbeats, goodbyes), the content
type of each wire format and the bearer token, makes a call with a timeout (``send`` on a connection of its
own, ``Connection`` on one kept across calls) and says what came of it:
``Accepted`` with the exporter's JSON answer, ``Refused`` with the status and the problem's ``detail`` and
``field``, or ``Unreachable`` with the reason. A request of several engines' ready responses names each one
it refused (``item_refusals``). What to do next (print, retry, warn) is the caller's.

Imports only the standard library: it runs inside vLLM's frontend.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter import __version__

# Shared by ``push --timeout`` and the plugin's ``CACHE_CONFIG_EXPORTER_TIMEOUT``.
DEFAULT_TIMEOUT_SECONDS = 2.0
CONTENT_TYPES = {"json": "application/json", "msgpack": "application/vnd.msgpack"}
_URL_SEPARATORS = re.compile(r"[\s,]+")
# How much of a refusal's detail a message carries, and how much of its body is read (one problem per engine
# of a batch refused whole).
_DETAIL_LENGTH = 200
_PROBLEM_BYTES = 1 << 16


@dataclass(frozen=True)
class Call:
    """One request of the ingest API: ``path`` is below the exporter's base URL, with its query."""

    method: str
    path: str
    body: bytes | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class Accepted:
    """A 2xx answer; ``state`` is its JSON (the synced deployment for a ready response), ``None`` when empty."""

    state: Any


@dataclass(frozen=True)
class Refused:
    """An HTTP error answer: ``detail`` and ``field`` come from the exporter's problem document; ``items``, for a
    request of several ready responses none of which was taken, each one's refusal by its place in the request."""

    status: int
    detail: str
    field: str | None
    items: dict[int, Refused] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return (
            f"HTTP {self.status}"
            + (f": {self.detail}" if self.detail else "")
            + (f" (field {self.field})" if self.field else "")
        )


@dataclass(frozen=True)
class Unreachable:
    """No answer: refused connection, timeout, TLS or protocol failure, or an answer that is not the API's."""

    reason: str

    def __str__(self) -> str:
        return self.reason


Outcome = Accepted | Refused | Unreachable


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


def send(base_url: str, call: Call, timeout: float, *, authorization: str | None = None, client: str) -> Outcome:
    """Make ``call`` to the exporter at ``base_url`` on a connection of its own, waiting at most ``timeout``
    seconds; never raises. ``client`` (``push``, ``vllm-plugin``) names the sender in the ``User-Agent``."""
    connection = Connection(base_url, timeout, client=client)
    try:
        return connection.send(call, authorization=authorization)
    finally:
        connection.close()


# What a kept connection the exporter has closed meanwhile raises as it is used again, before any answer.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class Connection:
    """Calls to one exporter, one after another, on one kept-alive HTTP/1.1 connection (a plugin thread's).

    A request on a new TCP connection costs the exporter several times one on a kept connection
    (docs/PERFORMANCE.md), and a fleet's heartbeats are most of its requests. When the kept connection turns out
    to be closed by the exporter meanwhile (its keep-alive timeout, a restart, its connection cap) before any
    answer began, the call is made once more on a new connection: every call of the ingest API may be repeated.
    A child process forked meanwhile opens a connection of its own. The exporter is reached directly, never
    through a proxy of the environment (``HTTP_PROXY``).
    """

    def __init__(self, base_url: str, timeout: float, *, client: str) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self._user_agent = f"cache-config-exporter-{client}/{__version__}"
        self._http: http.client.HTTPConnection | None = None
        self._tls: ssl.SSLContext | None = None
        self._prefix = ""
        self._pid = 0  # of the process that opened the kept connection

    def send(self, call: Call, *, authorization: str | None = None) -> Outcome:
        """Make ``call``, waiting at most ``timeout`` seconds for each step; never raises."""
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
                status, answer = self._exchange(call, headers)
            except _STALE as error:
                self.close()
                if reused:
                    continue
                return Unreachable(str(error) or type(error).__name__)
            except (OSError, http.client.HTTPException, ValueError) as error:
                self.close()
                return Unreachable(str(error) or type(error).__name__)
            break
        if not 200 <= status < 300:
            return _refusal(status, answer)
        if not answer:
            return Accepted(None)
        try:
            return Accepted(json.loads(answer))
        except ValueError:
            return Unreachable(f"the answer is not the exporter's JSON: {_excerpt(answer)!r}")

    def _exchange(self, call: Call, headers: dict[str, str]) -> tuple[int, bytes]:
        """One request and its answer's status and body (of a refusal, its first ``_PROBLEM_BYTES``)."""
        if self._http is None:
            self._http = self._open()
        self._http.request(call.method, f"{self._prefix}{call.path}", body=call.body, headers=headers)
        response = self._http.getresponse()
        answer = response.read() if 200 <= response.status < 300 else response.read(_PROBLEM_BYTES)
        if response.will_close or not response.isclosed():  # closing, or an unread rest of a long refusal
            self.close()
        return response.status, answer

    def _open(self) -> http.client.HTTPConnection:
        """A new connection to ``base_url``'s host; the URL's path is the prefix of every call's."""
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unknown url type: {parts.scheme or self.base_url!r}")
        if not parts.hostname:
            raise ValueError(f"no host given: {self.base_url!r}")
        self._prefix = parts.path.rstrip("/")
        self._pid = os.getpid()
        if parts.scheme == "http":
            return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout, context=self._tls)

    def close(self) -> None:
        """Close the kept connection; the next call opens a new one."""
        if self._http is not None:
            self._http.close()
            self._http = None


def _refusal(status: int, body: bytes) -> Refused:
    """The problem document's ``detail``, ``field`` and refused items; any other body is the detail as it is."""
    try:
        problem = json.loads(body)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        return Refused(status, _excerpt(body), None)
    return _problem(status, problem, item_refusals(problem.get("refused")))


def _problem(status: int, problem: dict[str, Any], items: dict[int, Refused]) -> Refused:
    field_name = problem.get("field")
    detail = str(problem.get("detail") or "")[:_DETAIL_LENGTH]
    return Refused(status, detail, str(field_name) if field_name else None, items)


def item_refusals(refused: object) -> dict[int, Refused]:
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
