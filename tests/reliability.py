"""What the reliability tests (``test_reliability_*.py``) share: plain HTTP over a fresh connection each
time, ready responses that each carry a unique value, read-only looks into the SQLite file, tmpfs mounts,
and the figures every test measures.

Figures: a test passes them to ``record``, which attaches them to its report (``record_property``); at the
end of the run ``pytest_terminal_summary`` (imported by ``conftest.py``) prints them under "reliability
figures" and, when the environment variable ``RELIABILITY_REPORT`` names a file, writes them there as JSON
lines. This works with and without ``-s`` and with pytest-xdist.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import sqlite3
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from tests.support import IN_CI, fixture_bytes, wait_until

FIGURES = "reliability"
MSGPACK_TYPE = {"Content-Type": "application/vnd.msgpack"}
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
_BASE_RESPONSE: dict[str, Any] = msgspec.msgpack.decode(fixture_bytes("dp2-rank0"))


# Figures --------------------------------------------------------------------------------------------


def record(record_property: Callable[[str, object], None], test: str, **figures: object) -> None:
    """Attach a test's measured figures to its report (printed and written at the end of the run)."""
    record_property(FIGURES, json.dumps({"test": test, **figures}, sort_keys=True))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print every test's reliability figures; write them to ``$RELIABILITY_REPORT`` (JSON lines) when set."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == FIGURES
    ]
    if not lines:
        return
    terminalreporter.section("reliability figures")
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("RELIABILITY_REPORT")
    if target:
        Path(target).write_text("".join(f"{line}\n" for line in lines))


