"""Where one ready response's time goes: the exporter under cProfile, fed ready responses by wrk on one connection.

python -m bench.profile_ready [--seconds 5] [--top 25] [--without-profile]

The exporter runs as ``serve`` always does, in its own process, its two busy threads each under a cProfile
(``bench/profiled_exporter.py``): the event loop's (the HTTP parsing, the decode, the handler and the answer) and
the writer's (the checks, the sync, the measure, the render ahead and the commit). wrk posts ready responses of 64
engines of DP=8 deployments, two rounds of changed block counts, as the bench's ingest does. Printed: requests a
second, the exporter's CPU per request, by thread (from /proc: the event loop, the writer and the thread pool's
workers; the writer is the busiest other thread), and per thread the functions taking the most time, in
microseconds a ready response (the profiles' totals over every ready response the exporter took, the warm-up's
included).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pstats
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import wrk
from bench.load import Client, engines, ingest_requests, spread
from bench.procs import HOST, Server
from bench.profiled_exporter import LOOP_PROFILE, WRITER_PROFILE

ENGINES = 64


def _cpu_seconds(stat: Path) -> tuple[float, float]:
    """User and system CPU seconds so far of a process or thread (its /proc ``stat``)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, tuple[float, float]]:
    """User and system CPU seconds of each thread of a process so far."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            seconds[int(task.name)] = _cpu_seconds(task / "stat")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_ready", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5, help="whole seconds of wrk")
    parser.add_argument("--top", type=int, default=25, help="functions printed")
    parser.add_argument("--without-profile", action="store_true", help="CPU by thread only, no cProfile's overhead")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cce-profile-") as tmp:
        workdir = Path(tmp)
        profiler = ["-m", "exporter"] if args.without_profile else ["-m", "bench.profiled_exporter", str(workdir)]
        command = [
            sys.executable, *profiler, "serve",
            "--storage.path", str(workdir / "profile.db"), "--log.level", "warning", "--web.listen-address",
        ]  # fmt: skip
        targets = spread(engines(ENGINES), ENGINES)
        warm_up = ingest_requests(targets, 1000)
        with Server("exporter", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", workdir) as exporter:
            client = Client(exporter.port)
            for request in warm_up:
                client.send(request)
            client.close()
            before = _threads(exporter.pid)
            result = wrk.run([wrk.Job(exporter.port, ingest_requests(targets, 2000), 1)], args.seconds, workdir)[0]
            after = _threads(exporter.pid)
            assert exporter.process is not None
            exporter.process.send_signal(signal.SIGINT)  # uvicorn stops; the profiles are written
            exporter.process.wait(timeout=30)
        print(f"{result['rate']:.0f} ready responses a second on 1 connection, errors {result['errors']}")
        per_request = 1e3 / result["requests"]
        spent = sorted(
            ((sum(after[tid]) - sum(before.get(tid, (0.0, 0.0))), after[tid][1] - before.get(tid, (0.0, 0.0))[1], tid)
             for tid in after),
            reverse=True,
        )  # fmt: skip
        print(f"exporter CPU {sum(cpu for cpu, _, _ in spent) * per_request:.3f} ms a request (wrk's part)")
        for cpu, system, tid in spent:
            if cpu > 0:
                name = "event loop" if tid == exporter.pid else f"thread {tid}"
                print(f"  {name}: {cpu * per_request:.3f} ms a request, of it {system * per_request:.3f} in the kernel")
        if not args.without_profile:
            taken = len(warm_up) + result["requests"]
            for thread, name in (("event loop", LOOP_PROFILE), ("writer", WRITER_PROFILE)):
                _print_top(thread, workdir / name, taken, args.top)
    return 0


def _print_top(thread: str, profile: Path, requests: int, top: int) -> None:
    """The ``top`` functions of a thread's profile by their own time, in microseconds a request: own, and with
    what they call."""
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    total = sum(own for _, _, own, _, _ in stats.values())
    print(f"\n{thread}: {total / requests * 1e6:.0f} us a request profiled; own us, with callees us, calls, function")
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (file, line, function), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(file).name}:{line}({function})" if line else function
        print(f"  {own / requests * 1e6:8.1f} {cumulative / requests * 1e6:8.1f} {calls / requests:6.2f}  {where}")


if __name__ == "__main__":
    raise SystemExit(main())
