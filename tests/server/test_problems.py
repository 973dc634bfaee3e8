"""The one table from refusals to HTTP statuses (exporter/server/problems.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    StorageUnavailable,
    UnknownReplica,
    UnsupportedMediaType,
)
from exporter.probe.prober import TooManyProbes
from exporter.server.problems import problem_for
from protocol import InvalidPayload, MalformedPayload, SyncConflict


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (MalformedPayload("$", "not msgpack"), 400, "malformed"),
        (InvalidPayload("$.block_size", "Expected `int`"), 422, "invalid"),
        (SyncConflict("$.dp_stats_address", "engines disagree"), 409, "conflict"),
        (InvalidRequest("query.engine", "Expected `int`"), 422, "invalid_request"),
        (UnsupportedMediaType("Content-Type", "not msgpack or JSON"), 415, "unsupported_media_type"),
        (UnknownReplica("replica", "no replica"), 404, "not_found"),
        (LimitExceeded("engine", "at its limit"), 429, "limit"),
        (Forbidden("query.target", "not in --probe.allowed-targets"), 403, "forbidden"),
        (HostNotServed("Host", "not served"), 421, "host"),
        (BodyTooLarge("body", "over the cap"), 413, "too_large"),
        (BodyTimeout("body", "too slow"), 408, "timeout"),
        (ClientDisconnected("body", "gone"), 400, "client_disconnected"),
        (HeadersTooLarge("headers", "over the cap"), 431, "header_too_large"),
        (HeaderTimeout("headers", "too slow"), 408, "header_timeout"),
        (TooManyProbes("target", "16 probes are running"), 503, "probes_busy"),
    ],
)
def test_each_refusal_has_its_status_and_names_the_field(error: Exception, status: int, reason: str) -> None:
    problem = problem_for(error)
    assert (problem.status, problem.reason) == (status, reason)
    assert problem.field == error.field  # type: ignore[attr-defined]
    assert problem.detail == error.reason  # type: ignore[attr-defined]


def test_a_failing_store_says_when_to_retry() -> None:
    problem = problem_for(StorageUnavailable("database or disk is full"))
    assert (problem.status, problem.reason, problem.headers) == (503, "storage_unavailable", {"Retry-After": "1"})
    assert "database or disk is full" in problem.detail and "nothing was changed" in problem.detail


def test_problems_of_one_kind_never_share_headers() -> None:
    """A problem's headers are its own: answering one never changes the next."""
    first, second = problem_for(StorageUnavailable("a")), problem_for(StorageUnavailable("b"))
    first.headers["Connection"] = "close"
    assert second.headers == {"Retry-After": "1"}


@pytest.mark.parametrize("error", [BodyTooLarge, BodyTimeout, HeadersTooLarge, HeaderTimeout])
def test_a_refusal_that_leaves_the_request_unread_closes_the_connection(error: type[Exception]) -> None:
    assert problem_for(error("body", "unread")).headers == {"Connection": "close"}


def test_no_module_but_the_table_gives_a_refusal_its_status() -> None:
    """README: every refusal's HTTP status in one table. A status written elsewhere would escape it."""
    by_hand = re.compile(r"Problem\(\s*\d{3}|STATUS_LINE\[\s*\d{3}|Refusal\(\s*\d{3}")
    exporter = Path(__file__).resolve().parents[2] / "exporter"
    found = {
        path.name: by_hand.findall(path.read_text())
        for path in sorted(exporter.rglob("*.py"))
        if path.name != "problems.py" and by_hand.search(path.read_text())
    }
    assert found == {}