# HTTP -------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One HTTP response: status, headers (lower-case names), the whole body, and what ``call``'s ``peer`` said."""

    status: int
    headers: dict[str, str]
    body: bytes
    peer: object = None

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    timeout: float = 10.0,
    peer: Callable[[int], object] | None = None,
) -> Reply:
    """One request on a new connection (so that with several workers any of them may answer); ``peer`` is
    asked about the client's port while the connection is still open."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = (
        http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=tls)
        if parts.scheme == "https"
        else http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    )
    with closing(connection):
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        reply = Reply(response.status, {name.lower(): value for name, value in response.getheaders()}, response.read())
        if peer and connection.sock:
            reply.peer = peer(connection.sock.getsockname()[1])
    return reply


def assert_problem(reply: Reply, status: int) -> dict[str, Any]:
    """``reply`` is an ``application/problem+json`` body of ``status``; the problem as a dict."""
    assert reply.status == status, (reply.status, reply.body[:500])
    assert reply.headers["content-type"] == "application/problem+json", reply.headers
    problem = reply.json()
    assert problem["status"] == status and problem["title"] and problem["detail"]
    return problem


def raw_socket(url: str, timeout: float = 5.0) -> socket.socket:
    """A plain TCP connection to the exporter, for requests that no HTTP client would send."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or the socket's timeout passes).

    A server that closes while the client's last bytes are still unread closes with a reset: that ends the
    stream too (what arrived before it was already received).
    """
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return received


# Ready responses ----------------------------------------------------------------------------------------


def ready_response(engine: int, num_gpu_blocks: int, engines: int, instance_id: str = "reliability-run") -> bytes:
    """A real-shaped msgpack ready response of engine ``engine`` of ``engines``, carrying ``num_gpu_blocks``."""
    document = dict(
        _BASE_RESPONSE,
        data_parallel_rank=engine,
        data_parallel_size=engines,
        world_size=engines,
        num_gpu_blocks=num_gpu_blocks,
        instance_id=instance_id,
    )
    return msgspec.msgpack.encode(document)


def engine_blocks(state: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """``GET /api/v1/deployments`` as {(deployment, engine): that engine's own num_gpu_blocks}."""
    return {
        (deployment["deployment"], engine["engine"]): engine["response"]["num_gpu_blocks"]
        for deployment in state
        for engine in deployment["engines"]
    }


# The exposition -----------------------------------------------------------------------------------------

ENGINE_FAMILIES = (
    "block_size",
    "mamba_block_size",
    "vllm_mamba_block_size",
    "num_gpu_blocks",
    "max_model_len",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "last_update_timestamp_seconds",
)
REPLICA_FAMILIES = (
    "distinct_values",
    "data_parallel_size",
    "last_seen_timestamp_seconds",
    "heartbeat_interval_seconds",
)


def cache_config_samples(exposition: str, openmetrics: bool = False) -> list[tuple[str, tuple, float]]:
    """Every ``cache_config_*`` sample, parsed by prometheus_client's text or OpenMetrics parser.

    Fails when a sample carries labels its family never has: no input may forge a series (the info
    family's other labels are the deployment's label map, which the API shows).
    """
    parse = openmetrics_families if openmetrics else text_string_to_metric_families
    found = []
    for family in parse(exposition):
        for sample in family.samples:
            if not sample.name.startswith("cache_config_") or sample.name.startswith("cache_config_exporter_"):
                continue
            suffix = sample.name.removeprefix("cache_config_")
            expected = {
                "distinct_values": {"deployment", "replica", "field"},
                "data_parallel_size": {"deployment", "replica"},
                "last_seen_timestamp_seconds": {"deployment", "replica"},
                "heartbeat_interval_seconds": {"deployment", "replica"},
            }.get(suffix, {"deployment", "replica", "engine"})
            assert suffix in ("info", *REPLICA_FAMILIES, *ENGINE_FAMILIES), sample
            assert set(sample.labels) >= expected if suffix == "info" else set(sample.labels) == expected, sample
            found.append((sample.name, tuple(sorted(sample.labels.items())), sample.value))
    return sorted(found)


def exporter_sample(exposition: str, name: str) -> float:
    """The value of one unlabelled sample of the exporter's own metrics (e.g. ``..._storage_healthy``)."""
    values = [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name
    ]
    assert len(values) == 1, (name, values)
    return values[0]


# Worker processes ----------------------------------------------------------------------------------------


def children(parent: int) -> set[int]:
    """Process ids whose parent is ``parent`` (uvicorn's worker processes, among others)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.add(int(stat.parent.name))
    return found


def connection_owner(server_port: int, client_port: int, pids: set[int]) -> int | None:
    """The process among ``pids`` holding the server end of the loopback connection from ``client_port``."""
    inodes = [
        fields[9]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if (fields := line.split())
        and int(fields[1].split(":")[1], 16) == server_port
        and int(fields[2].split(":")[1], 16) == client_port
    ]
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in pids:
        try:
            descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) in targets:
                    return pid
            except OSError:
                continue
    return None


# The SQLite file ---------------------------------------------------------------------------------------


def read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot change the file."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check`` of the file, opened read-only: ``"ok"`` when sound."""
    with closing(read_only(path)) as db:
        return "; ".join(row[0] for row in db.execute("PRAGMA integrity_check"))


def rows(db: sqlite3.Connection) -> tuple[list[tuple], list[tuple]]:
    """What the store holds, every column of every row in a fixed order (a logical dump, not the bytes)."""
    replicas = db.execute(
        "SELECT deployment, replica, static_config, instance_id, heartbeat_seconds, last_seen FROM replicas "
        "ORDER BY deployment, replica"
    ).fetchall()
    engines = db.execute(
        "SELECT deployment, replica, engine, response, wire_format, received_at FROM engines "
        "ORDER BY deployment, replica, engine"
    ).fetchall()
    return replicas, engines


# Mounts (root only) ---------------------------------------------------------------------------------------


def unavailable(reason: str) -> None:
    """Skip for a reason outside the test's control; in CI (root, mounts allowed) fail instead."""
    if IN_CI:
        pytest.fail(f"{reason}: CI must run this test")
    pytest.skip(reason)


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` at ``mount_point``, always unmounted afterwards."""
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    mount_point.mkdir()
    mounted = run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point))
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if run("umount", str(mount_point)).returncode != 0:
            run("umount", "--lazy", str(mount_point))


def fill(path: Path) -> int:
    """Write ``path`` until its filesystem is full; the bytes written."""
    written = 0
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    written += os.write(descriptor, chunk)
                except OSError:
                    break
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return written


class Ext4:
    """An ext4 file system in an image file, on a loop device, mounted with ``errors=remount-ro`` as servers
    mount data volumes: after an error the kernel turns it read-only under every open file."""

    def __init__(self, image: Path, mount_point: Path) -> None:
        self.image = image
        self.mount_point = mount_point

    def mount(self) -> None:
        mounted = run("mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.mount_point))
        if mounted.returncode != 0:
            unavailable(f"cannot mount an ext4 loop device: {mounted.stderr.strip()}")

    def unmount(self) -> None:
        if run("umount", str(self.mount_point)).returncode != 0:
            run("umount", "--lazy", str(self.mount_point))

    def fail(self) -> None:
        """Report a file-system error, as a failing disk would: the kernel makes the file system read-only."""
        device = Path(run("findmnt", "-n", "-o", "SOURCE", str(self.mount_point)).stdout.strip()).name
        trigger = Path("/sys/fs/ext4") / device / "trigger_fs_error"
        if not trigger.exists():
            unavailable(f"{trigger} does not exist (this kernel cannot inject ext4 errors)")
        trigger.write_text("reliability test: storage fault\n")

    def repair(self) -> None:
        """Unmount, check and repair, mount again read-write."""
        self.unmount()
        checked = run("e2fsck", "-f", "-y", str(self.image))
        assert checked.returncode in (0, 1), checked.stdout + checked.stderr  # 1: errors corrected
        self.mount()


@contextmanager
def ext4(image: Path, mount_point: Path, size: str = "16M") -> Iterator[Ext4]:
    """A fresh ``Ext4`` (root only), always unmounted afterwards."""
    if os.geteuid() != 0:
        unavailable("mounting a loop device needs root")
    for tool in ("mkfs.ext4", "e2fsck"):
        if not shutil.which(tool):
            unavailable(f"{tool} is not installed (package e2fsprogs)")
    mount_point.mkdir()
    run("truncate", "-s", size, str(image))
    made = run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode != 0:
        unavailable(f"mkfs.ext4 failed: {made.stderr.strip()}")
    volume = Ext4(image, mount_point)
    volume.mount()
    try:
        yield volume
    finally:
        volume.unmount()


# Attacks -------------------------------------------------------------------------------------------------

# Nearly the largest static labels the default 64 KiB body cap admits: 15 values of 4,096 characters, which
# every engine of the deployment then carries in its info labels.
BULKY_STATIC_CONFIG = json.dumps({f"bulky_{index:02d}": "x" * 4096 for index in range(15)})


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` (now) and ``VmHWM`` (the peak so far) of a process, in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


def health_latency(url: str, timeout: float) -> float:
    """Seconds ``GET /-/healthy`` took on a new connection; ``timeout`` when it failed or was not a 200."""
    started = time.monotonic()
    try:
        ok = call(url, "GET", "/-/healthy", timeout=timeout).status == 200
    except OSError:
        ok = False
    return time.monotonic() - started if ok else timeout


class HealthWatch:
    """What a liveness probe sees during an attack: ``/-/healthy`` timed back to back in a thread."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.latencies.append(health_latency(self.url, self.timeout))

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)


def recovery_seconds(url: str, bound: float = 30.0, fast: float = 0.5) -> float:
    """Seconds from now until ``/-/healthy`` answers 200 within ``fast`` seconds (fails after ``bound``)."""
    started = time.monotonic()
    wait_until(lambda: health_latency(url, fast) < fast, timeout=bound, interval=0.01)
    return time.monotonic() - started
