"""wrk as the judge: one thread, N connections, a fixed duration, pre-built requests, JSON results from Lua."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import Request
from bench.procs import HOST

LUA = Path(__file__).with_name("wrk.lua")
_MARKER = "BENCH_JSON "
_serial = itertools.count()


@dataclass(frozen=True)
class Job:
    """One wrk run: ``requests`` cycled on ``connections`` connections to the server on ``port``."""

    port: int
    requests: Sequence[Request]
    connections: int = 1


def wrk_binary() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    return path


def raw(request: Request, port: int) -> bytes:
    """The request as bytes on the wire, HTTP/1.1 keep-alive."""
    head = [f"{request.method} {request.path} HTTP/1.1", f"Host: {HOST}:{port}"]
    head += [f"{name}: {value}" for name, value in request.headers.items()]
    if request.method != "GET":
        head.append(f"Content-Length: {len(request.body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + request.body


def _write_requests(job: Job, workdir: Path) -> Path:
    prefix = workdir / f"wrk-{next(_serial)}"
    encoded = [raw(request, job.port) for request in job.requests]
    prefix.with_suffix(".bin").write_bytes(b"".join(encoded))
    prefix.with_suffix(".idx").write_text("".join(f"{len(item)}\n" for item in encoded))
    return prefix


def run(jobs: Sequence[Job], duration: int, workdir: Path) -> list[dict[str, Any]]:
    """Run the jobs at the same time for ``duration`` seconds; the results in the same order."""
    processes = []
    try:
        for job in jobs:
            command = [
                wrk_binary(), "-t1", f"-c{job.connections}", f"-d{duration}s", "--timeout", "60s",
                "-s", str(LUA), f"http://{HOST}:{job.port}/", "--", str(_write_requests(job, workdir)),
            ]  # fmt: skip
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return [_result(*process.communicate(timeout=duration + 120)) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _result(stdout: str, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith(_MARKER)]
    if not lines:
        raise RuntimeError(f"wrk printed no results:\n{stdout}\n{stderr}")
    raw_result = json.loads(lines[-1].removeprefix(_MARKER))
    seconds = raw_result["duration_us"] / 1e6
    latency = raw_result["latency_us"]
    requests = raw_result["requests"]
    return {
        "requests": requests,
        "seconds": seconds,
        "rate": requests / seconds,
        "bytes_per_request": raw_result["bytes"] / requests if requests else None,
        **{f"{name}_ms": latency[name] / 1e3 for name in ("p50", "p90", "p99", "max", "mean")},
        "errors": sum(raw_result["errors"].values()),
        "error_detail": raw_result["errors"],
    }
