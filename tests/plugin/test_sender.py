"""The sender that ``push`` and the vLLM plugin share, against a real exporter process on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from exporter.vllm_plugin import sender
from protocol import tokens
from tests.helpers.http import raw_socket, request
from tests.support import ExporterProcess, fixture_bytes, free_port

TIMEOUT = 5.0


def send(exporter: ExporterProcess, call: sender.Call, authorization: str | None = None) -> sender.CallResult:
    return sender.send(exporter.url, call, TIMEOUT, authorization=authorization, client="test")


def held(exporter: ExporterProcess, deployment: str, replica: str) -> dict[str, object] | None:
    """The replica's state as the exporter's JSON API shows it, ``None`` when it holds no such replica."""
    outcome = send(exporter, sender.Call("GET", f"/api/v1/deployments/{deployment}?replica={replica}"))
    return outcome.state if isinstance(outcome, sender.Accepted) else None


def test_a_ready_response_is_accepted_with_the_synced_state(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    call = sender.ready_call(
        "team/qwen", fixture_bytes("hybrid-tp1-post50809"), "msgpack", "gpu-1:8000", heartbeat=30.0
    )
    assert call.path == "/api/v1/deployments/team/qwen/ready?replica=gpu-1%3A8000&heartbeat=30"

    outcome = send(exporter, call)

    assert isinstance(outcome, sender.Accepted)
    assert (outcome.state["deployment"], outcome.state["replica"]) == ("team/qwen", "gpu-1:8000")
    assert (outcome.state["labels"]["block_size"], outcome.state["heartbeat_seconds"]) == ("1056", 30.0)


def test_a_json_response_with_an_engine_index(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    call = sender.ready_call("dense", fixture_bytes("dp2-rank1", "json"), "json", "default", engine=1)
    outcome = send(exporter, call)
    assert isinstance(outcome, sender.Accepted)
    assert [engine["engine"] for engine in outcome.state["engines"]] == [1]


def test_labels_heartbeat_and_goodbye_of_one_replica(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    labels = {"mamba_cache_mode": "align", "block_size": "16"}
    configured = send(exporter, sender.cache_config_call("org/hybrid", labels, "r1", heartbeat=5.0))
    assert isinstance(configured, sender.Accepted)
    assert configured.state["static_labels"]["mamba_cache_mode"] == "align"

    assert send(exporter, sender.heartbeat_call("org/hybrid", "r1", 5.0)) == sender.Accepted(None)
    assert send(exporter, sender.goodbye_call("org/hybrid", "r1")) == sender.Accepted(None)
    assert held(exporter, "org/hybrid", "r1") is None

    forgotten = send(exporter, sender.heartbeat_call("org/hybrid", "r1", 5.0))
    assert isinstance(forgotten, sender.Rejected)
    assert (forgotten.status, forgotten.field) == (404, "replica")


def test_a_refusal_names_the_field_the_exporter_refused(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    outcome = send(exporter, sender.ready_call("qwen", b'{"max_model_len": 0, "num_gpu_blocks": 1}', "json", "r1"))

    assert isinstance(outcome, sender.Rejected)
    assert (outcome.status, outcome.field) == (422, "$.max_model_len")
    assert str(outcome) == f"HTTP 422: {outcome.detail} (field $.max_model_len)"
    assert outcome.detail
    assert held(exporter, "qwen", "r1") is None


def test_a_port_nobody_listens_on_is_unreachable() -> None:
    outcome = sender.send(f"http://127.0.0.1:{free_port()}", sender.goodbye_call("qwen", "r1"), TIMEOUT, client="test")
    assert isinstance(outcome, sender.Unreachable)
    assert "Connection refused" in str(outcome)


def test_the_ingest_token_from_a_file(start_exporter: Callable[..., ExporterProcess], tmp_path: Path) -> None:
    token_file = tmp_path / "ingest.token"
    token_file.write_text("  s3cr3t-ingest  \n")
    exporter = start_exporter("--web.ingest-token-file", str(token_file))
    call = sender.ready_call("qwen", fixture_bytes("hybrid-tp1-post50809"), "msgpack", "r1")

    without = send(exporter, call)
    assert isinstance(without, sender.Rejected)
    assert (without.status, without.field) == (401, "Authorization")

    token = tokens.read_token(token_file)
    assert token == "s3cr3t-ingest"
    assert isinstance(send(exporter, call, tokens.bearer(token)), sender.Accepted)


def test_tokens_that_cannot_be_read_or_sent(tmp_path: Path) -> None:
    with pytest.raises(tokens.TokenError, match="No such file"):
        tokens.read_token(tmp_path / "missing")
    with pytest.raises(tokens.TokenError, match="cannot have"):
        tokens.bearer("two words")
    (tmp_path / "empty").write_text("\n")
    assert tokens.read_token(tmp_path / "empty") == ""


class _Proxy(BaseHTTPRequestHandler):
    """A reverse proxy in front of the exporter that answers on its own: what it says is not the exporter's."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = (502, b"Bad Gateway\n") if "/ready?" in self.path else (200, b"<html>sign in</html>")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def proxy() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_answers_that_are_not_the_exporters(proxy: str) -> None:
    refused = sender.send(proxy, sender.ready_call("qwen", b"{}", "json", "r1"), TIMEOUT, client="test")
    assert refused == sender.Rejected(502, "Bad Gateway", None)

    not_json = sender.send(proxy, sender.heartbeat_call("qwen", "r1", 30.0), TIMEOUT, client="test")
    assert isinstance(not_json, sender.Unreachable)
    assert "not the exporter's JSON" in str(not_json)


