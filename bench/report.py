"""The run's JSON as markdown tables: raw figures, ratios against each peer and the floor, and the performance
targets (scrape, ingest, memory, read-your-writes) with their verdicts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# gzip and OpenMetrics "cost no more than plain text": a p50 up to 10 % above text's is taken as noise.
NOISE = 1.10
# A wrk run during which other processes, or the hypervisor (steal), took more than this share of one core
# is flagged as disturbed.
DISTURBED = 0.10


@dataclass(frozen=True)
class Target:
    """A performance target: a measured ratio or figure against its limit."""

    name: str
    value: float | None
    limit: float
    at_most: bool
    detail: str
    disturbed: bool = False

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        passed = self.value <= self.limit if self.at_most else self.value >= self.limit
        return ("pass" if passed else "FAIL") + (" (disturbed)" if self.disturbed else "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def _get(results: dict[str, Any], n: int, *path: str) -> Any:
    """``results["engines"][n][path...]``, or ``None`` where that N or figure was not measured."""
    node: Any = results["engines"].get(str(n))
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def text_of(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _compare(
    results: dict[str, Any], name: str, limit: float, at_most: bool, a: tuple[Any, ...], b: tuple[Any, ...]
) -> Target:
    """A target on the ratio of two figures, each given as (N, *path)."""
    first, second = _get(results, *a), _get(results, *b)
    detail = f"{text_of(first)} / {text_of(second)}" if first is not None and second is not None else "not measured"
    disturbed = any(_disturbance(_get(results, *path[:-1]) or {}) > DISTURBED for path in (a, b))
    return Target(name, quotient(first, second), limit, at_most, detail, disturbed)


def _disturbance(run: dict[str, Any]) -> float:
    """The share of a core that other processes and the hypervisor took during one wrk run."""
    return max(run.get("other_cpu_share", 0.0), run.get("steal_share", 0.0))


def targets(results: dict[str, Any]) -> list[Target]:
    """The performance targets, evaluated on one run ("n/a" where the run did not measure that N)."""
    text_p50 = ("scrape", "exporter_text", "p50_ms")
    found = [
        _compare(results, "scrape p50 at 1000 <= 0.1 x Pushgateway", 0.1, True,
                 (1000, *text_p50), (1000, "scrape", "pushgateway_text", "p50_ms")),
        _compare(results, "scrape req/s at 1000 >= 0.6 x floor (same bytes)", 0.6, False,
                 (1000, "scrape", "exporter_text", "rate"), (1000, "scrape", "floor_text", "rate")),
        _compare(results, "scrape p50 at 10000 <= 0.05 x Pushgateway", 0.05, True,
                 (10000, *text_p50), (10000, "scrape", "pushgateway_text", "p50_ms")),
    ]  # fmt: skip
    for n in (1000, 10000):
        for variant, label in (("exporter_gzip", "gzip"), ("exporter_openmetrics", "OpenMetrics")):
            found.append(
                _compare(results, f"{label} p50 at {n} <= text p50 (x{NOISE:g} noise)", NOISE, True,
                         (n, "scrape", variant, "p50_ms"), (n, *text_p50))
            )  # fmt: skip
    ingest_1 = ("ingest", "exporter_1", "rate")
    found += [
        _compare(results, "ingest 1 conn at 1000 >= 10 x Pushgateway push rate", 10, False,
                 (1000, *ingest_1), (1000, "ingest", "pushgateway_1", "rate")),
        _compare(results, "ingest 1 conn at 1000 >= 0.25 x floor POST rate", 0.25, False,
                 (1000, *ingest_1), (1000, "ingest", "floor_1", "rate")),
    ]  # fmt: skip
    for n in results["engines"]:
        if _get(results, int(n), *ingest_1) is not None:
            found += [
                _compare(results, f"ingest 1 conn at {n} >= 0.5 x the floor committing each POST", 0.5, False,
                         (int(n), *ingest_1), (int(n), "ingest", "floor_commit_1", "rate")),
                _compare(results, f"ingest 8 conns at {n} >= 3 x 1 conn", 3, False,
                         (int(n), "ingest", "exporter_8", "rate"), (int(n), *ingest_1)),
            ]  # fmt: skip
    found += [
        _compare(results, "ingest 1 conn at 10000 >= 0.8 x at 100", 0.8, False, (10000, *ingest_1), (100, *ingest_1)),
        _compare(results, "ingest 1 conn at 80000 >= 0.9 x at 100", 0.9, False, (80000, *ingest_1), (100, *ingest_1)),
    ]  # fmt: skip
    for n in (1000, 10000, 80000):
        engines = _engines_per_second(results, n, "exporter_dp8_1")
        floor = _get(results, n, "ingest", "floor_1", "rate")
        if engines is not None:
            found.append(Target(f"DP=8 arrays: engines/s at {n} >= 0.25 x floor POST rate", quotient(engines, floor),
                                0.25, False, f"{text_of(engines)} / {text_of(floor)}"))  # fmt: skip
    rss = _get(results, 10000, "peak_rss_mb", "exporter")
    found.append(Target("peak RSS at 10000 < 150 MB", rss, 150, True, f"{text_of(rss)} MB" if rss else "not measured"))
    for n in (10000, 80000):
        per_engine = _rss_per_engine_kib(results, n)
        if per_engine is not None:
            found.append(Target(f"peak RSS above the empty process at {n} < 5 KiB an engine", per_engine, 5, True,
                                f"{text_of(per_engine)} KiB"))  # fmt: skip
    missed = sum(
        (_get(results, int(n), "visible", "violations") or 0) + (_get(results, int(n), "visible", "never_visible") or 0)
        for n in results["engines"]
    )
    found.append(Target("read-your-writes: first scrape after 2xx shows it", missed, 0, True, f"{missed} missed"))
    errors = sum(
        run["errors"]
        for n in results["engines"]
        for run in (_get(results, int(n), "ingest") or {}).values()
        if run is not None
    )
    found.append(Target("every wrk ingest request answered 2xx", errors, 0, True, f"{errors} errors"))
    return found


def _engines_per_second(results: dict[str, Any], n: int, run: str) -> float | None:
    """Ready responses a second of a run of DP=8 arrays (eight in each request)."""
    rate = _get(results, n, "ingest", run, "rate")
    return None if rate is None else 8 * rate


def _cpu_ms_per_request(results: dict[str, Any], n: int, run: str) -> float | None:
    """The exporter's CPU milliseconds per request of a wrk run (that run alone against it)."""
    cpu, requests = _get(results, n, "ingest", run, "exporter_cpu_seconds"), _get(results, n, "ingest", run, "requests")
    return None if cpu is None or not requests else 1e3 * cpu / requests


