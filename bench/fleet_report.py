"""The fleet run's JSON as a markdown table (exporter and Pushgateway side by side, with their ratio) and a PNG of
CPU, RSS, scrape latency and heartbeat latency over time (matplotlib, the bench's optional dependency)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import markdown_table, quotient, text_of

SERVERS = ("exporter", "pushgateway")
PHASES = ("idle", "heartbeats", "fleet")


def _phase(run: dict[str, Any], phase: str, *path: str) -> Any:
    node: Any = run["phases"][phase]
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _done(run: dict[str, Any], phase: str, kind: str) -> str:
    due = _phase(run, phase, "due", kind)
    if not due:
        return "-"
    return f"{_phase(run, phase, 'events', kind, 'count') or 0:,} / {due:,}"


def _per_engine_kib(run: dict[str, Any], engines: int) -> float | None:
    peak, empty = run.get("peak_rss_mb"), run.get("empty_rss_mb")
    return None if peak is None or empty is None else (peak - empty) * 1024 / engines


# (row name, figure of one server's run, whether a ratio of the two servers says something)
Row = tuple[str, Callable[[dict[str, Any], int], Any], bool]
ROWS: list[Row] = [
    ("replicas started in the fill", lambda run, n: f"{run['fill']['replicas']:,} / {run['fill']['of']:,}", False),
    ("fill, replicas a second", lambda run, n: run["fill"]["rate"], True),
    ("RSS of the empty process, MiB", lambda run, n: run["empty_rss_mb"], True),
    ("peak RSS, MiB", lambda run, n: run["peak_rss_mb"], True),
    ("peak RSS above the empty process, KiB an engine", lambda run, n: _per_engine_kib(run, 8 * n), True),
    ("idle: CPU, % of a core (scrapes every second)", lambda run, n: _percent(_phase(run, "idle", "cpu_share")), True),
    ("idle: scrape p99 ms", lambda run, n: _phase(run, "idle", "scrape", "p99_ms"), True),
    ("heartbeats: CPU, % of a core", lambda run, n: _percent(_phase(run, "heartbeats", "cpu_share")), True),
    ("heartbeats: CPU above idle, % of a core",
     lambda run, n: _percent(_phase(run, "heartbeats", "cpu_share") - _phase(run, "idle", "cpu_share")), False),
    ("heartbeats: done / due", lambda run, n: _done(run, "heartbeats", "heartbeat"), False),
    ("heartbeats: heartbeat p50 ms", lambda run, n: _phase(run, "heartbeats", "events", "heartbeat", "p50_ms"), True),
    ("heartbeats: heartbeat p99 ms", lambda run, n: _phase(run, "heartbeats", "events", "heartbeat", "p99_ms"), True),
    ("heartbeats: scrape p99 ms (every 15 s: the slowest)",
     lambda run, n: _phase(run, "heartbeats", "scrape", "p99_ms"), True),
    ("heartbeats: scrape p99 / idle scrape p99",
     lambda run, n: quotient(_phase(run, "heartbeats", "scrape", "p99_ms"), _phase(run, "idle", "scrape", "p99_ms")),
     False),
    ("fleet: CPU, % of a core", lambda run, n: _percent(_phase(run, "fleet", "cpu_share")), True),
    ("fleet: heartbeats done / due", lambda run, n: _done(run, "fleet", "heartbeat"), False),
    ("fleet: heartbeat p99 ms", lambda run, n: _phase(run, "fleet", "events", "heartbeat", "p99_ms"), True),
    ("fleet: restarts done / due", lambda run, n: _done(run, "fleet", "restart"), False),
    ("fleet: restart p99 ms", lambda run, n: _phase(run, "fleet", "events", "restart", "p99_ms"), True),
    ("fleet: scrape p99 ms (every 15 s: the slowest)", lambda run, n: _phase(run, "fleet", "scrape", "p99_ms"), True),
    ("requests failed (all phases)",
     lambda run, n: sum(sum(_phase(run, phase, "errors").values()) for phase in PHASES), False),
]  # fmt: skip


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else text_of(value)


def render(results: dict[str, Any]) -> str:
    """One table per N: each measurement for the exporter and Pushgateway, and their ratio."""
    settings = results["settings"]
    lines = [
        f"## Fleet run: {settings['phase_seconds']:g} s per phase, heartbeats every "
        f"{settings['heartbeat_seconds']:g} s, DP={settings['data_parallel']}; the run took "
        f"{results['run_seconds'] / 60:.1f} min",
    ]
    for n, runs in results["runs"].items():
        replicas = int(n)
        rows = []
        for name, figure, ratio in ROWS:
            values = [figure(runs[server], replicas) for server in SERVERS]
            share = quotient(*values) if ratio and not any(isinstance(v, str) for v in values) else None
            rows.append([name, *map(_cell, values), text_of(share, 3)])
        header = ["measurement", "exporter", "Pushgateway", "exporter / Pushgateway"]
        lines += [
            "",
            f"### {replicas:,} replicas x 8 engines = {8 * replicas:,} engines",
            "",
            markdown_table(header, rows),
        ]
    return "\n".join(lines)


def _timeline(run: dict[str, Any], settings: dict[str, Any], pick: Callable[[dict[str, Any]], list[list[Any]]],
              x: int, y: int) -> tuple[list[float], list[float]]:  # fmt: skip
    """(time since the idle phase began, value) of every row ``pick`` takes from each phase, in order."""
    times, values, offset = [], [], 0.0
    for phase, seconds in zip(PHASES, (settings["idle_seconds"], settings["phase_seconds"], settings["phase_seconds"]),
                              strict=True):  # fmt: skip
        for row in pick(run["phases"][phase]):
            if row[y] is not None:
                times.append(offset + row[x])
                values.append(row[y])
        offset += seconds
    return times, values


def plot(results: dict[str, Any], path: Path) -> None:
    """Four panels over time, a line per server and N."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    settings = results["settings"]
    panels = [
        ("CPU, % of one core", lambda phase: [[t, 100 * share] for t, share, _ in phase["samples"]], False),
        ("RSS, MiB", lambda phase: [[t, rss] for t, _, rss in phase["samples"]], False),
        ("scrape latency, ms (each scrape)", lambda phase: [[t, 1e3 * s] for t, s, _ in phase["scrapes"]], True),
        ("heartbeat (push) p99, ms, per 5 s",
         lambda phase: [[t, None if p is None else 1e3 * p] for t, p, _ in phase["windows"].get("heartbeat", [])],
         True),
    ]  # fmt: skip
    figure, axes = pyplot.subplots(len(panels), 1, figsize=(10, 12), sharex=True)
    styles = {"exporter": "-", "pushgateway": "--"}
    for axis, (title, pick, log) in zip(axes, panels, strict=True):
        for n, runs in results["runs"].items():
            for server in SERVERS:
                times, values = _timeline(runs[server], settings, pick, 0, 1)
                axis.plot(times, values, styles[server], label=f"{server}, {int(n) * 8:,} engines", linewidth=1)
        boundary = settings["idle_seconds"]
        for edge in (boundary, boundary + settings["phase_seconds"]):
            axis.axvline(edge, color="grey", linewidth=0.5)
        axis.set_ylabel(title)
        if log:
            axis.set_yscale("log")
        axis.grid(True, linewidth=0.3)
    axes[0].legend(fontsize=8)
    title = "idle | heartbeats (N/30 a second) | fleet (heartbeats, rolling restart of 10 %, scrapes every 15 s)"
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("seconds since the fill ended")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