def test_a_list_of_urls_is_split_on_commas_and_spaces() -> None:
    assert sender.split_urls(" http://a:1/, http://b:2  http://c:3//,") == ["http://a:1", "http://b:2", "http://c:3"]
    assert sender.split_urls("  ") == []


def test_cache_config_labels_travel_as_json() -> None:
    call = sender.cache_config_call("qwen", {"block_size": "16"}, "r1")
    assert (call.method, call.content_type, json.loads(call.body or b"")) == (
        "PUT",
        "application/json",
        {"block_size": "16"},
    )


class _KeptAlive(BaseHTTPRequestHandler):
    """An HTTP/1.1 server that records which client connection each request came on; with ``drop``, it closes
    every connection after its answer without saying so, as an exporter whose keep-alive timeout ran out does."""

    protocol_version = "HTTP/1.1"
    server: _Recording

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.peers.append((self.client_address, self.path))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.close_connection = self.server.drop


class _Recording(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, drop: bool) -> None:
        super().__init__(("127.0.0.1", 0), _KeptAlive)
        self.drop = drop
        self.peers: list[tuple[object, str]] = []


@pytest.fixture
def recording() -> Iterator[Callable[[bool], _Recording]]:
    servers: list[_Recording] = []

    def start(drop: bool) -> _Recording:
        server = _Recording(drop)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "closed-by-the-server-between-calls"])
def test_a_connection_keeps_one_tcp_connection_and_reconnects_when_the_server_closed_it(
    recording: Callable[[bool], _Recording], drop: bool
) -> None:
    server = recording(drop)
    connection = sender.Connection(f"http://127.0.0.1:{server.server_address[1]}/behind/a/prefix/", TIMEOUT,
                                   client="test")  # fmt: skip
    try:
        outcomes = [connection.send(sender.heartbeat_call("qwen", f"r{i}", 30.0)) for i in range(3)]
    finally:
        connection.close()
    assert outcomes == [sender.Accepted(None)] * 3
    assert [path.split("?")[0] for _, path in server.peers] == [
        "/behind/a/prefix/api/v1/deployments/qwen/heartbeat"
    ] * 3
    # Each call that found its connection closed was made once more, on a new one: three requests arrived in all.
    assert len({peer for peer, _ in server.peers}) == (3 if drop else 1)


def test_a_connection_to_a_url_it_cannot_use_is_unreachable() -> None:
    for url, reason in (("ftp://127.0.0.1:1", "unknown url type"), ("http://", "no host given")):
        outcome = sender.Connection(url, TIMEOUT, client="test").send(sender.goodbye_call("qwen", "r1"))
        assert isinstance(outcome, sender.Unreachable) and reason in str(outcome), outcome


def test_a_new_connection_at_the_cap_closes_an_idle_kept_one_instead_of_being_refused(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    """Servers of a fleet keep a connection each between heartbeats; a scrape past the cap still gets in."""
    exporter = start_exporter("--web.max-connections", "3")
    assert isinstance(send(exporter, sender.ready_call("qwen", fixture_bytes("hybrid-tp1-post50809"), "msgpack",
                                                       "r1")), sender.Accepted)  # fmt: skip
    kept = [sender.Connection(exporter.url, TIMEOUT, client="test") for _ in range(2)]
    heartbeat = sender.heartbeat_call("qwen", "r1", 30.0)
    try:
        assert [connection.send(heartbeat) for connection in kept] == [sender.Accepted(None)] * 2
        # Two kept connections idle: the third connection is at uvicorn's cap (it counts itself).
        scrape = request(exporter.url, "GET", "/metrics")
        assert scrape.status == 200 and b'deployment="qwen"' in scrape.body
        # The kept connection that was closed for it reconnects on its next call.
        assert [connection.send(heartbeat) for connection in kept] == [sender.Accepted(None)] * 2
    finally:
        for connection in kept:
            connection.close()


def test_the_exporter_closes_a_connection_idle_past_its_keep_alive_timeout(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter("--web.keep-alive-timeout", "0.5")
    connection = raw_socket(exporter.url, timeout=3)  # uvicorn's own default keep-alive timeout is 5 s
    answer = b""
    try:
        connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        while chunk := connection.recv(65536):  # a TimeoutError here: the idle connection was kept
            answer += chunk
    finally:
        connection.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1