def _rss_per_engine_kib(results: dict[str, Any], n: int) -> float | None:
    """The exporter's peak RSS after ``n`` engines above its RSS before it held any, per engine."""
    peak, empty = _get(results, n, "peak_rss_mb", "exporter"), results.get("empty_rss_mb", {}).get("exporter")
    return None if peak is None or empty is None else (peak - empty) * 1024 / n


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _rows(results: dict[str, Any], columns: list[Callable[[int], str]], need: str | None = None) -> list[list[str]]:
    """One row per N (only N with ``need`` measured, if given), one cell per column function."""
    ns = [int(n) for n in results["engines"] if need is None or _get(results, int(n), need) is not None]
    return [[f"{n:,}", *(column(n) for column in columns)] for n in ns]


def _scrape_tables(results: dict[str, Any]) -> list[str]:
    def figure(run: str, key: str) -> Callable[[int], str]:
        return lambda n: text_of(_get(results, n, "scrape", run, key))

    def ratio(run_a: str, run_b: str, key: str) -> Callable[[int], str]:
        return lambda n: text_of(
            quotient(_get(results, n, "scrape", run_a, key), _get(results, n, "scrape", run_b, key)), 3
        )

    raw = markdown_table(
        ["engines", "body KB", "text p50 ms", "text p99 ms", "text req/s", "OpenMetrics p50 ms", "gzip p50 ms",
         "Pushgateway p50 ms", "Pushgateway req/s", "floor p50 ms", "floor req/s", "prometheus_client render ms"],
        _rows(results, [
            lambda n: text_of(_get(results, n, "scrape_body_bytes") / 1e3, 1),
            figure("exporter_text", "p50_ms"), figure("exporter_text", "p99_ms"), figure("exporter_text", "rate"),
            figure("exporter_openmetrics", "p50_ms"), figure("exporter_gzip", "p50_ms"),
            figure("pushgateway_text", "p50_ms"), figure("pushgateway_text", "rate"),
            figure("floor_text", "p50_ms"), figure("floor_text", "rate"),
            lambda n: text_of(_get(results, n, "prometheus_client_render", "p50_ms")),
        ]),
    )  # fmt: skip
    ratios = markdown_table(
        ["engines", "text p50 / Pushgateway", "text req/s / floor", "text p50 / prometheus_client render",
         "OpenMetrics / text p50", "gzip / text p50"],
        _rows(results, [
            ratio("exporter_text", "pushgateway_text", "p50_ms"), ratio("exporter_text", "floor_text", "rate"),
            lambda n: text_of(quotient(_get(results, n, "scrape", "exporter_text", "p50_ms"),
                                  _get(results, n, "prometheus_client_render", "p50_ms")), 3),
            ratio("exporter_openmetrics", "exporter_text", "p50_ms"), ratio("exporter_gzip", "exporter_text", "p50_ms"),
        ]),
    )  # fmt: skip
    return ["### Scrape (wrk, 1 connection)", raw, "", "Ratios:", "", ratios]


