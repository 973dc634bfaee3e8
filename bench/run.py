"""The benchmark run: start every server, fill each to N engines, measure, stop them all, write JSON, print tables.

python -m bench [--quick] [--engines 1,100,1000,10000] [--without-pushgateway] [--output bench/results/latest.json]
python -m bench --fleet [--replicas 1250,10000] [--phase-seconds 120]   (bench/fleet.py)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from bench import fleet, fleet_report, report, wrk
from bench.baseline import prometheus_client_render, sqlite_commit_rate
from bench.load import (
    SCRAPE_FORMATS,
    Client,
    Engine,
    Request,
    engines,
    heartbeat_requests,
    info_series,
    ingest_arrays,
    ingest_requests,
    labels,
    push_request,
    push_requests,
    ready_request,
    spread,
    timed_requests,
    visible_latency,
)
from bench.procs import HOST, CpuMeter, Server, floor_server, peak_rss_mb, process_cpu_seconds, rss_mb

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "bench" / "results" / "latest.json"
FLEET_OUTPUT = ROOT / "bench" / "results" / "fleet.json"
PUSHGATEWAY = "prometheus-pushgateway"
# Debian's build defaults --persistence.file to /var/lib/prometheus/pushgateway.data: an empty value turns it off.
PUSHGATEWAY_FLAGS = ["--persistence.file="]
PUSHGATEWAY_MODE = "persistence off (--persistence.file= empty): state in memory only"
FLOOR_COMMIT_MODE = "the floor with one SQLite row committed per POST/PUT before its 200 (WAL, synchronous=FULL)"
INGEST_FROM = 100  # ingest is measured at every N from here on
INGEST_TARGETS = 64  # engines an ingest run cycles through, spread over the N
FILL_BLOCKS = 1997
# 80,000 engines are 10,000 deployments of DP=8, the default cap: raised so that no cap is what is measured (they
# are still checked).
EXPORTER_LIMITS = ["--limits.deployments", "100000"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure the exporter against Pushgateway, prometheus_client, a bare floor server and that floor "
        "committing each POST to SQLite, on loopback, in one run; print tables of ratios and write JSON.",
    )
    parser.add_argument("--engines", help="comma-separated engine counts (default 1,100,1000,10000; quick: 1,100,1000)")
    parser.add_argument("--quick", action="store_true", help="shorter: 2 s per wrk run, 15 visibility checks, N<=1000")
    parser.add_argument("--duration", type=int, help="whole seconds per wrk run (default 5, quick 2)")
    parser.add_argument("--visible-reps", type=int, help="ingest-to-visible repetitions per N (default 50, quick 15)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file of all raw figures")
    parser.add_argument("--from-json", type=Path, help="print the tables of an earlier run's JSON and exit")
    parser.add_argument("--without-pushgateway", action="store_true", help="the exporter and the floor only")
    fleet_options = parser.add_argument_group("the fleet (--fleet): heartbeats, restarts and scrapes over time")
    fleet_options.add_argument("--fleet", action="store_true", help="run the fleet benchmark (bench/fleet.py)")
    fleet_options.add_argument("--replicas", default="1250,10000", help="comma-separated vLLM servers of DP=8")
    fleet_options.add_argument("--phase-seconds", type=float, default=120.0, help="heartbeat and fleet phases")
    fleet_options.add_argument("--fill-budget", type=float, default=fleet.FILL_BUDGET,
                               help="most seconds Pushgateway is given to take the whole fleet")  # fmt: skip
    fleet_options.add_argument("--plot", type=Path, help="the PNG (default: next to --output)")
    args = parser.parse_args(argv)
    args.replicas = sorted({int(n) for n in args.replicas.split(",")})
    if args.fleet and (min(args.replicas) < 1 or not 1 <= args.phase_seconds <= 3600):
        parser.error("--replicas must be positive and --phase-seconds 1..3600")
    args.engines = sorted(
        {int(n) for n in (args.engines or ("1,100,1000" if args.quick else "1,100,1000,10000")).split(",")}
    )
    args.duration = args.duration or (2 if args.quick else 5)
    args.visible_reps = args.visible_reps or (15 if args.quick else 50)
    if min(args.engines) < 1 or max(args.engines) > 100_000 or not 1 <= args.visible_reps <= 500:
        parser.error("engine counts must be 1..100000 and --visible-reps 1..500")
    if not 1 <= args.duration <= 120:
        parser.error("--duration must be 1..120 seconds")
    return args


def _first_line(command: list[str]) -> str | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False, cwd=ROOT)
    except OSError:
        return None
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines[0] if lines else None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return None


def metadata(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """When, where and with what the run was made."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "cpu": _cpu_model(),
            "kernel": platform.release(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "versions": {
            "python": platform.python_version(),
            "exporter": importlib.metadata.version("cache-config-exporter"),
            "exporter_commit": _first_line(["git", "describe", "--always", "--dirty"]),
            "prometheus_client": importlib.metadata.version("prometheus-client"),
            "pushgateway": _first_line([PUSHGATEWAY, "--version"]),
            "wrk": " ".join((_first_line([wrk.wrk_binary(), "-v"]) or "").split()[:2]),
        },
        "settings": {
            "engines": args.engines,
            "wrk": f"1 thread, {args.duration:g} s per run",
            "visible_reps": args.visible_reps,
            "pushgateway": PUSHGATEWAY_MODE,
            "floor_commit": FLOOR_COMMIT_MODE,
            "storage": str(workdir / "bench.db"),
        },
    }


