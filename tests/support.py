"""Helpers the tests share: fixture data, free ports, a real exporter process, system binaries."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-ready"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


def require_binary(name: str) -> str:
    """Path of a system binary; skips without it, but fails in CI, where .ci/run installs it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install the package that has it; .ci/run does)"
        if IN_CI:
            pytest.fail(f"{message}: CI must run this test")
        pytest.skip(message)
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

    def start(self) -> ExporterProcess:
        command = [
            sys.executable, "-m", "exporter", "serve",
            "--web.listen-address", f"{self.host}:{self.port}",
            "--storage.path", str(self.storage),
            *self.args,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_until(self._healthy, timeout=20)
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"exporter exited with {self.process.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/healthy", timeout=1, context=self.tls) as response:
                return response.status == 200
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


MSGPACK = {"Content-Type": "application/vnd.msgpack"}


def samples(exposition: str, name: str) -> list[Sample]:
    """Every sample named ``name`` (e.g. ``..._total`` for a counter) in a Prometheus text exposition."""
    families = text_string_to_metric_families(exposition)
    return [sample for family in families for sample in family.samples if sample.name == name]


def info_labels(exposition: str, deployment: str, name: str = "cache_config_info") -> dict[str, dict[str, str]]:
    """``cache_config_info`` label sets of one deployment, by engine."""
    return {
        sample.labels["engine"]: sample.labels
        for sample in samples(exposition, name)
        if sample.labels["deployment"] == deployment
    }
