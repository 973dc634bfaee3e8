"""Hostile probe targets against a real ``cache-config-exporter serve`` on loopback, while a plugin's heartbeats
and Prometheus' scrapes are timed beside the probes: those stay fast, every probe ends by its deadline, no work
outlives its answer, memory stays bounded, a healthy target's probe beside them succeeds, and probes past
``--probe.max-concurrent`` are refused at once.

The reproductions are ``reproduce_hostile.py``'s, smaller; docs/RELIABILITY.md has their figures at the
reviewer's scale. A p99 is held to 100 ms above the same test's p99 with no probe running, so that the
machine's other load, which slows both, is not counted against the probe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from tests.helpers.figures import record
from tests.probe import hostile
from tests.probe.reproduce_hostile import LOOPBACK, chunks, exporter, probe_results, samples
from tests.support import wait_until

P99_ABOVE_IDLE_MS = 100.0
# A healthy target's probe waits for a turn among the hostile ones' (a few each): well within a scrape timeout.
HEALTHY_PROBE_ABOVE_IDLE_MS = 500.0
# CPU seconds the exporter may use in the second that begins a second after the last answer: idle.
IDLE_CPU_SECONDS = 0.1


def assert_beside_unharmed(figures: dict[str, object]) -> None:
    """Heartbeats, scrapes and probes of a healthy target all answered, their p99 near the idle one; the
    hostile probes answered; the exporter idle again a second after the last answer."""
    for kind, above_idle in (("heartbeat", P99_ABOVE_IDLE_MS), ("scrape", P99_ABOVE_IDLE_MS),
                             ("probe", HEALTHY_PROBE_ABOVE_IDLE_MS)):  # fmt: skip
        assert figures[f"{kind}s_failed"] == 0, (kind, figures)
        bound = float(figures[f"idle_{kind}_p99_ms"]) + above_idle  # type: ignore[arg-type]
        assert float(figures[f"{kind}_p99_ms"]) < bound, (kind, figures)  # type: ignore[arg-type]
    assert figures["hostile_statuses"] == [200], figures
    assert float(figures["cpu_seconds_in_the_second_after"]) < IDLE_CPU_SECONDS, figures  # type: ignore[arg-type]


def test_endless_tiny_chunks_leave_heartbeats_and_scrapes_fast_and_end_at_the_deadline(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    figures = chunks(tmp_path, clients=4, seconds=5.0, timeout=3.0)
    record(record_property, "probe: endless 1-byte chunks", **figures)
    assert_beside_unharmed(figures)
    assert float(figures["healthy_p50_ms_during_one_probe"]) < P99_ABOVE_IDLE_MS, figures  # type: ignore[arg-type]
    assert float(figures["hostile_longest_s"]) < 3.0 + 0.5, figures  # type: ignore[arg-type]
    assert set(figures["hostile_results"]) <= {"timeout", "too_large"}, figures  # type: ignore[arg-type]


def test_millions_of_samples_cost_bounded_time_memory_and_cpu(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Eight probes at once of 8 MB bodies of 2 million samples: the bodies are read as they come, never held."""
    figures = samples(tmp_path, clients=8)
    record(record_property, "probe: 2 million samples", **figures)
    assert_beside_unharmed(figures)
    assert float(figures["hostile_longest_s"]) < 10.0 + 0.5, figures  # type: ignore[arg-type]
    assert float(figures["rss_peak_above_start_mib"]) < 32, figures  # type: ignore[arg-type]


def test_probes_past_the_cap_are_refused_at_once_with_retry_after(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Two trickling targets hold ``--probe.max-concurrent 2``: a third probe is a 503 problem at once, saying
    when to retry; once they end, probes run again."""
    served = exporter(tmp_path, "--probe.allowed-targets", LOOPBACK, "--probe.max-concurrent", "2",
                      "--probe.timeout", "3")  # fmt: skip
    try:
        with hostile.hostile(hostile.trickle) as slow, hostile.hostile(hostile.serving(b"a 1\n")) as quick:
            held = [threading.Thread(target=hostile.probe, args=(served.url, slow.target)) for _ in range(2)]
            for thread in held:
                thread.start()
            wait_until(lambda: slow.requests == 2, timeout=5.0, interval=0.01)
            refused = wait_until(lambda: busy(served.url, quick.target), timeout=2.0, interval=0.01)
            for thread in held:
                thread.join(timeout=10)
            again, _ = hostile.probe(served.url, quick.target)
            results = probe_results(served)
    finally:
        served.stop()
    reply, took = refused
    problem = reply.problem(503)
    record(record_property, "probe: past --probe.max-concurrent", refused_ms=round(took * 1000, 1), **results)
    assert reply.headers["retry-after"] == "1" and took < 0.5
    assert problem["type"] == "urn:cache-config-exporter:problem:probes_busy"
    assert "2 probes are running, the most --probe.max-concurrent allows" in problem["detail"]
    assert again.status == 200 and results["timeout"] == 2


def busy(url: str, target: str) -> tuple[hostile.Reply, float] | None:
    """A probe's answer and how long it took, when it was refused as busy; else ``None``."""
    answer = hostile.probe(url, target)
    return answer if answer[0].status == 503 else None
