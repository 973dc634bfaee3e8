"""``python -m bench.memory``: what the exporter keeps per engine, step by step, in KiB an engine.

A fresh exporter is filled with N engines (DP=8 servers, each one array request of its eight ready responses, as
the plugin sends them), then read the way its users read it: a text scrape, a gzip scrape, an OpenMetrics scrape,
the JSON state, the status page. After each step the process' resident memory (``VmRSS``) is read; the growth
of each step divided by N is what that step keeps per engine (what the state holds, then each cache a read
fills). The peak (``VmHWM``) at the end includes the transient copies of the renders.

    python -m bench.memory --engines 10000,80000
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fleet import EXPORTER_FLAGS, ready_array
from bench.load import MSGPACK, SCRAPE_FORMATS, Client, Request, timed_requests
from bench.procs import HOST, Server, peak_rss_mb, rss_mb

READS = {
    "text scrape": Request("GET", "/metrics", SCRAPE_FORMATS["text"]),
    "gzip scrape": Request("GET", "/metrics", SCRAPE_FORMATS["gzip"]),
    "OpenMetrics scrape": Request("GET", "/metrics", SCRAPE_FORMATS["openmetrics"]),
    "JSON state": Request("GET", "/api/v1/deployments", {}),
    "status page": Request("GET", "/", {}),
}


def _settled(pid: int) -> float:
    """The RSS once the process has had a moment to return what it freed."""
    time.sleep(1.0)
    return rss_mb(pid) or 0.0


def measure(engines: int, workdir: Path) -> dict[str, Any]:
    """The steps against one fresh exporter; RSS in MiB after each."""
    command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(workdir / f"m{engines}.db"),
               *EXPORTER_FLAGS, "--limits.deployments", "100000", "--web.listen-address"]  # fmt: skip
    with Server("exporter", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", workdir) as server:
        steps = {"empty": _settled(server.pid)}
        arrays = [
            Request("POST", f"/api/v1/deployments/memory-{i:05d}/ready", MSGPACK, ready_array("run-0", 1000 + i))
            for i in range(engines // 8)
        ]
        fill = timed_requests(server.port, arrays)
        del arrays
        gc.collect()
        steps["filled"] = _settled(server.pid)
        client = Client(server.port)
        try:
            for name, request in READS.items():
                client.send(request)
                steps[name] = _settled(server.pid)
        finally:
            client.close()
        peak = peak_rss_mb(server.pid)
    names = list(steps)
    per_engine = {name: (steps[name] - steps[before]) * 1024 / engines for before, name in itertools.pairwise(names)}
    return {"engines": engines, "fill": fill, "rss_mb": steps, "peak_rss_mb": peak, "kib_per_engine": per_engine,
            "peak_above_empty_kib_per_engine": ((peak or 0) - steps["empty"]) * 1024 / engines}  # fmt: skip


def render(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table: KiB an engine each step kept, per N."""
    steps = list(results[0]["kib_per_engine"])
    header = "| step | " + " | ".join(f"{r['engines']:,} engines: KiB an engine" for r in results) + " |"
    lines = [header, "|---|" + "---|" * len(results)]
    for step in steps:
        lines.append(f"| {step} | " + " | ".join(f"{r['kib_per_engine'][step]:.2f}" for r in results) + " |")
    lines.append("| peak RSS above the empty process | "
                 + " | ".join(f"{r['peak_above_empty_kib_per_engine']:.2f}" for r in results) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="10000,80000", help="comma-separated engine counts (multiples of 8)")
    parser.add_argument("--output", type=Path, help="JSON file of the figures")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cce-memory-") as tmp:
        results = [measure(int(n), Path(tmp)) for n in args.engines.split(",")]
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
