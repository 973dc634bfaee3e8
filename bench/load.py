"""The work: engines in DP=8 deployments, their ready responses, the same series for Pushgateway, a Python client."""

from __future__ import annotations

import functools
import gzip
import http.client
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.procs import HOST

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-ready" / "dp2-rank0.msgpack"
DATA_PARALLEL = 8
MSGPACK = {"Content-Type": "application/vnd.msgpack"}
PUSH_TEXT = {"Content-Type": "text/plain; version=0.0.4"}
SCRAPE_FORMATS = {
    "text": {"Accept": "text/plain; version=0.0.4"},
    "openmetrics": {"Accept": "application/openmetrics-text; version=1.0.0"},
    "gzip": {"Accept": "text/plain; version=0.0.4", "Accept-Encoding": "gzip"},
}

_INFO_LINE = re.compile(rb"^cache_config_info\{.*$", re.MULTILINE)
_DEPLOYMENT = re.compile(rb'[{,]deployment="([^"]*)"')
_ENGINE = re.compile(rb'[{,]engine="(\d+)"')
_NUM_GPU_BLOCKS = re.compile(rb'([{,])num_gpu_blocks="[^"]*"')
_BLOCK_SIZE = re.compile(rb'[{,]block_size="(\d+)"')
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Request:
    """One HTTP request of the work, independent of the server it goes to."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""


@dataclass(frozen=True)
class Engine:
    """One engine: its deployment, its data-parallel rank and its deployment's data-parallel size."""

    deployment: str
    rank: int
    size: int

    @property
    def ingest_path(self) -> str:
        return f"/api/v1/deployments/{self.deployment}/ready"

    @property
    def push_path(self) -> str:
        return f"/metrics/job/cache_config/deployment/{self.deployment}/engine/{self.rank}"


def engines(count: int) -> list[Engine]:
    """``count`` engines in deployments of DP=8 (a single engine: one deployment of DP=1)."""
    size = 1 if count == 1 else DATA_PARALLEL
    return [Engine(f"bench-{k // size:04d}", k % size, size) for k in range(count)]


