"""Where one ready response's time goes: the exporter under cProfile, fed ready responses by wrk on one connection.

python -m bench.profile_ready [--seconds 5] [--top 25]

The exporter runs as ``serve`` always does, in its own process, under ``cProfile`` (which profiles the thread that
runs the event loop, where the HTTP parsing, the decode, the handler and the answer run; the writer thread is not
profiled). wrk posts ready responses of 64 engines of DP=8 deployments, two rounds of changed block counts, as the
bench's ingest does. Printed: requests a second, the exporter's CPU seconds per request (both threads, from
/proc), the event loop's per request, and the functions of the event loop taking the most time per request.
"""

from __future__ import annotations

import argparse
import pstats
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import wrk
from bench.load import Client, engines, ingest_requests, spread
from bench.procs import HOST, Server

ENGINES = 64


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_ready", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="whole seconds of wrk")
    parser.add_argument("--top", type=int, default=25, help="functions printed")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cce-profile-") as tmp:
        workdir = Path(tmp)
        profile = workdir / "exporter.prof"
        command = [
            sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "exporter", "serve",
            "--storage.path", str(workdir / "profile.db"), "--log.level", "warning", "--web.listen-address",
        ]  # fmt: skip
        targets = spread(engines(ENGINES), ENGINES)
        with Server("exporter", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", workdir) as exporter:
            client = Client(exporter.port)
            for request in ingest_requests(targets, 1000):
                client.send(request)
            client.close()
            cpu = _cpu_seconds(exporter.pid)
            result = wrk.run([wrk.Job(exporter.port, ingest_requests(targets, 2000), 1)], args.seconds, workdir)[0]
            cpu = _cpu_seconds(exporter.pid) - cpu
            assert exporter.process is not None
            exporter.process.send_signal(signal.SIGINT)  # uvicorn stops; cProfile writes its file
            exporter.process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not profile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        requests = result["requests"] + 2 * ENGINES
        stats = pstats.Stats(str(profile))
        loop = stats.total_tt  # type: ignore[attr-defined]  # pstats keeps it as an attribute
        print(f"{result['rate']:.0f} ready responses a second on 1 connection, errors {result['errors']}")
        print(f"exporter CPU {cpu / result['requests'] * 1e3:.3f} ms a request (all threads, wrk's part)")
        print(f"event loop thread, profiled: {loop / requests * 1e3:.3f} ms a request (whole run)")
        stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
