"""A real ``vllm serve`` whose exporter URL answers badly: its shutdown and its memory are vLLM's own.

- SIGTERM to vLLM's main process with a blackholed exporter (it takes connections and never answers): vLLM exits
  within ``HELD_AT_MOST_SECONDS`` of the same server without the plugin, runs interleaved in the same test, medians.
- An answer without end at the exporter URL: the API server's resident memory stays within ``FLAT_BYTES`` for
  ``WATCH_SECONDS`` while the plugin keeps trying.
- A 429 with ``Retry-After: RETRY_AFTER_SECONDS`` to every request: at most one request per window, the next one
  as soon as the window ends; once the exporter answers 200, the ready response arrives at the end of the wait.
"""

from __future__ import annotations

import itertools
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
from tests.real_vllm.test_real_vllm import (  # noqa: F401  (serve: a fixture)
    VllmServer,
    serve,
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
# The wait every 429 asks for, and how many such waits are watched: the first 429 and the next WINDOWS. The plugin's
# own backoff after them (0.5, 1, 2, 4 s: ``FIRST_RETRY_SECONDS`` doubling) stays below the wait, so each gap is
# ``Retry-After``'s alone.
RETRY_AFTER_SECONDS = 5.0
WINDOWS = 3
# A request may arrive this much earlier than its window's end (the stand-in's clock reads the arrival once the
# request is read, the plugin's the answer before it starts waiting).
CLOCK_TOLERANCE_SECONDS = 0.1
# The next request, once a window ends, comes within this (a thread woken, a connection made on a loaded machine).
RESUMED_WITHIN_SECONDS = 2.0


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
    tiny_models: dict[str, Path],
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
    tiny_models: dict[str, Path],
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


@pytest.mark.slow
def test_retry_after_allows_one_request_a_window_and_the_ready_response_goes_when_the_wait_ends(
    tiny_models: dict[str, Path],
    serve: Callable[..., VllmServer],  # noqa: F811
    record_property: Callable[[str, object], None],
) -> None:
    """The watch lasts half a window past the WINDOWS-th, so that no request is due near its end: the one after it
    comes half a window later, to an exporter then answering 200."""
    window = RETRY_AFTER_SECONDS
    exporter = StandIn(standins.retry_after(f"{window:g}"))
    try:
        serve(tiny_models["llama"], exporter.url)
        first = wait_until(lambda: exporter.requests(), timeout=30, interval=0.1)[0].at
        # The watch itself: what the plugin sends meanwhile is what is measured.
        time.sleep(max(0.0, first + (WINDOWS + 0.5) * window - time.monotonic()))
        exporter.behaviour = standins.ok
        switched = time.monotonic()
        refused = [arrival.at for arrival in exporter.requests() if arrival.at < switched]
        ready = wait_until(
            lambda: [
                arrival.at
                for arrival in exporter.requests("POST")
                if "/ready?" in arrival.line and arrival.at >= switched
            ],
            timeout=window + 30,
            interval=0.05,
        )[0]
    finally:
        exporter.stop()
    gaps = [later - earlier for earlier, later in itertools.pairwise(refused)]
    ready_after = ready - refused[-1]
    record(
        record_property, "real vLLM against 429 with Retry-After",
        retry_after_seconds=window, watched_seconds=round(switched - first, 2), refused=len(refused),
        gaps_seconds=[round(gap, 3) for gap in gaps], ready_after_last_429_seconds=round(ready_after, 3),
    )  # fmt: skip
    # At most one request a window, the first included; and the plugin kept asking after each window.
    assert 2 <= len(refused) <= WINDOWS + 1, refused
    assert all(window - CLOCK_TOLERANCE_SECONDS <= gap <= window + RESUMED_WITHIN_SECONDS for gap in gaps), gaps
    # The exporter answering again: the labels then the ready response, as soon as the last wait ended.
    assert window - CLOCK_TOLERANCE_SECONDS <= ready_after <= window + RESUMED_WITHIN_SECONDS, ready_after
