"""Every call of the plugin is bounded by whatever answers at its URL: one deadline for the whole exchange and at most
``sender.ANSWER_BYTES`` of the answer read, against stand-in servers on loopback (tests/plugin/standins.py).

The bounds themselves are checked with a made-up clock; the stand-ins show them holding over real sockets, with
the memory the call took (tracemalloc's peak in a process of its own) and the time it held its caller.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporter.vllm_plugin import sender
from tests.helpers.figures import record
from tests.helpers.tls import make_certificate
from tests.plugin import standins
from tests.plugin.standins import StandIn
from tests.support import wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
TIMEOUT = 1.0
# What a loaded 2-core machine may add to a deadline before the call returns.
SLACK_SECONDS = 0.5
HEARTBEAT = sender.heartbeat_call("org/m", "r1", 30.0)


def plugin_call(url: str) -> sender.CallResult:
    """One call as the plugin makes it: reading at most ``ANSWER_BYTES``."""
    return sender.send(url, HEARTBEAT, TIMEOUT, client="test", answer_bytes=sender.ANSWER_BYTES)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_deadline_for_the_whole_exchange() -> None:
    clock = FakeClock()
    exchange = sender.Exchange(2.0, clock)
    assert exchange.remaining() == 2.0
    clock.now += 1.5  # connecting and sending took 1.5 s: reading gets what is left, not a timeout of its own
    assert exchange.remaining() == 0.5
    clock.now += 0.5
    with pytest.raises(TimeoutError, match="no whole answer within 2 s"):
        exchange.remaining()


def test_the_answer_is_read_up_to_the_cap_and_one_byte_past_it_tells_it_goes_on() -> None:
    exchange = sender.Exchange(2.0, FakeClock())
    assert exchange.allowance(65536) == sender.ANSWER_BYTES
    exchange.read(sender.ANSWER_BYTES - 1)
    assert exchange.allowance(65536) == 1
    exchange.read(1)  # at the cap: the next read may still find the end of the answer
    assert exchange.allowance(65536) == 1
    with pytest.raises(sender.AnswerTooLong, match=f"longer than {sender.ANSWER_BYTES} bytes"):
        exchange.read(1)


def padded_answer(total: int) -> Callable[[StandIn, Any], bool]:
    """A 200 whose whole answer (status line, headers, JSON body padded with spaces) is ``total`` bytes, its end
    the end of the connection (no length)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    body = b'{"taken": true}'

    def behaviour(server: StandIn, connection: Any) -> bool:
        server.write(connection, head + body.ljust(total - len(head)))
        connection.close()
        return False

    return behaviour


def test_an_answer_of_exactly_the_cap_is_read_and_one_byte_more_is_not(stand_in: Callable[..., StandIn]) -> None:
    at_cap = stand_in(padded_answer(sender.ANSWER_BYTES))
    assert plugin_call(at_cap.url) == sender.Accepted({"taken": True})

    past_cap = stand_in(padded_answer(sender.ANSWER_BYTES + 1))
    outcome = plugin_call(past_cap.url)
    assert outcome == sender.Unreachable(f"the answer is longer than {sender.ANSWER_BYTES} bytes")


def test_push_reads_the_state_of_a_replica_of_many_engines(stand_in: Callable[..., StandIn]) -> None:
    """``push`` prints the replica's synced state, longer than the plugin's cap for a replica of many engines."""
    state = b'{"engines": [' + b",".join([b'{"engine": 1}'] * 10_000) + b"]}"
    server = stand_in(lambda server, connection: server.write(connection, standins.answer("200 OK", state)) or True)
    outcome = sender.send(server.url, HEARTBEAT, TIMEOUT, client="test")
    assert len(state) > sender.ANSWER_BYTES
    assert isinstance(outcome, sender.Accepted) and len(outcome.state["engines"]) == 10_000


def announced(status: str, content_type: str, length: int) -> Callable[[StandIn, Any], bool]:
    """An answer that announces ``length`` bytes of ``content_type`` and sends its head alone."""

    def behaviour(server: StandIn, connection: Any) -> bool:
        server.write(connection, f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}"
                                 "\r\n\r\n".encode())  # fmt: skip
        return False

    return behaviour


def test_the_exporters_long_json_answer_is_an_acceptance_left_unread(stand_in: Callable[..., StandIn]) -> None:
    """The exporter answers a ready response with the replica's whole state (about 1.1 KB an engine): of a
    replica of many engines longer than the cap. Its 2xx says the exporter took it; the state is not needed."""
    exporter = stand_in(announced("200 OK", "application/json", sender.ANSWER_BYTES + 1))
    started = time.monotonic()
    outcome = plugin_call(exporter.url)
    assert outcome == sender.Accepted(None, unread=True)
    # Not waited for: the body is never read.
    assert time.monotonic() - started < TIMEOUT
    # The connection, whose rest is unread, is closed.
    wait_until(lambda: exporter.open_connections == 0, timeout=5)

    other = stand_in(announced("200 OK", "text/html", sender.ANSWER_BYTES + 1))
    assert isinstance(plugin_call(other.url), sender.Unreachable)


