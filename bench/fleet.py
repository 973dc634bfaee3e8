"""``python -m bench --fleet``: a fleet of vLLM servers against the exporter, the same fleet against Pushgateway, and
its heartbeats against the floor.

N replicas (vLLM servers) of DP=8 in deployments of 40 replicas. Each server does what the plugin does: at its
start a PUT of its labels and one POST of its eight engines' ready responses (one msgpack array), then a heartbeat
every 30 s, all on the one connection it keeps (``sender.Connection``; the exporter keeps idle connections for
65 s); Pushgateway's users re-push their eight ``cache_config_info`` series every 30 s instead (a PUT of the
replica's group, as prometheus_client's ``push_to_gateway`` does, on a connection of its own each time). The real
per-replica rates, compressed only in how long the run lasts:

1. fill: every replica starts (8 requests at a time), timed; Pushgateway gets at most ``FILL_BUDGET`` seconds;
2. quiet (15 s): nothing sent, nothing scraped: the baseline of CPU;
3. idle (20 s): scrapes every second, nothing else: the baseline of scrape latency;
4. heartbeats (``--phase-seconds``, default 120): N/30 heartbeats (pushes) a second, scrapes every 15 s as
   Prometheus makes them (each one after 15 s of heartbeats: what a heartbeat costs a scrape is in it);
5. fleet (the same length): heartbeats, a rolling restart of 10 % of the servers spread over the middle half
   (each a new run: labels and eight engines again; a push for Pushgateway), scrapes every 15 s.

The floor (``bench/floor_server.py``, a bare asyncio server that only answers) gets the plugin's fill, quiet and
heartbeat phases on the same kept connections: what N/30 requests a second cost on this machine's loopback with N
connections held, the heartbeats' CPU with nothing behind them.

Each server runs alone, started afresh for each N, so that CPU and memory are its own; every second the CPU share
of one core and the RSS of its process are sampled. The results go to JSON, a markdown table and a PNG.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench import aio, fleet_report
from bench.load import (
    DATA_PARALLEL,
    MSGPACK,
    PUSH_TEXT,
    SCRAPE_FORMATS,
    Client,
    Request,
    fixture_response,
    info_series,
    labels,
)
from bench.procs import HOST, Server, floor_server, peak_rss_mb, rss_mb

HEARTBEAT_SECONDS = 30.0
PROMETHEUS_SCRAPE_SECONDS = 15.0
PROBE_SCRAPE_SECONDS = 1.0
QUIET_SECONDS = 15.0
IDLE_SECONDS = 20.0
RESTART_SHARE = 0.1
REPLICAS_PER_DEPLOYMENT = 40
IN_FLIGHT = 64
FILL_IN_FLIGHT = 8
FILL_BUDGET = 120.0
# The exporter expires a replica after 3 missed heartbeats (90 s). The heartbeats go in the order of the fill: the
# first replica's first one comes after the fill and the quiet and idle phases. 10 s spare for the scrapes between.
FILL_BEFORE_EXPIRY = 3 * HEARTBEAT_SECONDS - QUIET_SECONDS - IDLE_SECONDS - 10.0
# The floor runs only the phases (of ``fleet_report.PHASES``, in their order) that measure the heartbeats' CPU.
FLOOR_PHASES = ("quiet", "heartbeats")
WINDOW_SECONDS = 5.0
# The default byte budget (384 MiB) holds the largest fleet (80,000 engines): the run keeps it.
# Every server keeps a connection: as many as the open-file limit lets the exporter serve (it warns of fewer).
# A real server's connection is never idle longer than its 30 s between heartbeats, well within the exporter's 65 s;
# here the fill and the quiet and idle phases kept the first servers' connections idle past 65 s before their first
# heartbeat (5,670 and 10,427 of 10,000 reconnected in two runs). Kept longer, the heartbeats go on them as the
# plugin's would, not on new connections.
KEEP_ALIVE_SECONDS = 600
EXPORTER_FLAGS = ["--log.level", "warning", "--web.max-connections", "100000",
                  "--web.keep-alive-timeout", str(KEEP_ALIVE_SECONDS)]  # fmt: skip
JSON_LABELS = {"Content-Type": "application/json"}
SCRAPE = Request("GET", "/metrics", SCRAPE_FORMATS["gzip"])
# vLLM's frontend labels (``CacheConfig.metrics_info()``), as the plugin PUTs them.
STATIC_LABELS = {
    "block_size": "16",
    "cache_dtype": "auto",
    "enable_prefix_caching": "True",
    "gpu_memory_utilization": "0.9",
    "num_gpu_blocks": "15976",
    "prefix_caching_hash_algo": "sha256",
    "swap_space": "4",
}


def replica_names(count: int) -> list[tuple[str, str]]:
    """(deployment, replica) of each of ``count`` vLLM servers, in deployments of 40."""
    return [(f"fleet-{i // REPLICAS_PER_DEPLOYMENT:04d}", f"vllm-{i:05d}:8000") for i in range(count)]


def ready_array(run: str, blocks: int) -> bytes:
    """A DP=8 server's ready responses of one run, as the plugin sends them: one msgpack array."""
    responses = [
        {**fixture_response(), "data_parallel_size": DATA_PARALLEL, "data_parallel_rank": rank, "instance_id": run,
         "num_gpu_blocks": blocks + rank}
        for rank in range(DATA_PARALLEL)
    ]  # fmt: skip
    return msgspec.msgpack.encode(responses)


