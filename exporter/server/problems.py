"""RFC 9457 problem details, and the one table that gives each refusal its HTTP status.

Every refusal the exporter answers is a ``Problem``: built from an error of the
layers below by ``problem_for`` (the table), or directly by the HTTP layer
(limits on headers and bodies, access). ``reason`` is also the label of the
rejection counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from exporter.errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    Forbidden,
    HeadersTooLarge,
    HeaderTimeout,
    HostNotServed,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    Refused,
    StorageUnavailable,
    TooManyConnections,
    UnsupportedMediaType,
)
from exporter.probe.prober import TooManyProbes
from exporter.security.auth import Unauthorized
from exporter.security.bcrypt_checks import AuthenticationBusy
from protocol import InvalidPayload, MalformedPayload, SyncConflict

PROBLEM_JSON = "application/problem+json"
_json = msgspec.json.Encoder()


class Problem(Exception):
    """An error answered as ``application/problem+json``; never changed once built."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        field: str | None = None,
        reason: str = "invalid",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.field = field
        self.reason = reason
        self.headers = dict(headers or {})


class Refusal(NamedTuple):
    status: int
    title: str
    reason: str
    headers: Mapping[str, str] = {}


# The rest of the request is never read, so the connection ends.
_CLOSE = {"Connection": "close"}
# The most specific class of an error decides (its method resolution order is walked).
REFUSALS: dict[type[Exception], Refusal] = {
    HeadersTooLarge: Refusal(431, "Request header fields too large", "header_too_large", _CLOSE),
    HeaderTimeout: Refusal(408, "Request timeout", "header_timeout", _CLOSE),
    HostNotServed: Refusal(421, "Misdirected request", "host"),
    BodyTooLarge: Refusal(413, "Request body too large", "too_large", _CLOSE),
    BodyTimeout: Refusal(408, "Request timeout", "timeout", _CLOSE),
    ClientDisconnected: Refusal(400, "Client disconnected", "client_disconnected"),
    TooManyConnections: Refusal(503, "Too many connections", "connections", {**_CLOSE, "Retry-After": "1"}),
    MalformedPayload: Refusal(400, "Malformed payload", "malformed"),
    SyncConflict: Refusal(409, "Conflicting engines", "conflict"),
    InvalidPayload: Refusal(422, "Invalid payload", "invalid"),
    InvalidRequest: Refusal(422, "Invalid request", "invalid_request"),
    UnsupportedMediaType: Refusal(415, "Unsupported media type", "unsupported_media_type"),
    NotFound: Refusal(404, "Not found", "not_found"),
    Forbidden: Refusal(403, "Forbidden", "forbidden"),
    LimitExceeded: Refusal(429, "Limit reached", "limit"),
    StorageUnavailable: Refusal(503, "Storage unavailable", "storage_unavailable", {"Retry-After": "1"}),
    Unauthorized: Refusal(401, "Unauthorized", "unauthorized"),
    AuthenticationBusy: Refusal(503, "Authentication busy", "auth_busy", {"Retry-After": "1"}),
    TooManyProbes: Refusal(503, "Too many probes", "probes_busy", {"Retry-After": "1"}),
}


def problem_for(error: Exception) -> Problem:
    """The problem an error of the protocol, the limits, the state or the store stands for."""
    if isinstance(error, HTTPException):  # Starlette's own: an unknown route, a method not allowed
        detail = str(error.detail)
        return Problem(error.status_code, detail, detail, reason="http", headers=error.headers)
    refusal = next(REFUSALS[kind] for kind in type(error).__mro__ if kind in REFUSALS)
    if isinstance(error, InvalidPayload | Refused):
        detail, field = error.reason, error.field
    else:
        detail, field = f"nothing was changed: {error}", None
    # A refusal may carry headers of its own (a 401's challenge) over those of its row.
    headers = {**refusal.headers, **getattr(error, "headers", {})}
    return Problem(refusal.status, refusal.title, detail, field, refusal.reason, headers)


def problem_document(problem: Problem, instance: str | None = None) -> bytes:
    """The RFC 9457 document of a problem; ``instance`` is the request's path, when there is a request."""
    body: dict[str, object] = {
        "type": f"urn:cache-config-exporter:problem:{problem.reason}",
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
    }
    if instance is not None:
        body["instance"] = instance
    if problem.field is not None:
        body["field"] = problem.field
    return _json.encode(body)


def problem_response(request: Request, problem: Problem) -> Response:
    return Response(problem_document(problem, request.url.path), problem.status, problem.headers, PROBLEM_JSON)
