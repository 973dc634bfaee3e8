"""A real ``vllm serve`` whose exporter URL answers badly: its shutdown and its memory are vLLM's own.

- SIGTERM to vLLM's main process with a blackholed exporter (it takes connections and never answers): vLLM exits
  within ``HELD_AT_MOST_SECONDS`` of the same server without the plugin, runs interleaved in the same test, medians.
- An answer without end at the exporter URL: the API server's resident memory stays within ``FLAT_BYTES`` for
  ``WATCH_SECONDS`` while the plugin keeps trying.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.figures import record
from tests.plugin import standins
from tests.plugin.standins import StandIn
from tests.real_vllm.test_real_vllm import (  # noqa: F401  (serve, tiny_models, vllm_venv: fixtures)
    VllmServer,
    serve,
    tiny_models,
    vllm_venv,
)
from tests.support import wait_until

# What the plugin may add to vLLM's exit on SIGTERM, whatever the exporter does.
HELD_AT_MOST_SECONDS = 0.5
# Runs with and without the plugin, interleaved, so that both see the same load.
REPETITIONS = 3
# The API server's resident memory against an answer without end: flat within this, for this long.
FLAT_BYTES = 5 * 1024 * 1024
WATCH_SECONDS = 120.0
SAMPLE_SECONDS = 5.0


def exit_seconds(server: VllmServer) -> float:
    """SIGTERM to vLLM's main process alone, as `kill PID` or a container runtime sends it: the seconds until it
    exited. The rest of its process group is stopped afterwards."""
    os.kill(server.process.pid, signal.SIGTERM)
    server.terminated = terminated = time.monotonic()
    server.process.wait(timeout=60)
    seconds = time.monotonic() - terminated
    server.stop()
    return seconds


@pytest.mark.slow
def test_sigterm_with_a_blackholed_exporter_exits_within_half_a_second_of_vllm_without_the_plugin(
    tiny_models: dict[str, Path],  # noqa: F811
    serve: Callable[..., VllmServer],  # noqa: F811
    record_property: Callable[[str, object], None],
) -> None:
    exporter = StandIn(standins.blackhole)
    exits: dict[str, list[float]] = {"without": [], "with": []}
    try:
        for _ in range(REPETITIONS):
            for case in exits:
                # An empty CACHE_CONFIG_EXPORTER_URL: the plugin does nothing at all.
                environment = {"CACHE_CONFIG_EXPORTER_URL": ""} if case == "without" else None
                taken = len(exporter.requests())
                server = serve(tiny_models["llama"], exporter.url, environment=environment)
                if case == "with":
                    # The plugin's first request is in the blackhole, never to be answered.
                    wait_until(lambda taken=taken: len(exporter.requests()) > taken, timeout=30, interval=0.1)
                exits[case].append(exit_seconds(server))
    finally:
        exporter.stop()
    medians = {case: statistics.median(seconds) for case, seconds in exits.items()}
    record(
        record_property, "real vLLM SIGTERM with a blackholed exporter",
        exit_seconds={case: [round(s, 2) for s in seconds] for case, seconds in exits.items()},
        median_without=round(medians["without"], 2), median_with=round(medians["with"], 2),
    )  # fmt: skip
    assert medians["with"] - medians["without"] <= HELD_AT_MOST_SECONDS, exits


def resident_bytes(pid: int) -> int:
    """The process's resident memory (``VmRSS``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (line,) = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) * 1024


@pytest.mark.slow
def test_the_api_servers_memory_stays_flat_against_an_answer_without_end(
    tiny_models: dict[str, Path],  # noqa: F811
    serve: Callable[..., VllmServer],  # noqa: F811
    record_property: Callable[[str, object], None],
) -> None:
    """One API server: vLLM's main process is the API server, where the plugin's delivery thread runs."""
    exporter = StandIn(standins.endless)
    try:
        server = serve(tiny_models["llama"], exporter.url)
        wait_until(lambda: exporter.requests(), timeout=30, interval=0.1)
        samples = [resident_bytes(server.process.pid)]
        deadline = time.monotonic() + WATCH_SECONDS
        while time.monotonic() < deadline:
            time.sleep(SAMPLE_SECONDS)  # the interval between samples of a measure, not a wait for anything
            samples.append(resident_bytes(server.process.pid))
    finally:
        exporter.stop()
    attempts, sent = len(exporter.requests()), exporter.sent
    record(
        record_property, "real vLLM API server against an endless answer",
        watched_seconds=WATCH_SECONDS, attempts=attempts, answer_bytes_sent=sent,
        rss_first_mb=round(samples[0] / 2**20, 1), rss_min_mb=round(min(samples) / 2**20, 1),
        rss_max_mb=round(max(samples) / 2**20, 1),
    )  # fmt: skip
    # The plugin kept trying (backoff), and the server pushed far more than the plugin kept.
    assert attempts >= 5 and sent > 10 * 2**20
    assert max(samples) - min(samples) <= FLAT_BYTES, samples