def spread(population: Sequence[Engine], count: int) -> list[Engine]:
    """At most ``count`` engines spread evenly over ``population``."""
    count = min(count, len(population))
    return [population[i * len(population) // count] for i in range(count)]


@functools.cache
def fixture_response() -> dict[str, Any]:
    """The fixture's ready response as a dict: every engine of the work is a copy with a few fields changed."""
    return msgspec.msgpack.decode(FIXTURE.read_bytes())


def ready_request(engine: Engine, num_gpu_blocks: int, block_size: int | None = None) -> Request:
    """The fixture's ready response as sent by ``engine``, with the given block counts."""
    response = {
        **fixture_response(),
        "data_parallel_size": engine.size,
        "data_parallel_rank": engine.rank,
        "num_gpu_blocks": num_gpu_blocks,
    }
    if block_size is not None:
        response["block_size"] = block_size
    return Request("POST", engine.ingest_path, MSGPACK, msgspec.msgpack.encode(response))


def ingest_requests(targets: Sequence[Engine], value: int) -> list[Request]:
    """Two rounds over ``targets`` with ``value`` and ``value + 1`` blocks: cycled, every request changes state."""
    return [ready_request(engine, value + round_) for round_ in (0, 1) for engine in targets]


def ingest_arrays(population: Sequence[Engine], value: int, count: int = 8) -> list[Request]:
    """Two rounds over ``count`` full DP=8 deployments of ``population``, each request all eight engines' ready
    responses of one deployment in one msgpack array (as the plugin sends a server's start)."""
    ranks: dict[str, list[Engine]] = {}
    for engine in population:
        ranks.setdefault(engine.deployment, []).append(engine)
    full = [members for members in ranks.values() if len(members) == DATA_PARALLEL]
    chosen = [full[i * len(full) // min(count, len(full))] for i in range(min(count, len(full)))]
    return [
        Request("POST", members[0].ingest_path, MSGPACK,
                msgspec.msgpack.encode([msgspec.Raw(ready_request(e, value + round_).body) for e in members]))
        for round_ in (0, 1)
        for members in chosen
    ]  # fmt: skip


def heartbeat_requests(targets: Sequence[Engine]) -> list[Request]:
    """A heartbeat of each target's replica: it changes only when the replica was last seen. Its interval is a day,
    so that no replica of the run expires once the heartbeats stop."""
    path = "/api/v1/deployments/{}/heartbeat?interval=86400"
    return [Request("POST", path.format(engine.deployment), {}) for engine in targets]


def info_series(exposition: bytes) -> dict[tuple[str, int], bytes]:
    """The ``cache_config_info`` sample lines of a text exposition, by (deployment, engine)."""
    series = {}
    for match in _INFO_LINE.finditer(exposition):
        line = match.group(0)
        deployment, engine = _DEPLOYMENT.search(line), _ENGINE.search(line)
        if deployment and engine:
            series[deployment.group(1).decode(), int(engine.group(1))] = line
    return series


def labels(line: bytes) -> dict[str, str]:
    """The labels of one sample line (values as written: these carry no escapes)."""
    return {name.decode(): value.decode() for name, value in _LABEL.findall(line)}


def push_request(engine: Engine, line: bytes, num_gpu_blocks: int | None = None) -> Request:
    """A Pushgateway PUT of one info sample line as the gauge ``cache_config_info`` of the engine's group."""
    if num_gpu_blocks is not None:
        line = _NUM_GPU_BLOCKS.sub(rb'\1num_gpu_blocks="%d"' % num_gpu_blocks, line)
    body = b"# TYPE cache_config_info gauge\n" + line + b"\n"
    return Request("PUT", engine.push_path, PUSH_TEXT, body)


def push_requests(targets: Sequence[Engine], series: dict[tuple[str, int], bytes], value: int) -> list[Request]:
    """Two rounds of pushes over ``targets`` with different ``num_gpu_blocks``: every push changes state."""
    return [
        push_request(engine, series[engine.deployment, engine.rank], value + round_)
        for round_ in (0, 1)
        for engine in targets
    ]


def block_size_shown(exposition: bytes, deployment: str) -> int | None:
    """The ``block_size`` label of the deployment's ``cache_config_info``, or ``None`` if it has none."""
    needle = f'deployment="{deployment}"'.encode()
    at = exposition.find(needle)
    while at >= 0:
        start, end = exposition.rfind(b"\n", 0, at) + 1, exposition.find(b"\n", at)
        line = exposition[start : end if end >= 0 else len(exposition)]
        if line.startswith(b"cache_config_info{"):
            match = _BLOCK_SIZE.search(line)
            return int(match.group(1)) if match else None
        at = exposition.find(needle, at + 1)
    return None


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0-100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class Client:
    """A keep-alive HTTP/1.1 client of one loopback server that fails on any answer but 2xx."""

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self._connection = http.client.HTTPConnection(HOST, port, timeout=timeout)

    def send(self, request: Request) -> tuple[bytes, dict[str, str]]:
        """The answer's body and headers (lower-case names)."""
        self._connection.request(request.method, request.path, request.body or None, request.headers)
        response = self._connection.getresponse()
        body = response.read()
        if not 200 <= response.status < 300:
            raise RuntimeError(f"{request.method} {request.path}: HTTP {response.status}: {body[:500]!r}")
        return body, {name.lower(): value for name, value in response.getheaders()}

    def scrape(self, path: str = "/metrics", scrape_format: str = "text") -> bytes:
        """The exposition, decompressed if it came gzipped."""
        body, headers = self.send(Request("GET", path, SCRAPE_FORMATS[scrape_format]))
        return gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body

    def close(self) -> None:
        self._connection.close()


def timed_requests(port: int, requests: Sequence[Request], budget: float = 1800.0) -> dict[str, float]:
    """Send ``requests`` one after another on one connection: the overall rate and that of the last tenth.

    Raises ``TimeoutError`` once ``budget`` seconds have passed.
    """
    client = Client(port)
    times = []
    try:
        start = time.perf_counter()
        for request in requests:
            client.send(request)
            times.append(time.perf_counter())
            if times[-1] - start > budget:
                raise TimeoutError(f"{len(times)} of {len(requests)} requests took more than {budget:g} s")
    finally:
        client.close()
    if not times:
        return {"count": 0, "seconds": 0.0, "rate": 0.0, "tail_rate": 0.0}
    tail = max(1, len(times) // 10)
    tail_start = times[-tail - 1] if len(times) > tail else start
    return {
        "count": len(times),
        "seconds": times[-1] - start,
        "rate": len(times) / (times[-1] - start),
        "tail_rate": tail / (times[-1] - tail_start),
    }


def visible_latency(
    port: int, engine: Engine, reps: int, first_block_size: int, budget: float = 10.0
) -> dict[str, Any]:
    """Change the deployment's ``block_size`` ``reps`` times, each time scraping until the change shows.

    Scrapes cycle through text, OpenMetrics and gzip. A violation is a change that the first scrape
    after the 2xx did not show (read-your-writes); each change is given ``budget`` seconds at most.
    """
    client = Client(port)
    acked, visible, violations, never = [], [], 0, 0
    formats = list(SCRAPE_FORMATS)
    try:
        for rep in range(reps):
            wanted = first_block_size + rep
            scrape_format = formats[rep % len(formats)]
            start = time.perf_counter()
            client.send(ready_request(engine, 1000 + rep % 2, block_size=wanted))
            acked.append(time.perf_counter() - start)
            first = True
            while block_size_shown(client.scrape(scrape_format=scrape_format), engine.deployment) != wanted:
                first = False
                if time.perf_counter() - start > budget:
                    never += 1
                    break
            else:
                visible.append(time.perf_counter() - start)
                violations += not first
    finally:
        client.close()
    return {
        "reps": reps,
        "ack_p50_ms": percentile(acked, 50) * 1e3 if acked else None,
        "visible_p50_ms": percentile(visible, 50) * 1e3 if visible else None,
        "visible_p99_ms": percentile(visible, 99) * 1e3 if visible else None,
        "violations": violations,
        "never_visible": never,
    }