def exporter_start(
    deployment: str, replica: str, run: str, blocks: int, heartbeats: bool = True
) -> tuple[Request, ...]:
    """What the plugin sends as its server starts: the labels, then the engines in one request, with the promise
    of its heartbeats (the interval every heartbeat then sends); without ``heartbeats``, none promised (a run
    that sends none, whose replicas must not expire)."""
    query = f"replica={replica}&heartbeat={HEARTBEAT_SECONDS:g}" if heartbeats else f"replica={replica}"
    base = f"/api/v1/deployments/{deployment}"
    return (
        Request("PUT", f"{base}/cache-config?{query}", JSON_LABELS, json.dumps(STATIC_LABELS).encode()),
        Request("POST", f"{base}/ready?{query}", MSGPACK, ready_array(run, blocks)),
    )


def exporter_heartbeat(deployment: str, replica: str) -> Request:
    query = f"replica={replica}&interval={HEARTBEAT_SECONDS:g}"
    return Request("POST", f"/api/v1/deployments/{deployment}/heartbeat?{query}", {})


def push(deployment: str, replica: str, template: dict[str, str], blocks: int) -> Request:
    """A PUT of the replica's group: its eight engines' ``cache_config_info`` series."""
    lines = [b"# TYPE cache_config_info gauge"]
    for rank in range(DATA_PARALLEL):
        values = {**template, "engine": str(rank), "num_gpu_blocks": str(blocks + rank)}
        lines.append(("cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in values.items()) + "} 1").encode())
    return Request("PUT", f"/metrics/job/vllm/deployment/{deployment}/replica/{replica}", PUSH_TEXT,
                   b"\n".join(lines) + b"\n")  # fmt: skip


class Work:
    """One server's side of the fleet: what a start, a heartbeat and a restart send; the plugin's requests, but for
    ``pushgateway``, whose users push ``template``'s labels."""

    def __init__(self, kind: str, template: dict[str, str]) -> None:
        self.kind = kind
        self.template = template

    def start(self, at: float, kind: str, deployment: str, replica: str, run: str, blocks: int) -> aio.Event:
        if self.kind == "pushgateway":
            return aio.Event(at, kind, (push(deployment, replica, self.template, blocks),))
        requests = exporter_start(deployment, replica, run, blocks)
        return aio.Event(at, kind, requests, client=f"{deployment}/{replica}")

    def heartbeat(self, at: float, deployment: str, replica: str) -> aio.Event:
        if self.kind == "pushgateway":
            return aio.Event(at, "heartbeat", (push(deployment, replica, self.template, 1000),))
        return aio.Event(at, "heartbeat", (exporter_heartbeat(deployment, replica),), client=f"{deployment}/{replica}")


def heartbeats(names: Sequence[tuple[str, str]], work: Work, seconds: float) -> list[aio.Event]:
    """Each replica every 30 s, the replicas spread evenly over the 30 s."""
    events = []
    for i, (deployment, replica) in enumerate(names):
        at = i * HEARTBEAT_SECONDS / len(names)
        while at < seconds:
            events.append(work.heartbeat(at, deployment, replica))
            at += HEARTBEAT_SECONDS
    return events


def restarts(names: Sequence[tuple[str, str]], work: Work, seconds: float) -> list[aio.Event]:
    """Every tenth replica starts a new run, spread over the middle half of the phase."""
    chosen = names[:: round(1 / RESTART_SHARE)]
    return [
        work.start(seconds / 4 + j * (seconds / 2) / len(chosen), "restart", deployment, replica, f"restart-{j}", 2000)
        for j, (deployment, replica) in enumerate(chosen)
    ]  # fmt: skip


async def _phase(
    server: Server,
    connections: aio.Connections,
    events: Sequence[aio.Event],
    seconds: float,
    scrape_every: float | None,
    in_flight: int,
) -> dict[str, Any]:
    """Run ``events`` with scrapes (none if ``scrape_every`` is ``None``) and samples for ``seconds``; what came of
    it."""
    start = time.monotonic()
    deadline = start + seconds
    tally = aio.Tally()
    scraping = [] if scrape_every is None else [aio.scrape(server.port, SCRAPE, scrape_every, start, deadline)]
    _, samples, *scraped = await asyncio.gather(
        aio.drive(connections, events, in_flight, start, deadline, tally),
        aio.sample(server.pid, start, deadline),
        *scraping,
    )
    scrapes = scraped[0] if scraped else []
    due: dict[str, int] = {}
    for event in events:
        if event.at < seconds:
            due[event.kind] = due.get(event.kind, 0) + 1
    cpu = [share for _, share, _ in samples]
    return {
        "seconds": time.monotonic() - start,
        "due": due,
        "events": {kind: aio.summary([latency for _, latency in done]) for kind, done in tally.done.items()},
        "windows": {kind: aio.windows(done, WINDOW_SECONDS, seconds) for kind, done in tally.done.items()},
        "errors": tally.errors,
        "error_statuses": tally.statuses,
        "scrape": aio.summary([latency for _, latency, _ in scrapes]),
        "scrapes": scrapes,
        "samples": samples,
        "cpu_share": sum(cpu) / len(cpu) if cpu else None,
    }


async def _fill(
    connections: aio.Connections, names: Sequence[tuple[str, str]], work: Work, budget: float
) -> dict[str, Any]:
    """Every replica starts, ``FILL_IN_FLIGHT`` at a time, within ``budget`` seconds.

    Each with its heartbeat promise, as the plugin starts a server: a replica started first must hear its first
    heartbeat before it expires, so the fill must take less than ``FILL_BEFORE_EXPIRY`` (``_timeline`` says when not).
    """
    events = [work.start(0.0, "start", d, replica, "run-0", 1000) for d, replica in names]
    tally = aio.Tally()
    start = time.monotonic()
    await aio.drive(connections, events, FILL_IN_FLIGHT, start, start + budget, tally)
    seconds = time.monotonic() - start
    started = len(tally.done.get("start", []))
    return {"replicas": started, "of": len(names), "seconds": seconds, "rate": started / seconds,
            "errors": tally.errors, "error_statuses": tally.statuses}  # fmt: skip


def run_server(
    server: Server, names: Sequence[tuple[str, str]], work: Work, phase_seconds: float, fill_budget: float
) -> dict[str, Any]:
    """The whole timeline against one freshly started server."""
    time.sleep(1.0)
    result: dict[str, Any] = {"empty_rss_mb": rss_mb(server.pid)}
    result.update(asyncio.run(_timeline(server, names, work, phase_seconds, fill_budget)))
    result["peak_rss_mb"] = peak_rss_mb(server.pid)
    return result


async def _timeline(
    server: Server, names: Sequence[tuple[str, str]], work: Work, phase_seconds: float, fill_budget: float
) -> dict[str, Any]:
    """Fill, then the phases, on the connections the clients keep throughout."""
    connections = aio.Connections(server.port)
    try:
        print(f"bench --fleet: {work.kind}, {len(names)} replicas: fill", file=sys.stderr, flush=True)
        result: dict[str, Any] = {"fill": await _fill(connections, names, work, fill_budget)}
        if work.kind == "exporter" and result["fill"]["seconds"] > FILL_BEFORE_EXPIRY:
            print(f"bench --fleet: the fill took {result['fill']['seconds']:.0f} s: the first replicas may expire "
                  "before their first heartbeat", file=sys.stderr, flush=True)  # fmt: skip
        # As Prometheus would have meanwhile: the phases start from a rendered exposition.
        await asyncio.to_thread(_scrape_once, server, "gzip")
        phases = {
            "quiet": ([], QUIET_SECONDS, None),
            "idle": ([], IDLE_SECONDS, PROBE_SCRAPE_SECONDS),
            "heartbeats": (heartbeats(names, work, phase_seconds), phase_seconds, PROMETHEUS_SCRAPE_SECONDS),
            "fleet": (heartbeats(names, work, phase_seconds) + restarts(names, work, phase_seconds), phase_seconds,
                      PROMETHEUS_SCRAPE_SECONDS),
        }  # fmt: skip
        result["phases"] = {}
        for name in FLOOR_PHASES if work.kind == "floor" else fleet_report.PHASES:
            events, seconds, scrape_every = phases[name]
            print(f"bench --fleet: {work.kind}, {len(names)} replicas: {name} {seconds:g} s", file=sys.stderr,
                  flush=True)  # fmt: skip
            result["phases"][name] = await _phase(server, connections, events, seconds, scrape_every, IN_FLIGHT)
        result["connections_opened"] = connections.opened
        return result
    finally:
        connections.close()


@contextlib.contextmanager
def _exporter(workdir: Path) -> Iterator[Server]:
    database = workdir / f"fleet-{time.monotonic_ns()}.db"
    command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(database), *EXPORTER_FLAGS]
    with Server("exporter", lambda port: [*command, "--web.listen-address", f"{HOST}:{port}"], "/-/healthy",
                workdir) as server:  # fmt: skip
        yield server


