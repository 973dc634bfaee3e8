"""The fleet run's JSON as a markdown table (exporter, Pushgateway and the floor side by side, with the exporter's
ratio to each) and a PNG of CPU, RSS, scrape latency and heartbeat latency over time (matplotlib, the bench's
optional dependency). A run of an older bench, without the floor or the quiet phase, shows "-" for them."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import markdown_table, quotient, text_of

SERVERS = ("exporter", "pushgateway", "floor")
PHASES = ("quiet", "idle", "heartbeats", "fleet")


def _phase(run: dict[str, Any], phase: str, *path: str) -> Any:
    node: Any = run["phases"].get(phase)
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _cpu_above(run: dict[str, Any], phase: str, baseline: str) -> float | None:
    """The phase's CPU share above the baseline phase's, in % of a core."""
    share, base = _phase(run, phase, "cpu_share"), _phase(run, baseline, "cpu_share")
    return None if share is None or base is None else 100 * (share - base)


def _done(run: dict[str, Any], phase: str, kind: str) -> str:
    due = _phase(run, phase, "due", kind)
    if not due:
        return "-"
    return f"{_phase(run, phase, 'events', kind, 'count') or 0:,} / {due:,}"


def _per_engine_kib(run: dict[str, Any], engines: int) -> float | None:
    peak, empty = run.get("peak_rss_mb"), run.get("empty_rss_mb")
    return None if peak is None or empty is None else (peak - empty) * 1024 / engines


# Whom the exporter's figure is divided by in a row: both peers, Pushgateway alone (a scrape of the floor is of
# nothing), or neither (a count, or a difference).
BOTH, PUSHGATEWAY, NEITHER = ("pushgateway", "floor"), ("pushgateway",), ()
# (row name, figure of one server's run, the peers a ratio is shown against)
Row = tuple[str, Callable[[dict[str, Any], int], Any], tuple[str, ...]]
ROWS: list[Row] = [
    ("replicas started in the fill", lambda run, n: f"{run['fill']['replicas']:,} / {run['fill']['of']:,}", NEITHER),
    ("fill, replicas a second", lambda run, n: run["fill"]["rate"], BOTH),
    ("RSS of the empty process, MiB", lambda run, n: run["empty_rss_mb"], BOTH),
    ("peak RSS, MiB", lambda run, n: run["peak_rss_mb"], BOTH),
    ("peak RSS above the empty process, KiB an engine", lambda run, n: _per_engine_kib(run, 8 * n), BOTH),
    ("quiet: CPU, % of a core (nothing sent or scraped)", lambda run, n: _percent(_phase(run, "quiet", "cpu_share")),
     BOTH),
    ("idle: CPU, % of a core (scrapes every second)", lambda run, n: _percent(_phase(run, "idle", "cpu_share")),
     PUSHGATEWAY),
    ("idle: scrape p99 ms", lambda run, n: _phase(run, "idle", "scrape", "p99_ms"), PUSHGATEWAY),
    ("heartbeats: CPU, % of a core", lambda run, n: _percent(_phase(run, "heartbeats", "cpu_share")), BOTH),
    ("heartbeats: CPU above quiet, % of a core (8 scrapes in it)",
     lambda run, n: _cpu_above(run, "heartbeats", "quiet"), BOTH),
    ("heartbeats: CPU above idle, % of a core (idle: a scrape a second)",
     lambda run, n: _cpu_above(run, "heartbeats", "idle"), NEITHER),
    ("heartbeats: done / due", lambda run, n: _done(run, "heartbeats", "heartbeat"), NEITHER),
    ("heartbeats: heartbeat p50 ms", lambda run, n: _phase(run, "heartbeats", "events", "heartbeat", "p50_ms"), BOTH),
    ("heartbeats: heartbeat p99 ms", lambda run, n: _phase(run, "heartbeats", "events", "heartbeat", "p99_ms"), BOTH),
    ("heartbeats: scrape p99 ms (every 15 s: the slowest)",
     lambda run, n: _phase(run, "heartbeats", "scrape", "p99_ms"), PUSHGATEWAY),
    ("heartbeats: scrape p99 / idle scrape p99",
     lambda run, n: quotient(_phase(run, "heartbeats", "scrape", "p99_ms"), _phase(run, "idle", "scrape", "p99_ms")),
     NEITHER),
    ("fleet: CPU, % of a core", lambda run, n: _percent(_phase(run, "fleet", "cpu_share")), PUSHGATEWAY),
    ("fleet: heartbeats done / due", lambda run, n: _done(run, "fleet", "heartbeat"), NEITHER),
    ("fleet: heartbeat p99 ms", lambda run, n: _phase(run, "fleet", "events", "heartbeat", "p99_ms"), PUSHGATEWAY),
    ("fleet: restarts done / due", lambda run, n: _done(run, "fleet", "restart"), NEITHER),
    ("fleet: restart p99 ms", lambda run, n: _phase(run, "fleet", "events", "restart", "p99_ms"), PUSHGATEWAY),
    ("fleet: scrape p99 ms (every 15 s: the slowest)", lambda run, n: _phase(run, "fleet", "scrape", "p99_ms"),
     PUSHGATEWAY),
    ("requests failed (all phases)",
     lambda run, n: sum(sum(phase["errors"].values()) for phase in run["phases"].values()), NEITHER),
]  # fmt: skip


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else text_of(value)


def render(results: dict[str, Any]) -> str:
    """One table per N: each measurement for each server, and the exporter's ratio to Pushgateway and to the floor
    (only where the two measure the same thing)."""
    settings = results["settings"]
    lines = [
        f"## Fleet run: {settings['phase_seconds']:g} s per phase, heartbeats every "
        f"{settings['heartbeat_seconds']:g} s, DP={settings['data_parallel']}; the run took "
        f"{results['run_seconds'] / 60:.1f} min",
    ]
    for n, runs in results["runs"].items():
        replicas = int(n)
        rows = []
        for name, figure, peers in ROWS:
            values = dict.fromkeys(SERVERS)
            values.update({server: figure(runs[server], replicas) for server in SERVERS if server in runs})
            shares = [quotient(values["exporter"], values[peer]) if peer in peers else None for peer in SERVERS[1:]]
            rows.append([name, *map(_cell, values.values()), *(text_of(share, 3) for share in shares)])
        header = ["measurement", "exporter", "Pushgateway", "floor", "exporter / Pushgateway", "exporter / floor"]
        lines += [
            "",
            f"### {replicas:,} replicas x 8 engines = {8 * replicas:,} engines",
            "",
            markdown_table(header, rows),
        ]
    return "\n".join(lines)


# A phase a server did not run: no samples, scrapes or heartbeats.
_NOTHING: dict[str, Any] = {"samples": [], "scrapes": [], "windows": {}}


def _lengths(settings: dict[str, Any]) -> tuple[float, ...]:
    """Each phase's seconds, in the order of ``PHASES`` (0 for a quiet phase an older run did not have)."""
    phase = settings["phase_seconds"]
    return settings.get("quiet_seconds", 0.0), settings["idle_seconds"], phase, phase


