"""The exporter under ``bench/profiled_exporter.py``: a real ``serve`` whose event loop and writer thread are each
profiled on their own, so ``python -m bench.profile_ready`` shows where each thread's CPU goes (the writer's
commit and sync in the writer's profile, the route in the loop's), written once the exporter stops."""

from __future__ import annotations

import pstats
import signal
import sys
from pathlib import Path

from bench.load import Client, engines, ingest_requests
from bench.procs import HOST, Server
from bench.profiled_exporter import LOOP_PROFILE, WRITER_PROFILE


def _functions(profile: Path) -> set[str]:
    """The names of the functions a profile saw run."""
    return {function for _, _, function in pstats.Stats(str(profile)).stats}  # type: ignore[attr-defined]


def test_each_thread_is_profiled_apart_and_written_as_the_exporter_stops(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.profiled_exporter", str(tmp_path), "serve", "--storage.path",
               str(tmp_path / "profiled.db"), "--log.level", "warning", "--web.listen-address"]  # fmt: skip
    with Server("profiled", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", tmp_path) as exporter:
        client = Client(exporter.port, timeout=30)
        try:
            for request in ingest_requests(engines(8), 1000):
                client.send(request)
        finally:
            client.close()
        assert exporter.process is not None
        exporter.process.send_signal(signal.SIGINT)
        assert exporter.process.wait(timeout=30) == 0
    writer, loop = _functions(tmp_path / WRITER_PROFILE), _functions(tmp_path / LOOP_PROFILE)
    assert {"_commit", "sync_inputs"} <= writer
    assert "post_ready" in loop
    assert "post_ready" not in writer and "_commit" not in loop
