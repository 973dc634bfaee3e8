"""Limits: request body size, read timeout, cardinality caps, label-value lengths, stalled clients."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from starlette.testclient import TestClient

from tests.helpers.exposition import cache_config_samples
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, Reply, raw_socket, read_until_closed, request
from tests.helpers.ready_responses import ready_response
from tests.helpers.sqlite_file import read_only, rows
from tests.support import ExporterProcess, fixture_bytes

READY = "/api/v1/deployments/limits/ready"


def head(path: str, *headers: str) -> bytes:
    """The request line and headers of a ready-response POST, with ``headers`` added."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/vnd.msgpack", *headers, "", ""]
    return "\r\n".join(lines).encode()


def test_a_content_length_over_the_cap_is_refused_before_any_body_arrives(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()  # the default cap, 64 KiB
    with raw_socket(exporter.url, timeout=2) as connection:
        started = time.monotonic()
        connection.sendall(head(READY, "Content-Length: 10000000"))  # and not one byte of the body
        answer = read_until_closed(connection)
        seconds = time.monotonic() - started
    reply = Reply.parse(answer)
    problem = reply.problem(413)
    assert problem["field"] == "body" and "65536" in problem["detail"]
    assert reply.headers["connection"] == "close"
    assert seconds < 1.5, f"the 413 took {seconds:.2f} s: the server waited for the body"
    assert request(exporter.url, "GET", "/-/healthy").status == 200
    record(record_property, "limits_content_length", declared_bytes=10_000_000, body_bytes_sent=0,
           answer_seconds=round(seconds, 3))  # fmt: skip


def chunked(data: bytes, size: int = 8192) -> bytes:
    """``data`` in HTTP/1.1 chunks of ``size`` bytes, without the final empty chunk."""
    return b"".join(
        b"%x\r\n%s\r\n" % (len(data[at : at + size]), data[at : at + size]) for at in range(0, len(data), size)
    )


def test_a_chunked_body_over_the_cap_is_refused_without_reading_it_all(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter("--web.max-request-bytes", "4096")
    with raw_socket(exporter.url, timeout=2) as connection:
        connection.sendall(head(READY, "Transfer-Encoding: chunked") + chunked(b"\x00" * 6000))  # no final chunk
        reply = Reply.parse(read_until_closed(connection))
    assert reply.problem(413)["field"] == "body"
    assert reply.headers["connection"] == "close"
    with raw_socket(exporter.url, timeout=5) as connection:  # under the cap, chunked is fine
        body = ready_response(0, 77, 1)
        connection.sendall(
            head(READY, "Transfer-Encoding: chunked", "Connection: close") + chunked(body, 100) + b"0\r\n\r\n"
        )
        assert Reply.parse(read_until_closed(connection)).status == 200


def test_the_body_cap_and_cardinality_caps_come_from_flags_and_environment(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter("--web.max-request-bytes", "1024", env={"CACHE_CONFIG_EXPORTER_LIMITS_DEPLOYMENTS": "1",
                              "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert request(exporter.url, "POST", READY, ready_response(0, 1, 1), MSGPACK).status == 200
    request(exporter.url, "POST", READY, ready_response(0, 1, 1) + b"\0" * 1024, MSGPACK).problem(413)
    other = request(exporter.url, "POST", "/api/v1/deployments/other/ready", ready_response(0, 1, 1), MSGPACK)
    assert other.problem(429)["field"] == "deployment"


def snapshot(client: TestClient, storage: Path) -> tuple[list, bytes, tuple]:
    """What must not change when a request is refused: the series, the JSON state, the stored rows."""
    db = read_only(storage)
    try:
        return cache_config_samples(client.get("/metrics").text), client.get("/api/v1/deployments").content, rows(db)
    finally:
        db.close()


def post(client: TestClient, deployment: str, engine: int, engines: int = 2) -> Reply:
    body = ready_response(engine, 10 + engine, engines)
    return Reply.of(client.post(f"/api/v1/deployments/{deployment}/ready", content=body, headers=MSGPACK))


def test_cardinality_caps_are_429_and_leave_existing_series_intact(
    make_client: Callable[..., TestClient], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    client = make_client(max_deployments=3, max_engines_per_replica=2)
    for deployment in ("a", "b", "c"):
        for engine in (0, 1):
            assert post(client, deployment, engine).status == 200
    before = snapshot(client, tmp_path / "exporter.db")
    refused = [
        (post(client, "d", 0), "deployment"),
        (post(client, "a", 2, engines=4), "engine"),
        (Reply.of(client.put("/api/v1/deployments/e/cache-config", json={"mamba_cache_mode": "align"})), "deployment"),
    ]
    for reply, field in refused:
        problem = reply.problem(429)
        assert problem["field"] == field and "limit" in problem["detail"]
    assert snapshot(client, tmp_path / "exporter.db") == before
    assert post(client, "a", 1).status == 200  # an engine already there may report again
    assert client.delete("/api/v1/deployments/c").status_code == 204
    assert post(client, "d", 0).status == 200  # room again
    record(record_property, "limits_cardinality", refused_429=len(refused), existing_series=len(before[0]))


TOO_LONG = "x" * 257
# A label value: what vLLM renders for one CacheConfig field (a list of layer names can be long).
LABEL_TOO_LONG = "x" * 4097


@pytest.mark.parametrize(
    ("what", "method", "body", "field"),
    [
        ("static label value", "PUT", {"cache_dtype": LABEL_TOO_LONG}, "$.cache_dtype"),
        ("static list label", "PUT", {"kv_cache_dtype_skip_layers": ["layer"] * 1000}, "$.kv_cache_dtype_skip_layers"),
        ("static labels", "PUT", {f"label_{index}": "x" for index in range(129)}, "$"),
        ("response string", "POST", {"dtype": TOO_LONG}, "$.dtype"),
        ("instance id", "POST", {"instance_id": TOO_LONG}, "$.instance_id"),
        ("stats address", "POST", {"dp_stats_address": TOO_LONG}, "$.dp_stats_address"),
    ],
)
def test_over_long_values_are_422_and_change_nothing(
    client: TestClient, tmp_path: Path, what: str, method: str, body: dict, field: str
) -> None:
    assert post(client, "limits", 0).status == 200
    before = snapshot(client, tmp_path / "exporter.db")
    if method == "PUT":
        response = client.put("/api/v1/deployments/limits/cache-config", json=body)
    else:
        document = dict(msgspec.msgpack.decode(ready_response(0, 10, 2)), **body)
        response = client.post(READY, content=msgspec.msgpack.encode(document), headers=MSGPACK)
    Reply.of(response).problem(422)
    assert response.json()["field"] == field, (what, response.json())
    assert snapshot(client, tmp_path / "exporter.db") == before


def test_the_longest_allowed_values_are_accepted(client: TestClient) -> None:
    assert client.put("/api/v1/deployments/limits/cache-config", json={"cache_dtype": "x" * 4096}).status_code == 200
    name = "n" * 200
    assert post(client, name, 0).status == 200
    assert post(client, name + "n", 0).status == 422


def test_a_slow_client_gets_408_while_others_are_served(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.read-timeout", "1")
    body = fixture_bytes("dense-post50809")
    latencies: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()

    def others() -> None:
        for round_ in range(200):
            if stop.is_set():
                return
            for method, path, payload in (("POST", "/api/v1/deployments/busy/ready", ready_response(0, round_ + 1, 1)),
                                          ("GET", "/metrics", None)):  # fmt: skip
                started = time.monotonic()
                statuses.append(request(exporter.url, method, path, payload, MSGPACK).status)
                latencies.append(time.monotonic() - started)

    with raw_socket(exporter.url, timeout=10) as slow:
        slow.sendall(head(READY, f"Content-Length: {len(body)}"))
        started = time.monotonic()
        traffic = threading.Thread(target=others, daemon=True)
        traffic.start()
        answer = b""
        for byte in body:  # one byte a second, reading in between
            slow.settimeout(1.0)
            try:
                slow.sendall(bytes([byte]))
                answer = slow.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if answer:
                break
        seconds = time.monotonic() - started
        slow.settimeout(5)
        answer += read_until_closed(slow)
    stop.set()
    traffic.join(timeout=30)
    reply = Reply.parse(answer)
    assert reply.problem(408)["field"] == "body"
    assert reply.headers["connection"] == "close"
    assert 0.9 <= seconds < 3, seconds
    figures = {
        "slow_client_answer_seconds": round(seconds, 2),
        "other_requests": len(statuses),
        "other_max_latency_seconds": round(max(latencies), 3),
        "other_non_200": sum(status != 200 for status in statuses),
    }
    record(record_property, "limits_slow_client", **figures)
    assert statuses and set(statuses) == {200}, figures
    assert max(latencies) < 1.0, figures


def test_many_idle_and_stalled_connections_do_not_stop_the_server(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.read-timeout", "1")
    body = ready_response(0, 5, 1)
    partial = {
        "nothing sent": b"",
        "half a request line": b"POST /api/v1/deplo",
        "headers, no body": head(READY, f"Content-Length: {len(body)}"),
        "headers, half the body": head(READY, f"Content-Length: {len(body)}") + body[: len(body) // 2],
    }
    connections = []
    try:
        for index in range(50):
            connection = raw_socket(exporter.url, timeout=5)
            connections.append((list(partial)[index % len(partial)], connection))
            connection.sendall(partial[connections[-1][0]])
        for round_ in range(20):
            started = time.monotonic()
            assert request(exporter.url, "POST", READY, ready_response(0, round_ + 1, 1), MSGPACK).status == 200
            assert request(exporter.url, "GET", "/metrics").status == 200
            assert time.monotonic() - started < 1.0
        answers: dict[str, list[int]] = {}
        for kind, connection in connections:
            if kind.startswith("headers"):  # the read timeout applies once the headers are in
                answers.setdefault(kind, []).append(Reply.parse(read_until_closed(connection)).status)
    finally:
        for _, connection in connections:
            connection.close()
    assert answers and all(set(statuses) == {408} for statuses in answers.values()), answers
    record(record_property, "limits_idle_connections", idle_connections=len(connections), served_meanwhile=40,
           timed_out_with_408=sum(len(statuses) for statuses in answers.values()))  # fmt: skip
