"""The hostile-target reproductions of docs/RELIABILITY.md's probe section, at the reviewer's scale.

Each starts a real ``cache-config-exporter serve`` on loopback, points ``/probe`` at a hostile target
(``hostile.py``) and prints what it measured, one JSON object a line:

    python -m tests.probe.reproduce_hostile            # all, 30 s of looping probes (about 2 minutes)
    python -m tests.probe.reproduce_hostile --seconds 8 chunks samples

``test_probe_hostile.py`` runs the same functions, smaller, with the bounds they must keep.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from exporter.probe.prober import SUCCESS
from tests.helpers.health import health_latency
from tests.helpers.http import request
from tests.helpers.processes import memory_kib
from tests.probe import hostile
from tests.probe.test_probe import recorded_line, vllm_metrics
from tests.support import ExporterProcess, wait_until

LOOPBACK = "127.0.0.0/8"
# Heartbeats and scrapes timed with no probe running, the same machine's yardstick for those beside them.
IDLE_ROUNDS = 30


def exporter(directory: Path, *args: str) -> ExporterProcess:
    return ExporterProcess(directory / f"exporter-{time.monotonic_ns()}.db", *args).start()


def probe_results(served: ExporterProcess) -> dict[str, int]:
    """The exporter's probes so far, by result (the ones that happened)."""
    exposition = request(served.url, "GET", "/metrics").body.decode()
    counted = re.findall(r'^cache_config_exporter_probes_total\{result="(\w+)"\} (\S+)$', exposition, re.MULTILINE)
    return {result: int(float(value)) for result, value in counted if float(value)}


def under_load(served: ExporterProcess, target: str, clients: int, seconds: float) -> dict[str, object]:
    """``clients`` probing ``target`` for ``seconds`` (each at least once) beside heartbeats, scrapes and probes
    of a healthy vLLM target; then the exporter's CPU in the second that begins a second after the last
    answer, and its peak RSS above the RSS before."""
    assert served.process is not None
    with hostile.hostile(hostile.serving(vllm_metrics(recorded_line("qwen3-next")))) as healthy:
        with hostile.Beside(served.url, healthy.target) as idle:
            wait_until(lambda: len(idle.latencies["scrape"]) >= IDLE_ROUNDS, timeout=60)
        before = memory_kib(served.process.pid)["VmRSS"]
        with hostile.Beside(served.url, healthy.target) as beside:
            answers = hostile.probing(served.url, target, clients, seconds)
    cpu = hostile.cpu_after(served.process.pid)
    figures: dict[str, object] = {"clients": clients}
    for kind in beside.latencies:
        figures |= {f"idle_{kind}_p99_ms": round(hostile.percentile(idle.latencies[kind], 0.99) * 1000, 1),
                    f"{kind}s": len(beside.latencies[kind]), f"{kind}s_failed": beside.failed[kind],
                    f"{kind}_p99_ms": round(hostile.percentile(beside.latencies[kind], 0.99) * 1000, 1)}  # fmt: skip
    return figures | {
        "hostile_statuses": sorted({reply.status for reply, _ in answers}),
        "hostile_results": {result: n for result, n in probe_results(served).items() if result != SUCCESS},
        "hostile_longest_s": round(max(took for _, took in answers), 3),
        "cpu_seconds_in_the_second_after": round(cpu, 2),
        "rss_peak_above_start_mib": round((memory_kib(served.process.pid)["VmHWM"] - before) / 1024, 1),
    }


def chunks(directory: Path, clients: int = 6, seconds: float = 30.0, timeout: float = 10.0) -> dict[str, object]:
    """Finding 1: endless 1-byte chunks. ``/-/healthy`` during one probe, then ``clients`` probes looping for
    ``seconds``."""
    served = exporter(directory, "--probe.allowed-targets", LOOPBACK, "--probe.timeout", str(timeout))
    try:
        with hostile.hostile(hostile.tiny_chunks) as target:
            healthy: list[float] = []
            one = threading.Thread(target=lambda: hostile.probe(served.url, target.target))
            one.start()
            while one.is_alive():
                healthy.append(health_latency(served.url, 5.0))
            one.join()
            return {"finding": 1, "seconds": seconds, "timeout": timeout,
                    "healthy_p50_ms_during_one_probe": round(statistics.median(healthy) * 1000, 1),
                    **under_load(served, target.target, clients, seconds)}  # fmt: skip
    finally:
        served.stop()