def test_a_long_refusal_is_taken_by_its_status_with_its_first_bytes(stand_in: Callable[..., StandIn]) -> None:
    def long_refusal(server: StandIn, connection: Any) -> bool:
        server.write(connection, b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 52428800\r\n\r\n")
        server.write(connection, b"busy " * 10_000)
        return False

    server = stand_in(long_refusal)
    outcome = plugin_call(server.url)
    assert isinstance(outcome, sender.Rejected) and outcome.status == 503
    assert outcome.detail.startswith("busy busy")
    wait_until(lambda: server.open_connections == 0, timeout=5)


# A call in a process of its own, so that its memory is the call's alone: after one to a well-behaved server (what
# the first call of a process loads and caches), its outcome, the seconds it held its caller and tracemalloc's
# peak, as JSON; then it waits for its standard input to close before it exits.
CALL = """
import json, sys, time, tracemalloc
from exporter.vllm_plugin import sender
call = sender.heartbeat_call("org/m", "r1", 30.0)
assert isinstance(sender.send(sys.argv[3], call, 10.0, client="test"), sender.Accepted)
connection = sender.Connection(sys.argv[1], float(sys.argv[2]), client="test")
tracemalloc.start()
started = time.monotonic()
outcome = connection.send(call)
held = time.monotonic() - started
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"unreachable": isinstance(outcome, sender.Unreachable), "outcome": str(outcome), "held": held,
                  "peak": peak}), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow  # a process each, and most wait out the timeout
@pytest.mark.parametrize("name", list(standins.HOSTILE))
def test_whatever_the_server_sends_or_withholds_a_call_takes_its_timeout_and_the_cap_at_most(
    name: str, stand_in: Callable[..., StandIn], record_property: Callable[[str, object], None]
) -> None:
    """endless: a 200 without end (the cap ends it); trickle: 64 bytes every 20 ms (the deadline ends it, though
    each read gets bytes in time); blackhole: never answers; slow-error: a 500 after 5 s."""
    server, warm_up = stand_in(standins.HOSTILE[name]), stand_in()
    child = subprocess.Popen(
        [sys.executable, "-c", CALL, server.url, str(TIMEOUT), warm_up.url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPOSITORY,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        result = json.loads(child.stdout.readline())
        # Given up on: the connection is closed (while the process still runs), an outage for the caller.
        wait_until(lambda: server.open_connections == 0, timeout=5)
    finally:
        child.communicate(timeout=30)
    record(record_property, f"plugin call against {name}", held_seconds=round(result["held"], 3),
           peak_bytes=result["peak"], answer_bytes_sent=server.sent)  # fmt: skip
    assert result["unreachable"], result["outcome"]
    assert ("longer than" if name == "endless" else "timed out") in result["outcome"]
    assert result["held"] < TIMEOUT + SLACK_SECONDS
    if name != "endless":
        assert result["held"] >= TIMEOUT * 0.9
    # The call's memory: the cap and the reader's buffer, not what the server sent (megabytes when endless).
    assert result["peak"] < 4 * sender.ANSWER_BYTES


def test_the_deadline_covers_a_kept_connection_found_closed_and_the_call_made_again(
    stand_in: Callable[..., StandIn],
) -> None:
    """The call repeated on a new connection after a stale one gets what is left of the same deadline."""

    def answers_once_then_hangs(server: StandIn, connection: Any) -> bool:
        if len(server.requests()) == 1:
            standins.ok(server, connection)
        connection.shutdown(2)  # closed without a word, as at an exporter's keep-alive timeout
        server.behaviour = standins.blackhole
        return False

    server = stand_in(answers_once_then_hangs)
    connection = sender.Connection(server.url, TIMEOUT, client="test")
    try:
        assert connection.send(HEARTBEAT) == sender.Accepted({})
        wait_until(lambda: server.open_connections == 0, timeout=5)
        started = time.monotonic()
        outcome = connection.send(HEARTBEAT)
        held = time.monotonic() - started
    finally:
        connection.close()
    assert isinstance(outcome, sender.Unreachable) and "timed out" in str(outcome)
    assert server.accepted == 2
    assert held < TIMEOUT + SLACK_SECONDS


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("3600", 600.0), ("2", 2.0), ("soon", None)],
    ids=["an-hour-cut-to-the-ceiling", "seconds", "unreadable"],
)
def test_a_refusal_carries_the_wait_its_retry_after_asks_for(
    stand_in: Callable[..., StandIn], value: str, seconds: float | None
) -> None:
    server = stand_in(standins.retry_after(value))
    outcome = plugin_call(server.url)
    assert isinstance(outcome, sender.Rejected)
    assert (outcome.status, outcome.retry_after) == (429, seconds)
    if seconds is not None:
        assert str(outcome) == f"HTTP 429 (Retry-After: {seconds:g} s)"


def test_over_tls_a_call_is_answered_and_a_handshake_never_answered_ends_at_the_deadline(
    stand_in: Callable[..., StandIn], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = make_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # what the plugin's default context trusts, as in production
    assert plugin_call(stand_in(tls=context).url) == sender.Accepted({})

    # A blackhole at an https URL: the TLS handshake is never answered.
    url = stand_in(standins.blackhole).url.replace("http://", "https://")
    started = time.monotonic()
    outcome = plugin_call(url)
    held = time.monotonic() - started
    assert isinstance(outcome, sender.Unreachable) and "timed out" in str(outcome)
    assert held < TIMEOUT + SLACK_SECONDS
