"""In-process baselines: prometheus_client rendering a Gauge as vLLM does, and a bare durable SQLite commit."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from bench.load import Engine, percentile


def prometheus_client_render(
    engines: Sequence[Engine], label_set: dict[str, str], reps: int, budget: float
) -> dict[str, Any]:
    """``generate_latest`` of a Gauge with the exporter's label set, one child per engine, timed alone.

    At most ``reps`` renders, and no new render once ``budget`` seconds have passed.
    """
    registry = CollectorRegistry()
    names = list(label_set)
    gauge = Gauge("cache_config_info", "Information of the LLMEngine CacheConfig.", names, registry=registry)
    for engine in engines:
        values = {**label_set, "deployment": engine.deployment, "engine": str(engine.rank)}
        gauge.labels(*(values[name] for name in names)).set(1)
    times, size = [], 0
    deadline = time.perf_counter() + budget
    for _ in range(reps):
        start = time.perf_counter()
        size = len(generate_latest(registry))
        times.append(time.perf_counter() - start)
        if time.perf_counter() > deadline:
            break
    return {
        "labels": len(names),
        "renders": len(times),
        "p50_ms": percentile(times, 50) * 1e3,
        "min_ms": min(times) * 1e3,
        "bytes": size,
    }


def sqlite_commit_rate(directory: Path, seconds: float) -> dict[str, Any]:
    """Commits per second of one 1 KiB row upsert in WAL mode with ``synchronous=FULL`` (the disk's floor)."""
    path = directory / "commit-floor.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB)")
        payload = bytes(1024)
        commits = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds and commits < 1_000_000:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (commits % 64, payload))
            db.execute("COMMIT")
            commits += 1
        elapsed = time.perf_counter() - start
    finally:
        db.close()
    return {"commits": commits, "seconds": elapsed, "rate": commits / elapsed}