def samples(directory: Path, clients: int = 12, count: int = 2_000_000) -> dict[str, object]:
    """Finding 2: a body of ``count`` tiny samples, probed by ``clients`` at once."""
    served = exporter(directory, "--probe.allowed-targets", LOOPBACK)
    try:
        with hostile.hostile(hostile.serving(hostile.many_samples(count))) as target:
            return {"finding": 2, "samples": count, "body_bytes": 4 * count,
                    **under_load(served, target.target, clients, 0)}  # fmt: skip
    finally:
        served.stop()


def shown_secret(directory: Path) -> dict[str, object]:
    """Finding 5: a service inside the allowlist whose first line is a secret; does a probe answer show it?"""
    served = exporter(directory, "--probe.allowed-targets", LOOPBACK)
    body = f"root:x:0:0:root:/root:/bin/bash {hostile.SECRET}\n".encode()
    try:
        with hostile.hostile(hostile.serving(body)) as target:
            answers = [hostile.probe(served.url, target.target, debug)[0] for debug in (False, True)]
            return {"finding": 5, "statuses": [reply.status for reply in answers],
                    "answers_showing_the_secret": sum(hostile.SECRET.encode() in reply.body for reply in answers),
                    "debug_log": answers[1].body.decode().split("\n\n\n")[0].splitlines()[1:]}  # fmt: skip
    finally:
        served.stop()


def name_patterns(directory: Path) -> dict[str, object]:
    """Finding 7: ``127.0.0.*:PORT`` asked for ``127.0.0.1.attacker.example:PORT``, and a CIDR-only allowlist
    asked for a name: permitted (and looked up in DNS), or refused at once?"""
    results: dict[str, object] = {"finding": 7}
    with hostile.hostile(hostile.serving(b"")) as target:
        port = target.target.rpartition(":")[2]
        for case, allowed, asked in (
            ("pattern", f"127.0.0.*:{port}", f"127.0.0.1.attacker.example:{port}"),
            ("cidr_only", LOOPBACK, f"vllm.attacker.example:{port}"),
        ):
            served = exporter(directory, "--probe.allowed-targets", allowed)
            try:
                reply, took = hostile.probe(served.url, asked, debug=True)
            finally:
                served.stop()
            results[case] = {"status": reply.status, "ms": round(took * 1000, 1),
                             "looked_up": b"cannot resolve" in reply.body}  # fmt: skip
    return results


def trickle_and_gzip(directory: Path) -> dict[str, object]:
    """A body trickling a byte every 10 ms, and a gzip bomb: how each probe ends and what it took."""
    served = exporter(directory, "--probe.allowed-targets", LOOPBACK, "--probe.timeout", "3")
    results: dict[str, object] = {"finding": "trickle, gzip"}
    try:
        for case, answer in (("trickle", hostile.trickle),
                             ("gzip", hostile.serving(hostile.gzip_bomb(), "Content-Encoding: gzip"))):  # fmt: skip
            with hostile.hostile(answer) as target:
                reply, took = hostile.probe(served.url, target.target, debug=True)
                log = reply.body.decode().split("\n\n\n")[0].splitlines()
                results[case] = {"status": reply.status, "s": round(took, 3), "last_log_line": log[-1]}
    finally:
        served.stop()
    return results


REPRODUCTIONS: dict[str, Callable[..., dict[str, object]]] = {
    "chunks": chunks, "samples": samples, "secret": shown_secret, "names": name_patterns,
    "trickle": trickle_and_gzip,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the looping probes of 1 run")
    parser.add_argument("which", nargs="*", help=f"any of {', '.join(REPRODUCTIONS)}; default: all")
    arguments = parser.parse_args()
    if unknown := set(arguments.which) - set(REPRODUCTIONS):
        parser.error(f"no reproduction {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as directory:
        for name in arguments.which or REPRODUCTIONS:
            figures = REPRODUCTIONS[name](
                Path(directory), **({"seconds": arguments.seconds} if name == "chunks" else {})
            )
            print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
