"""``serve --probe.only --web.workers 2`` on a file system that is read-only everywhere (a mount namespace whose
root is remounted read-only: no temporary directory, no working directory to write in): it serves, and every
worker's ``/metrics`` shows the probes of both."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.exposition import samples
from tests.helpers.http import request
from tests.probe import hostile
from tests.probe.test_probe import recorded_line, vllm_metrics
from tests.support import free_port, unavailable, wait_until

ROOT = Path(__file__).resolve().parents[2]
# Remount the root read-only in a mount namespace of its own, then run the command from there.
READ_ONLY = 'mount --make-rprivate / && mount -o remount,bind,ro / && cd / && exec "$@"'
PROBES = 6


@pytest.fixture
def read_only_workers(tmp_path: Path) -> Iterator[str]:
    """A probe-only exporter of 2 workers, everywhere read-only: its URL."""
    if (
        shutil.which("unshare") is None
        or subprocess.run(
            ["unshare", "--mount", "sh", "-c", READ_ONLY, "sh", "true"], capture_output=True, check=False
        ).returncode
        != 0
    ):
        unavailable("cannot remount the root read-only in a mount namespace (needs root or CAP_SYS_ADMIN)")
    port = free_port()
    log = (tmp_path / "exporter.log").open("wb")
    command = [sys.executable, "-m", "exporter", "serve", "--probe.only", "--web.workers", "2",
               "--probe.allowed-targets", "127.0.0.0/8", "--web.listen-address", f"127.0.0.1:{port}"]  # fmt: skip
    process = subprocess.Popen(
        ["unshare", "--mount", "sh", "-c", READ_ONLY, "sh", *command],
        stdout=log, stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}:\n{(tmp_path / 'exporter.log').read_text()}")
        try:
            return request(url, "GET", "/-/healthy", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, timeout=30)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        log.close()


def probes_counted(url: str) -> float:
    text = request(url, "GET", "/metrics").text  # a new connection: either worker answers
    [success] = [s for s in samples(text, "cache_config_exporter_probes_total") if s.labels["result"] == "success"]
    return success.value


def test_probe_only_workers_on_a_read_only_file_system_serve_and_share_their_counts(read_only_workers: str) -> None:
    with hostile.hostile(hostile.serving(vllm_metrics(recorded_line("qwen3-next")))) as target:
        for _ in range(PROBES):
            assert hostile.probe(read_only_workers, target.target)[0].status == 200
    assert {probes_counted(read_only_workers) for _ in range(8)} == {float(PROBES)}