def _ingest_tables(results: dict[str, Any]) -> list[str]:
    def rate(run: str, key: str = "rate") -> Callable[[int], str]:
        return lambda n: text_of(_get(results, n, "ingest", run, key))

    def ratio(run_a: str, run_b: str) -> Callable[[int], str]:
        return lambda n: text_of(
            quotient(_get(results, n, "ingest", run_a, "rate"), _get(results, n, "ingest", run_b, "rate"))
        )

    def fill(server: str, key: str) -> Callable[[int], str]:
        return lambda n: text_of(_get(results, n, "fill", server, key))

    fills = markdown_table(
        ["engines", "exporter fill /s", "exporter /s, last 10 %", "Pushgateway fill /s", "Pushgateway /s, last 10 %"],
        _rows(results, [fill("exporter", "rate"), fill("exporter", "tail_rate"),
                        fill("pushgateway", "rate"), fill("pushgateway", "tail_rate")]),
    )  # fmt: skip
    ingest = markdown_table(
        ["engines", "exporter 1 conn /s", "p50 ms", "p99 ms", "exporter 8 conns /s", "floor POST 1 conn /s",
         "floor POST 8 conns /s", "floor POST+commit 1 conn /s", "floor POST+commit 8 conns /s",
         "Pushgateway push 1 conn /s", "1 conn / Pushgateway", "1 conn / floor", "1 conn / commit floor",
         "8 conns / commit floor 8 conns", "8 conns / 1 conn", "DP=8 arrays 1 conn engines/s",
         "arrays engines/s / floor", "heartbeats 1 conn /s", "exporter CPU ms a heartbeat", "errors",
         "bare SQLite commit /s"],
        _rows(results, [
            rate("exporter_1"), rate("exporter_1", "p50_ms"), rate("exporter_1", "p99_ms"), rate("exporter_8"),
            rate("floor_1"), rate("floor_8"), rate("floor_commit_1"), rate("floor_commit_8"), rate("pushgateway_1"),
            ratio("exporter_1", "pushgateway_1"), ratio("exporter_1", "floor_1"), ratio("exporter_1", "floor_commit_1"),
            ratio("exporter_8", "floor_commit_8"), ratio("exporter_8", "exporter_1"),
            lambda n: text_of(_engines_per_second(results, n, "exporter_dp8_1")),
            lambda n: text_of(quotient(_engines_per_second(results, n, "exporter_dp8_1"),
                                       _get(results, n, "ingest", "floor_1", "rate"))),
            rate("exporter_heartbeat_1"),
            lambda n: text_of(_cpu_ms_per_request(results, n, "exporter_heartbeat_1"), 3),
            lambda n: str(sum(run["errors"] for run in _get(results, n, "ingest").values())),
            lambda n: text_of(_get(results, n, "sqlite_commit", "rate")),
        ], need="ingest"),
    )  # fmt: skip
    return [
        "### Fill (Python client, 1 connection, sequential)", fills, "",
        "### Ingest, every request changing state (wrk)", ingest, "",
        "Commit floor: the floor committing each POST's body as one SQLite row (WAL, synchronous=FULL, inline on its "
        "event loop) before the 200, on the same requests: a naive durable ingest. Bare SQLite commit: one 1 KiB row "
        "per commit, no HTTP, same disk, right after the ingest runs.",
    ]  # fmt: skip


