"""What nearly every test needs: fixture data, free ports, polling, system binaries, a real exporter process."""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.helpers.http import request

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-ready"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


# Files whose every test is long: attacks and reliability (floods, crash loops, faults, time limits run out),
# hostile targets, fleets expiring and restarting, slow readers, a real Prometheus, a real browser. conftest.py
# marks their tests ``slow`` (README, Development); single long tests elsewhere carry the mark themselves.
SLOW_FILES = (
    "test_attack_*.py",
    "test_reliability_*.py",
    "test_*hostile*.py",
    "test_fleet*.py",
    "test_slow_readers.py",
    "test_prometheus.py",
    "test_pages_in_chromium.py",
)


def is_slow_file(path: Path) -> bool:
    """Whether every test of this file is long (``SLOW_FILES``)."""
    return any(fnmatch.fnmatch(path.name, pattern) for pattern in SLOW_FILES)


def fixture_bytes(name: str, suffix: str = "msgpack") -> bytes:
    """The bytes of one vLLM ready-response fixture (``suffix`` ``msgpack`` or ``json``)."""
    return (FIXTURES / f"{name}.{suffix}").read_bytes()


def case_names() -> list[str]:
    """The names of the hand-made wire-format fixtures."""
    return sorted(path.stem for path in FIXTURES.glob("*.msgpack"))


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def unavailable(reason: str) -> NoReturn:
    """Skip for a reason outside the test's control; in CI (root, every package .ci/run installs) fail instead."""
    if IN_CI:
        pytest.fail(f"{reason}: CI must run this test")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    """Path of a system binary; skips without it, but fails in CI, where .ci/run installs it."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed (apt-get install the package that has it; .ci/run does)")
    return path


class ExporterProcess:
    """``cache-config-exporter serve`` as a real subprocess on a free port, always reached on loopback.

    ``host`` is the address it listens on; with ``tls`` (a context trusting its certificate) it is reached by HTTPS.
    """

    def __init__(
        self,
        storage: Path,
        *args: str,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.storage = storage
        self.args = args
        self.env = env
        self.host = host
        self.tls = tls
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = storage.with_suffix(".log")

    def start(self, timeout: float = 20.0) -> ExporterProcess:
        """Start the process and wait until it answers its health check; a process that does not within
        ``timeout`` seconds is stopped before the failure is raised."""
        command = [
            sys.executable, "-m", "exporter", "serve",
            "--web.listen-address", f"{self.host}:{self.port}",
            "--storage.path", str(self.storage),
            *self.args,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_until(self._healthy, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"exporter exited with {self.process.returncode}:\n{self.log.read_text()}")
        try:
            return request(self.url, "GET", "/-/healthy", tls=self.tls, timeout=1).status == 200
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop the process with ``sig`` and return its exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def restart(self) -> ExporterProcess:
        self.stop()
        return self.start()