@contextlib.contextmanager
def _floor(workdir: Path) -> Iterator[Server]:
    body = workdir / "floor-scrape.txt"
    body.write_bytes(b"")
    with floor_server(body, workdir) as server:
        yield server


@contextlib.contextmanager
def _pushgateway(workdir: Path, binary: str) -> Iterator[Server]:
    command = [binary, "--persistence.file=", "--log.level=warn"]
    with Server("pushgateway", lambda port: [*command, f"--web.listen-address={HOST}:{port}"], "/-/ready",
                workdir) as server:  # fmt: skip
        yield server


def _scrape_once(server: Server, scrape_format: str = "text") -> bytes:
    client = Client(server.port)
    try:
        return client.scrape(scrape_format=scrape_format)
    finally:
        client.close()


def _template(server: Server) -> dict[str, str]:
    """The labels of one engine's ``cache_config_info`` as the exporter shows it, for Pushgateway's users to push."""
    line = next(iter(info_series(_scrape_once(server)).values()))
    return {name: value for name, value in labels(line).items() if name not in ("deployment", "replica", "engine")}


def measure(replicas: Sequence[int], phase_seconds: float, fill_budget: float, pushgateway: str) -> dict[str, Any]:
    """The exporter, Pushgateway and the floor at each N, one after the other, each started afresh."""
    results: dict[str, Any] = {
        "settings": {"replicas": list(replicas), "phase_seconds": phase_seconds, "quiet_seconds": QUIET_SECONDS,
                     "idle_seconds": IDLE_SECONDS,
                     "heartbeat_seconds": HEARTBEAT_SECONDS, "fill_budget_seconds": fill_budget,
                     "in_flight": IN_FLIGHT, "data_parallel": DATA_PARALLEL},
        "runs": {},
    }  # fmt: skip
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cce-fleet-") as tmp:
        workdir = Path(tmp)
        for n in replicas:
            names = replica_names(n)
            runs: dict[str, Any] = {}
            with _exporter(workdir) as exporter:
                runs["exporter"] = run_server(exporter, names, Work("exporter", {}), phase_seconds, float("inf"))
                template = _template(exporter)
            with _pushgateway(workdir, pushgateway) as gateway:
                runs["pushgateway"] = run_server(gateway, names, Work("pushgateway", template), phase_seconds,
                                                 fill_budget)  # fmt: skip
            with _floor(workdir) as floor:
                runs["floor"] = run_server(floor, names, Work("floor", {}), phase_seconds, float("inf"))
            results["runs"][str(n)] = runs
    results["run_seconds"] = time.monotonic() - begun
    return results


def pushgateway_binary() -> str:
    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        raise SystemExit("prometheus-pushgateway is not installed: apt-get install prometheus-pushgateway")
    return binary


def main(replicas: Sequence[int], phase_seconds: float, fill_budget: float, output: Path, plot: Path) -> int:
    """Measure, write the JSON and the plot, print the tables."""
    # This process holds a connection per server: the soft open-file limit up to the hard one.
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    results = measure(replicas, phase_seconds, fill_budget, pushgateway_binary())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results) + "\n")
    print(fleet_report.render(results))
    print(f"\nraw figures: {output}")
    fleet_report.plot(results, plot)
    print(f"plot: {plot}")
    return 0