class Bench:
    """The servers of one run and the state they were filled to."""

    def __init__(self, args: argparse.Namespace, workdir: Path, exporter: Server, pushgateway: Server | None) -> None:
        self.args = args
        self.workdir = workdir
        self.exporter = exporter
        self.pushgateway = pushgateway
        self.filled: dict[tuple[str, int], Engine] = {}
        self.values = itertools.count(10_000, 10)  # num_gpu_blocks of each ingest run: never a value seen before
        self.cpu = CpuMeter([server for server in (exporter, pushgateway) if server is not None])

    def wrk(self, *jobs: wrk.Job) -> list[dict[str, Any]]:
        """Run wrk jobs together; each result notes the share of a core other processes took meanwhile, and the
        exporter's own CPU seconds."""
        exporter_cpu = process_cpu_seconds(self.exporter.pid)
        with self.cpu.measure() as cpu:
            results = wrk.run(jobs, self.args.duration, self.workdir)
        exporter_cpu = process_cpu_seconds(self.exporter.pid) - exporter_cpu
        return [
            {**result, "other_cpu_share": cpu["other_share"], "steal_share": cpu["steal_share"],
             "exporter_cpu_seconds": exporter_cpu}
            for result in results
        ]  # fmt: skip

    def at(self, ordinal: int, n: int) -> dict[str, Any]:
        """Measure at ``n`` engines, noting how much CPU other processes took meanwhile (a disturbed run)."""
        with self.cpu.measure() as cpu:
            result = self._measure(ordinal, n)
        return {**result, "cpu": cpu}

    def _measure(self, ordinal: int, n: int) -> dict[str, Any]:
        """Fill both servers to ``n`` engines and measure everything at that size."""
        population = engines(n)
        todo = [engine for engine in population if self.filled.get((engine.deployment, engine.rank)) != engine]
        fill = {"exporter": timed_requests(self.exporter.port, [ready_request(e, FILL_BLOCKS) for e in todo])}
        exposition, series = self._filled(self.exporter, n)
        if self.pushgateway is not None:
            pushes = [push_request(e, series[e.deployment, e.rank]) for e in todo]
            print(f"bench: {len(pushes)} pushes to Pushgateway (each costs more the more it holds)", file=sys.stderr)
            fill["pushgateway"] = timed_requests(self.pushgateway.port, pushes)
            self._filled(self.pushgateway, n)
        self.filled.update({(e.deployment, e.rank): e for e in todo})
        result: dict[str, Any] = {"fill": fill, "scrape_body_bytes": len(exposition)}

        body = self.workdir / f"scrape-{n}.txt"
        body.write_bytes(exposition)
        targets = spread(population, INGEST_TARGETS)
        with self._floor("floor", body) as floor:
            result["scrape"] = self.scrapes(floor)
            if n >= INGEST_FROM:
                commit_file = self.workdir / f"floor-commit-{n}.db"
                with self._floor("floor-commit", body, "--commit-per-post", str(commit_file)) as commit_floor:
                    result["ingest"] = self.ingest(population, series, floor, commit_floor)
                result["sqlite_commit"] = sqlite_commit_rate(self.workdir, self.args.duration)
        if n == self.args.engines[-1] and n >= INGEST_FROM:
            scrape, ingest = self.wrk(
                self._scrape_job(self.exporter, "text"), self._ingest_job(self.exporter, targets, 1)
            )
            result["scrape_during_ingest"] = {"scrape": scrape, "ingest": ingest}
        label_set = labels(next(iter(series.values())))
        result["prometheus_client_render"] = prometheus_client_render(population, label_set, 20, 5.0)
        first_block_size = 2000 + ordinal * self.args.visible_reps
        result["visible"] = visible_latency(self.exporter.port, population[0], self.args.visible_reps, first_block_size)
        result["peak_rss_mb"] = {server.name: peak_rss_mb(server.pid) for server in self.cpu.running}
        return result

    @contextlib.contextmanager
    def _floor(self, name: str, body: Path, *options: str) -> Iterator[Server]:
        """A floor server answering GETs with ``body``, counted as this run's own CPU while it is up."""
        with floor_server(body, self.workdir, *options, name=name) as floor:
            self.cpu.running.append(floor)
            try:
                yield floor
            finally:
                self.cpu.running.remove(floor)

    @staticmethod
    def _filled(server: Server, n: int) -> tuple[bytes, dict[tuple[str, int], bytes]]:
        """The server's text exposition and its info series, checked to be one for each of the ``n`` engines."""
        client = Client(server.port)
        try:
            exposition = client.scrape()
        finally:
            client.close()
        series = info_series(exposition)
        if len(series) != n:
            raise RuntimeError(f"{server.name} shows {len(series)} cache_config_info series, not {n}")
        return exposition, series

    @staticmethod
    def _scrape_job(server: Server, scrape_format: str) -> wrk.Job:
        return wrk.Job(server.port, [Request("GET", "/metrics", SCRAPE_FORMATS[scrape_format])])

    def _ingest_job(self, server: Server, targets: Sequence[Engine], connections: int) -> wrk.Job:
        """Ready responses cycled over ``targets``, with block counts no earlier run sent."""
        return wrk.Job(server.port, ingest_requests(targets, next(self.values)), connections)

    def scrapes(self, floor: Server) -> dict[str, dict[str, Any]]:
        """Back-to-back scrapes on one connection: the exporter in each format, Pushgateway, the floor."""
        jobs = {
            "exporter_text": self._scrape_job(self.exporter, "text"),
            "exporter_openmetrics": self._scrape_job(self.exporter, "openmetrics"),
            "exporter_gzip": self._scrape_job(self.exporter, "gzip"),
            "floor_text": self._scrape_job(floor, "text"),
        }
        if self.pushgateway is not None:
            jobs["pushgateway_text"] = self._scrape_job(self.pushgateway, "text")
        return {name: self.wrk(job)[0] for name, job in jobs.items()}

    def ingest(
        self, population: Sequence[Engine], series: dict[tuple[str, int], bytes], floor: Server, commit_floor: Server
    ) -> dict[str, dict[str, Any]]:
        """Every request changes state: the exporter (durable) on 1 and 8 connections, a DP=8 server's engines in one
        request on 1, the floor and the floor that commits each POST (the same requests), Pushgateway."""
        targets = spread(population, INGEST_TARGETS)
        jobs = {
            "exporter_1": self._ingest_job(self.exporter, targets, 1),
            "exporter_8": self._ingest_job(self.exporter, targets, 8),
            "exporter_dp8_1": wrk.Job(self.exporter.port, ingest_arrays(population, next(self.values))),
            "exporter_heartbeat_1": wrk.Job(self.exporter.port, heartbeat_requests(targets)),
            "floor_1": self._ingest_job(floor, targets, 1),
            "floor_8": self._ingest_job(floor, targets, 8),
            "floor_commit_1": self._ingest_job(commit_floor, targets, 1),
            "floor_commit_8": self._ingest_job(commit_floor, targets, 8),
        }
        if self.pushgateway is not None:
            pushes = push_requests(targets, series, next(self.values))
            jobs["pushgateway_1"] = wrk.Job(self.pushgateway.port, pushes, 1)
        return {name: self.wrk(job)[0] for name, job in jobs.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run; every server it started is stopped when it returns or raises."""
    pushgateway_binary = shutil.which(PUSHGATEWAY)
    if pushgateway_binary is None and not args.without_pushgateway:
        raise SystemExit(f"{PUSHGATEWAY} is not installed: apt-get install prometheus-pushgateway")
    with tempfile.TemporaryDirectory(prefix="cce-bench-") as tmp, contextlib.ExitStack() as servers:
        workdir = Path(tmp)
        exporter_command = [
            sys.executable, "-m", "exporter", "serve", "--storage.path", str(workdir / "bench.db"),
            "--log.level", "warning", *EXPORTER_LIMITS, "--web.listen-address",
        ]  # fmt: skip
        exporter = servers.enter_context(
            Server("exporter", lambda port: [*exporter_command, f"{HOST}:{port}"], "/-/healthy", workdir)
        )
        pushgateway = None
        if not args.without_pushgateway:
            pushgateway = servers.enter_context(
                Server(
                    "pushgateway",
                    lambda port: [pushgateway_binary, *PUSHGATEWAY_FLAGS, f"--web.listen-address={HOST}:{port}"],
                    "/-/ready",
                    workdir,
                )
            )
        time.sleep(1.0)
        results: dict[str, Any] = {"meta": metadata(args, workdir)}
        # What the exporter takes before it holds anything: the base of its memory per engine.
        results["empty_rss_mb"] = {"exporter": rss_mb(exporter.pid)}
        bench = Bench(args, workdir, exporter, pushgateway)
        results["engines"] = {}
        start = time.monotonic()
        for ordinal, n in enumerate(args.engines):
            print(f"bench: {n} engines, {time.monotonic() - start:.0f} s in", file=sys.stderr, flush=True)
            results["engines"][str(n)] = bench.at(ordinal, n)
        results["meta"]["run_seconds"] = time.monotonic() - start
        results["targets"] = [target.as_dict() for target in report.targets(results)]
        return results


def _terminate(signum: int, _: object) -> NoReturn:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(fleet_report.render(saved) if "runs" in saved else report.render(saved))
        return 0
    signal.signal(signal.SIGTERM, _terminate)  # so that a kill still stops every server (finally blocks run)
    if args.fleet:
        output = FLEET_OUTPUT if args.output == DEFAULT_OUTPUT else args.output
        plot = args.plot or output.with_suffix(".png")
        return fleet.main(args.replicas, args.phase_seconds, args.fill_budget, output, plot)
    results = measure(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(report.render(results))
    print(f"\nraw figures: {args.output}")
    return 0