def _timeline(run: dict[str, Any], settings: dict[str, Any], pick: Callable[[dict[str, Any]], list[list[Any]]],
              x: int, y: int) -> tuple[list[float], list[float]]:  # fmt: skip
    """(time since the fill ended, value) of every row ``pick`` takes from each phase the run has, in order."""
    times, values, offset = [], [], 0.0
    for phase, seconds in zip(PHASES, _lengths(settings), strict=True):
        for row in pick(run["phases"].get(phase, _NOTHING)):
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
    styles = {"exporter": "-", "pushgateway": "--", "floor": ":"}
    for axis, (title, pick, log) in zip(axes, panels, strict=True):
        for n, runs in results["runs"].items():
            for server in filter(runs.__contains__, SERVERS):
                times, values = _timeline(runs[server], settings, pick, 0, 1)
                axis.plot(times, values, styles[server], label=f"{server}, {int(n) * 8:,} engines", linewidth=1)
        for edge in itertools.accumulate(_lengths(settings)[:-1]):
            if edge:
                axis.axvline(edge, color="grey", linewidth=0.5)
        axis.set_ylabel(title)
        if log:
            axis.set_yscale("log")
        axis.grid(True, linewidth=0.3)
    axes[0].legend(fontsize=8)
    title = (
        "quiet | idle | heartbeats (N/30 a second) | fleet (heartbeats, rolling restart of 10 %, scrapes every "
        "15 s); the floor: quiet and heartbeats"
    )
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("seconds since the fill ended")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    pyplot.close(figure)
