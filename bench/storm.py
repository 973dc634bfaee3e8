"""A restart storm: every vLLM server of a fleet re-registers at once while a scraper reads ``/metrics`` every second.

python -m bench.storm [--replicas 10000] [--connections 32] [--budget 300] [--output bench/results/storm.json]

A fresh exporter with the default limits (only ``--web.max-connections`` raised, one connection a server) takes
N vLLM servers of DP=8 as the fleet run starts them (``bench/fleet.py``: its labels, then its eight engines'
ready responses in one msgpack array; no heartbeats promised, as the run sends none), 8 at a time, and is
scraped once, as Prometheus would have meanwhile.
Then every server starts a new run at once (its labels and eight changed responses again) from ``--connections``
requests in flight, while a scraper asks for ``/metrics`` (gzip, as Prometheus does) every second on a
connection of its own. Reported: the seconds until every restart was acknowledged; until a scrape showed every
one of them (a text scrape after the last acknowledgement, every engine's ``num_gpu_blocks`` checked); every
scrape's duration during the storm; the exporter's RSS before and after, and its peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import aio
from bench.fleet import FILL_IN_FLIGHT, KEEP_ALIVE_SECONDS, SCRAPE, exporter_start, replica_names
from bench.load import DATA_PARALLEL, Client
from bench.procs import HOST, Server, peak_rss_mb, rss_mb

ROOT = Path(__file__).resolve().parents[1]
FILL_BLOCKS = 1000
STORM_BLOCKS = 3000
SCRAPE_SECONDS = 1.0
INFO = b"cache_config_info{"
_BLOCKS = re.compile(rb'[{,]num_gpu_blocks="(\d+)"')


def _starts(kind: str, names: Sequence[tuple[str, str]], run: str, blocks: int) -> list[aio.Event]:
    """Every server's start, all due at once, as the plugin sends it but promising no heartbeats: the run sends
    none, and a replica that promised them would expire while a slow fill or storm goes on."""
    return [
        aio.Event(0.0, kind, exporter_start(deployment, replica, run, blocks, heartbeats=False),
                  client=f"{deployment}/{replica}")
        for deployment, replica in names
    ]  # fmt: skip


async def _storm(server: Server, names: Sequence[tuple[str, str]], connections: int, budget: float) -> dict[str, Any]:
    """Fill, one scrape, then the storm with the scraper running until every restart is answered."""
    kept = aio.Connections(server.port)
    try:
        fill = aio.Tally()
        start = time.monotonic()
        events = _starts("start", names, "run-0", FILL_BLOCKS)
        await aio.drive(kept, events, FILL_IN_FLIGHT, start, start + budget, fill)
        filled = time.monotonic() - start
        await asyncio.to_thread(_scrape, server, "gzip")
        before = rss_mb(server.pid)
        storm = aio.Tally()
        events = _starts("restart", names, "run-1", STORM_BLOCKS)
        stop = asyncio.Event()
        start = time.monotonic()
        scraper = asyncio.create_task(aio.scrape(server.port, SCRAPE, SCRAPE_SECONDS, start, start + budget, stop))
        await aio.drive(kept, events, connections, start, start + budget, storm)
        acknowledged = time.monotonic() - start
        stop.set()
        scrapes = await scraper
        shown_engines = await asyncio.to_thread(_stormed_engines, server)
        shown = time.monotonic() - start
    finally:
        kept.close()
    return {
        "replicas": len(names),
        "engines": len(names) * DATA_PARALLEL,
        "connections": connections,
        "fill": {"seconds": filled, "taken": len(fill.done.get("start", [])), "errors": fill.errors,
                 "statuses": fill.statuses},
        "storm": {"acknowledged_seconds": acknowledged, "taken": len(storm.done.get("restart", [])),
                  "errors": storm.errors, "statuses": storm.statuses, "shown_seconds": shown,
                  "engines_shown": shown_engines, "restart_latency": aio.summary([lat for _, lat in
                                                                                   storm.done.get("restart", [])])},
        "scrapes": {"during": aio.summary([seconds for _, seconds, _ in scrapes]), "each": scrapes},
        "rss_mb": {"before_storm": before, "after": rss_mb(server.pid), "peak": peak_rss_mb(server.pid)},
    }  # fmt: skip


def _scrape(server: Server, scrape_format: str) -> bytes:
    client = Client(server.port, timeout=300)
    try:
        return client.scrape(scrape_format=scrape_format)
    finally:
        client.close()


def _stormed_engines(server: Server) -> int:
    """The engines (``cache_config_info`` lines) a text scrape shows with the storm's block counts."""
    lines = _scrape(server, "text").splitlines()
    return sum(1 for line in lines if line.startswith(INFO) and int(_BLOCKS.search(line)[1]) >= STORM_BLOCKS)  # type: ignore[index]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def render(result: dict[str, Any]) -> str:
    """The run's figures as a Markdown table."""
    storm, during, rss = result["storm"], result["scrapes"]["during"], result["rss_mb"]
    latency = storm["restart_latency"]
    rows = [
        ("vLLM servers of DP=8 (engines)", f"{result['replicas']:,} ({result['engines']:,})"),
        ("requests in flight", str(result["connections"])),
        ("fill: seconds, servers taken", f"{result['fill']['seconds']:.1f}, {result['fill']['taken']:,}"),
        ("storm: every restart acknowledged, s", f"{storm['acknowledged_seconds']:.1f}"),
        ("storm: restarts taken, errors", f"{storm['taken']:,}, {sum(storm['errors'].values())} {storm['statuses']}"),
        ("storm: shown by a scrape, s (engines shown)", f"{storm['shown_seconds']:.1f} ({storm['engines_shown']:,})"),
        (
            "restart latency p50 / p99 / max, ms",
            " / ".join(_ms(latency[key]) for key in ("p50_ms", "p99_ms", "max_ms")),
        ),
        ("scrapes during the storm", str(during["count"])),
        ("scrape p50 / p99 / max, ms", " / ".join(_ms(during[key]) for key in ("p50_ms", "p99_ms", "max_ms"))),
        (
            "RSS before the storm / after / peak, MiB",
            " / ".join(f"{rss[key]:.0f}" for key in ("before_storm", "after", "peak")),
        ),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.storm", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10_000, help="vLLM servers of DP=8")
    parser.add_argument("--connections", type=int, default=32, help="restarts in flight at once")
    parser.add_argument("--budget", type=float, default=300.0, help="most seconds the fill, and the storm, take")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "storm.json")
    args = parser.parse_args(argv)
    # This process holds a connection per server: the soft open-file limit up to the hard one.
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    with tempfile.TemporaryDirectory(prefix="cce-storm-") as tmp:
        workdir = Path(tmp)
        command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(workdir / "storm.db"),
                   "--log.level", "warning", "--web.max-connections", str(args.replicas + 100),
                   "--web.keep-alive-timeout", str(KEEP_ALIVE_SECONDS), "--web.listen-address"]  # fmt: skip
        with Server("exporter", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", workdir) as server:
            result = asyncio.run(_storm(server, replica_names(args.replicas), args.connections, args.budget))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result) + "\n")
    print(render(result))
    print(f"\nraw figures: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