def _other_tables(results: dict[str, Any]) -> list[str]:
    def visible(key: str) -> Callable[[int], str]:
        return lambda n: text_of(_get(results, n, "visible", key))

    def rss(server: str) -> Callable[[int], str]:
        return lambda n: text_of(_get(results, n, "peak_rss_mb", server), 1)

    def cpu(n: int) -> str:
        other, wall = _get(results, n, "cpu", "other_seconds"), _get(results, n, "cpu", "wall_seconds")
        return f"{text_of(other, 1)} / {text_of(wall, 0)}"

    table = markdown_table(
        ["engines", "POST ack p50 ms", "visible p50 ms", "visible p99 ms", "reps", "not on first scrape",
         "never visible", "exporter peak RSS MB", "exporter above empty, KiB an engine", "Pushgateway peak RSS MB",
         "other processes' CPU s / wall s"],
        _rows(results, [visible("ack_p50_ms"), visible("visible_p50_ms"), visible("visible_p99_ms"), visible("reps"),
                        visible("violations"), visible("never_visible"), rss("exporter"),
                        lambda n: text_of(_rss_per_engine_kib(results, n)), rss("pushgateway"), cpu]),
    )  # fmt: skip
    lines = ["### Ingest-to-visible (Python client: POST, then scrape until shown) and peak RSS", table]
    for n in results["engines"]:
        both = _get(results, int(n), "scrape_during_ingest")
        if both:
            scrape, ingest = both["scrape"], both["ingest"]
            lines += [
                "",
                f"At {int(n):,} engines, scrapes and ingest at once (wrk, 1 connection each): ingest "
                f"{text_of(ingest['rate'])}/s, p50 {text_of(ingest['p50_ms'])} ms, p99 {text_of(ingest['p99_ms'])} ms; "
                f"scrape p50 {text_of(scrape['p50_ms'])} ms, {text_of(scrape['rate'])}/s.",
            ]
    return lines


def render(results: dict[str, Any]) -> str:
    """All tables of a run, in markdown."""
    meta = results["meta"]
    machine, versions = meta["machine"], meta["versions"]
    header = [
        f"## Benchmark run {meta['date']}",
        "",
        f"Machine: {machine['nproc']} cores, {machine['cpu']}, {machine['memory_gib']} GiB, "
        f"kernel {machine['kernel']}. "
        f"Python {versions['python']}, exporter {versions['exporter']} ({versions['exporter_commit']}), "
        f"{versions['pushgateway']}, {versions['wrk']}, prometheus_client {versions['prometheus_client']}. "
        f"Pushgateway: {meta['settings']['pushgateway']}. wrk: {meta['settings']['wrk']}. "
        f"The run took {meta.get('run_seconds', 0) / 60:.1f} min.",
        "",
    ]
    cpu = [_get(results, int(n), "cpu") for n in results["engines"]]
    other = sum(c["other_seconds"] for c in cpu if c)
    wall = sum(c["wall_seconds"] for c in cpu if c)
    if wall and other > 0.05 * wall:
        header += [
            f"**Disturbed run:** other processes used {other:,.0f} CPU-seconds during its {wall:,.0f} s "
            f"({100 * other / wall:.0f} % of one core); figures are noisier than on an idle machine.",
            "",
        ]
    disturbed = [
        f"{name} at {int(n):,} ({100 * _disturbance(run):.0f} %)"
        for n in results["engines"]
        for group in ("scrape", "ingest")
        for name, run in (_get(results, int(n), group) or {}).items()
        if _disturbance(run) > DISTURBED
    ]
    if disturbed:
        header += [f"Measurements during which other processes or the hypervisor took over {DISTURBED:.0%} of a "
                   "core: " + ", ".join(disturbed) + ".", ""]  # fmt: skip
    found = [Target(**{k: v for k, v in t.items() if k != "verdict"}) for t in results["targets"]]
    verdicts = markdown_table(
        ["target", "measured", "ratio or figure", "limit", "result"],
        [
            [t.name, t.detail, text_of(t.value, 3), ("<= " if t.at_most else ">= ") + f"{t.limit:g}", t.verdict]
            for t in found
        ],
    )
    sections = [*_scrape_tables(results), "", *_ingest_tables(results), "", *_other_tables(results), ""]
    return "\n".join([*header, "### Performance targets", verdicts, "", *sections])
