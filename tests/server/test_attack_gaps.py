"""Behaviours no test pinned down before (planted single bugs passed them): deletes surviving a restart,
an fsync per commit, the exact body cap, engines disagreeing on data_parallel_size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tests.helpers.exposition import samples
from tests.helpers.http import MSGPACK, raw_socket, read_until_closed, request
from tests.helpers.processes import children
from tests.helpers.ready_responses import ready_response
from tests.support import ExporterProcess, free_port, require_binary, wait_until


def series(exporter: ExporterProcess) -> set[tuple[str, str, str]]:
    exposition = request(exporter.url, "GET", "/metrics").body.decode()
    return {
        (deployment, sample.labels.get("engine", ""), sample.name)
        for deployment in ("kept", "gone", "split")
        for sample in samples(exposition, "cache_config_info") + samples(exposition, "cache_config_num_gpu_blocks")
        if sample.labels["deployment"] == deployment
    }


def test_deletes_stay_deleted_after_a_restart(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    for deployment, engine in (("kept", 0), ("gone", 0), ("split", 0), ("split", 1)):
        reply = request(exporter.url, "POST", f"/api/v1/deployments/{deployment}/ready",
                        ready_response(engine, 10 + engine, 2, instance_id=deployment), MSGPACK)  # fmt: skip
        assert reply.status == 200, reply.body[:300]
    assert request(exporter.url, "DELETE", "/api/v1/deployments/gone").status == 204
    assert request(exporter.url, "DELETE", "/api/v1/deployments/split/engines/1").status == 200
    before = series(exporter)
    assert {(deployment, engine) for deployment, engine, _ in before} == {("kept", "0"), ("split", "0")}
    exporter.restart()
    assert series(exporter) == before
    assert request(exporter.url, "GET", "/api/v1/deployments/gone").status == 404
    engines = request(exporter.url, "GET", "/api/v1/deployments/split").json()["engines"]
    assert [engine["engine"] for engine in engines] == [0]


def test_every_acknowledged_commit_is_fsynced(tmp_path: Path) -> None:
    strace = require_binary("strace")
    port = free_port()
    trace = tmp_path / "fsync.trace"
    command = [strace, "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(trace),
               sys.executable, "-m", "exporter", "serve", "--web.listen-address", f"127.0.0.1:{port}",
               "--storage.path", str(tmp_path / "exporter.db")]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "exporter.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _answers(url), timeout=30)
        synced = trace.read_text().count("sync(")
        for blocks in range(1, 6):  # one at a time: each its own commit
            assert request(url, "POST", "/api/v1/ready", ready_response(0, blocks, 1), MSGPACK).status == 200
        per_commit = (trace.read_text().count("sync(") - synced) / 5
    finally:
        for child in children(process.pid):  # the exporter, traced by strace
            os.kill(child, signal.SIGTERM)
        process.wait(timeout=30)
    assert per_commit >= 1, f"{per_commit} fsyncs per acknowledged commit: a power loss could lose it"


def _answers(url: str) -> bool:
    try:
        return request(url, "GET", "/-/healthy", timeout=1).status == 200
    except OSError:
        return False


def padded(size: int) -> bytes:
    """A valid ready response of exactly ``size`` bytes (an unknown key carries the padding)."""
    document = msgspec.msgpack.decode(ready_response(0, 3, 1))
    length = size
    while True:
        document["padding"] = "x" * length
        body = msgspec.msgpack.encode(document)
        if len(body) == size:
            return body
        length -= len(body) - size


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_of_exactly_the_cap_is_taken_and_one_byte_more_is_refused(
    start_exporter: Callable[..., ExporterProcess], chunked: bool
) -> None:
    cap = 70_000
    exporter = start_exporter("--web.max-request-bytes", str(cap))
    for size, status in ((cap, 200), (cap + 1, 413)):
        body = padded(size)
        assert len(body) == size
        head = "POST /api/v1/ready HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/vnd.msgpack\r\n"
        head += "Connection: close\r\n"
        if chunked:
            request = f"{head}Transfer-Encoding: chunked\r\n\r\n{size:x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        else:
            request = f"{head}Content-Length: {size}\r\n\r\n".encode() + body
        with raw_socket(exporter.url) as connection:
            connection.sendall(request)
            answer = read_until_closed(connection)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), (size, answer[:300])


def test_engines_disagreeing_on_data_parallel_size_show_the_largest(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter()
    for engine, size in ((0, 2), (1, 4)):
        reply = request(exporter.url, "POST", "/api/v1/deployments/split/ready", ready_response(engine, 5, size),
                        MSGPACK)  # fmt: skip
        assert reply.status == 200, reply.body[:300]
    exposition = request(exporter.url, "GET", "/metrics").body.decode()
    (parallel,) = samples(exposition, "cache_config_data_parallel_size")
    assert parallel.labels == {"deployment": "split", "replica": "default"} and parallel.value == 4
    assert {sample.labels["engine"] for sample in samples(exposition, "cache_config_info")} == {"0", "1"}
