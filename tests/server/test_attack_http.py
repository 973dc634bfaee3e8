"""Attacks by plain HTTP requests: hostile Accept headers, HEAD, refusals the counter must see, foreign Host names."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, raw_socket, read_until_closed, request
from tests.helpers.ready_responses import ready_response
from tests.support import ExporterProcess, wait_until

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
READY = "/api/v1/deployments/attack/ready"
REJECTED = "cache_config_exporter_ready_responses_rejected_total"
# Every reason the README documents, each a series from start-up on.
REASONS = {
    "malformed", "invalid", "invalid_request", "conflict", "limit", "unauthorized", "unsupported_media_type",
    "storage_unavailable", "too_large", "timeout", "client_disconnected", "host",
}  # fmt: skip


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [
        ("application/openmetrics-text; version=abc", TEXT),
        ("application/openmetrics-text; version=1.x", TEXT),
        ("application/openmetrics-text; version=1.0.0-rc1", TEXT),
        ("text/plain;version=abc", TEXT),
        ("application/openmetrics-text; version=2.0.0", TEXT),
        ("text/plain; version=1.0.0", TEXT),
        ("application/openmetrics-text;version=2.0.0,application/openmetrics-text;version=1.0.0;q=0.5", OPENMETRICS),
        ("application/openmetrics-text; version=1.0.0; q=0, text/plain", TEXT),
        ("application/openmetrics-text", OPENMETRICS),
        ("application/openmetrics-text; version=1.0.0", OPENMETRICS),
        (";;;,,=;q=x, */*;q=abc", TEXT),
    ],
)
def test_any_accept_header_gets_a_format_the_exporter_really_renders(
    exporter: ExporterProcess, accept: str, content_type: str
) -> None:
    reply = request(exporter.url, "GET", "/metrics", headers={"Accept": accept})
    assert reply.status == 200, reply.body[:300]
    assert reply.headers["content-type"] == content_type
    assert reply.body.endswith(b"# EOF\n") == (content_type == OPENMETRICS)


@pytest.mark.parametrize("path", ["/metrics", "/-/healthy", "/-/ready", "/", "/api/v1/deployments",
                                  "/api/v1/deployments/attack"])  # fmt: skip
def test_head_works_wherever_get_does(exporter: ExporterProcess, path: str) -> None:
    get = request(exporter.url, "GET", path)
    head = request(exporter.url, "HEAD", path)
    assert (head.status, head.body) == (200, b""), head
    assert head.headers["content-type"] == get.headers["content-type"]


def rejections(exporter: ExporterProcess) -> dict[str, float]:
    exposition = request(exporter.url, "GET", "/metrics").body.decode()
    return {sample.labels["reason"]: sample.value for sample in samples(exposition, REJECTED)}


def test_every_refused_ingest_is_counted_once_under_a_documented_reason(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter(env={**os.environ, "CACHE_CONFIG_EXPORTER_WEB_READ_TIMEOUT": "1"})
    assert rejections(exporter) == dict.fromkeys(REASONS, 0.0)
    head = "POST " + READY + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.msgpack\r\n"
    attacks: list[tuple[str, Callable[[], object]]] = []

    def raw(request: bytes) -> Callable[[], bytes]:
        def send() -> bytes:
            with raw_socket(exporter.url) as connection:
                connection.sendall(request)
                return read_until_closed(connection)

        return send

    def disconnect() -> None:
        with raw_socket(exporter.url) as connection:
            connection.sendall(f"{head}Content-Length: 1000\r\n\r\n".encode() + b"\x80" * 10)

    chunk = b"ffff\r\n" + b"a" * 0xFFFF + b"\r\n"
    foreign_host = {**MSGPACK, "Host": "attacker.example"}
    attacks += [
        ("too_large", raw(f"{head}Content-Length: 70000\r\n\r\n".encode())),
        ("too_large", raw(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunk * 2)),
        ("timeout", raw(f"{head}Content-Length: 100\r\n\r\n".encode())),
        ("client_disconnected", disconnect),
        ("invalid_request", lambda: request(exporter.url, "POST", READY + "?engine=abc", b"", MSGPACK)),
        ("malformed", lambda: request(exporter.url, "POST", READY, b"\xc1", MSGPACK)),
        ("unsupported_media_type", lambda: request(exporter.url, "POST", READY, b"{}", {"Content-Type": "text/x"})),
        ("host", lambda: request(exporter.url, "POST", READY, ready_response(0, 1, 1), foreign_host)),
    ]
    expected = dict.fromkeys(REASONS, 0.0)
    for reason, attack in attacks:
        attack()
        expected[reason] += 1
        wait_until(lambda: rejections(exporter) == expected, timeout=5)
    assert request(exporter.url, "POST", READY, ready_response(0, 1, 1), MSGPACK).status == 200
    assert rejections(exporter) == expected
    log = exporter.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    record(record_property, "attack_rejection_counter", refusals=len(attacks), counted=sum(expected.values()))


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.attacker.example",
                                  "localhost.attacker.example:{port}"])  # fmt: skip
def test_a_foreign_host_name_is_refused_on_a_loopback_listener(exporter: ExporterProcess, host: str) -> None:
    headers = {"Host": host.format(port=exporter.port)}
    for method, path, body in (("GET", "/metrics", None), ("GET", "/api/v1/deployments", None),
                               ("POST", READY, ready_response(0, 1, 1))):  # fmt: skip
        problem = request(exporter.url, method, path, body, {**MSGPACK, **headers}).problem(421)
        assert problem["field"] == "Host"
    assert [deployment["deployment"] for deployment in request(exporter.url, "GET", "/api/v1/deployments").json()] == [
        "attack"
    ]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "127.0.0.2"])
def test_loopback_host_names_are_served(exporter: ExporterProcess, host: str) -> None:
    reply = request(exporter.url, "GET", "/metrics", headers={"Host": host.format(port=exporter.port)})
    assert reply.status == 200


def test_allowed_hosts_come_from_a_flag(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter(env={**os.environ, "CACHE_CONFIG_EXPORTER_WEB_ALLOWED_HOSTS": "exporter.internal"})
    assert request(exporter.url, "GET", "/metrics", headers={"Host": "exporter.internal:80"}).status == 200
    assert request(exporter.url, "GET", "/metrics", headers={"Host": "attacker.example"}).status == 421
    assert request(exporter.url, "GET", "/metrics").status == 200  # loopback names stay allowed


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExporterProcess]:
    """One exporter for the tests that change nothing, with the deployment ``attack``."""
    process = ExporterProcess(tmp_path_factory.mktemp("attack") / "exporter.db").start()
    assert request(process.url, "POST", READY, ready_response(0, 1, 1), MSGPACK).status == 200
    yield process
    process.stop()
