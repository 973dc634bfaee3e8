"""A real ``vllm serve`` with two API servers says its goodbye on SIGTERM without ``--shutdown-timeout``.

A dense model at ``--data-parallel-size 2`` runs two API servers by default (one per rank); on SIGTERM vLLM's
main process kills them at once (``--shutdown-timeout`` 0), before their own goodbye could go. The plugin in the
main process says it once they are gone: the replica must leave the exporter's ``/metrics`` within seconds, far
below a missed heartbeat, with exactly one goodbye.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.figures import record
from tests.real_vllm.test_real_vllm import (  # noqa: F401  (serve: a fixture)
    FORWARDING,
    VllmServer,
    all_engines_shown,
    exporter_shows,
    serve,
)
from tests.support import ExporterProcess, wait_until

# How soon after SIGTERM the replica must be gone: a goodbye, not a missed heartbeat (30 s by default).
GONE_WITHIN_SECONDS = 5.0


@pytest.mark.slow
def test_two_api_servers_say_goodbye_once_from_vllm_main_process_without_a_shutdown_timeout(
    tiny_models: dict[str, Path],
    start_exporter: Callable[..., ExporterProcess],
    serve: Callable[..., VllmServer],  # noqa: F811
    record_property: Callable[[str, object], None],
) -> None:
    # At debug level the exporter logs every request it answers: the goodbyes (DELETE) show there.
    exporter = start_exporter("--log.level", "debug")
    server = serve(tiny_models["llama"], exporter.url, "--data-parallel-size", "2")
    forwarding = {pid for pid, deployment in FORWARDING.findall(server.log_text()) if deployment == "llama"}
    assert len(forwarding) == 2, "vLLM did not run two API servers that forward"
    wait_until(lambda: all_engines_shown(exporter, "llama", {"0", "1"}), timeout=30, interval=0.5)

    # SIGTERM to vLLM's main process alone, as `kill PID` or a container runtime sends it.
    os.kill(server.process.pid, signal.SIGTERM)
    server.terminated = terminated = time.monotonic()
    wait_until(lambda: exporter_shows(exporter, "llama") is False, timeout=GONE_WITHIN_SECONDS, interval=0.1)
    gone_seconds = time.monotonic() - terminated
    server.process.wait(timeout=60)
    exit_seconds = time.monotonic() - terminated

    log = exporter.log.read_text(errors="replace")
    goodbyes = [line for line in log.splitlines() if '"DELETE /api/v1/deployments/llama' in line]
    record(
        record_property, "real vLLM dense-dp2 goodbye without --shutdown-timeout",
        gone_seconds=round(gone_seconds, 2), exit_seconds=round(exit_seconds, 2), goodbyes=len(goodbyes),
    )  # fmt: skip
    assert len(goodbyes) == 1, goodbyes
