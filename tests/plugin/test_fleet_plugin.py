"""The plugin in a fleet: vLLM servers as real processes, each a replica, against real exporter processes.

A replica here is ``python -m tests.plugin.test_fleet_plugin serve --port N ...``: the
stand-in vLLM's frontend with the plugin loaded as vLLM loads it, applying its
engines' ready responses and then serving until it is stopped, so that it can
be killed (SIGKILL: heartbeats stop) or shut down cleanly (SIGTERM, as vLLM's
API server takes it). Its command line carries ``--port`` as ``vllm serve``'s
does, from which the plugin names the replica. Heartbeats are 1 s here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from exporter.vllm_plugin import plugin as vllm_plugin
from exporter.vllm_plugin import target as plugin_target
from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.real_vllm.frontend import HYBRID_RESPONSE, frontend_client
from tests.support import ExporterProcess, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parents[1] / "vllm_standin"
DEPLOYMENT = "org/model"
# The block size the engines run with: vLLM's frontend keeps the configured Mamba block size (16) instead.
TRUE_MAMBA_BLOCK_SIZE = "1056"


class Replica:
    """One vLLM server with the plugin: started, its engines' ready responses applied, serving until stopped."""

    def __init__(self, port: int, urls: list[str], log: Path, *, run: str, blocks: int, heartbeat: float = 1.0) -> None:
        environ = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
        environ.update(
            CACHE_CONFIG_EXPORTER_URL=", ".join(urls),
            CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS=f"{heartbeat:g}",
            CACHE_CONFIG_EXPORTER_TIMEOUT="1",
        )
        command = [sys.executable, "-m", "tests.plugin.test_fleet_plugin", "serve", "--port", str(port), "--run", run,
                   "--blocks", str(blocks)]  # fmt: skip
        self.name = plugin_target.replica_of(None, ["--port", str(port)])
        self.run = run
        self.blocks = blocks
        with log.open("ab") as output:
            self.process = subprocess.Popen(command, cwd=REPOSITORY, env=environ, stdout=subprocess.PIPE, stderr=output)
        assert self.process.stdout is not None
        # What the server's own vLLM frontend publishes as ``vllm:cache_config_info`` once its engines are up.
        ready, _, _ = select.select([self.process.stdout], [], [], 30)
        line = self.process.stdout.readline() if ready else b""
        assert line, f"the replica did not start:\n{log.read_text()}"
        self.vllm_labels: dict[str, str] = json.loads(line)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=20)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    """Start replica processes (``Replica``'s arguments); the test's leftovers are killed at its end."""
    replicas: list[Replica] = []

    def start(port: int, urls: list[str], **options: Any) -> Replica:
        replica = Replica(port, urls, tmp_path / f"replica-{port}.log", **options)
        replicas.append(replica)
        return replica

    yield start
    for replica in replicas:
        replica.stop(signal.SIGKILL)


@pytest.fixture
def later(tmp_path: Path) -> Iterator[Callable[[str], ExporterProcess]]:
    """Exporters that are not started yet (they are away), stopped at the end of the test."""
    exporters: list[ExporterProcess] = []

    def create(name: str) -> ExporterProcess:
        exporters.append(ExporterProcess(tmp_path / f"{name}.db"))
        return exporters[-1]

    yield create
    for exporter in exporters:
        exporter.stop()


def get(exporter: ExporterProcess, path: str) -> Any:
    reply = request(exporter.url, "GET", path)
    assert reply.status == 200, reply.body[:300]
    return reply.json() if path.startswith("/api/") else reply.text


def fleet_state(exporter: ExporterProcess) -> dict[str, tuple[str, dict[str, str], list[Any]]]:
    """Per replica of the deployment: its run, its static labels and its engines' ready responses."""
    replicas = get(exporter, f"/api/v1/deployments?deployment={DEPLOYMENT}")
    return {
        replica["replica"]: (
            replica["instance_id"],
            replica["static_labels"],
            [(engine["engine"], engine["response"]) for engine in replica["engines"]],
        )
        for replica in replicas
    }


def holds(exporter: ExporterProcess, *replicas: Replica) -> bool:
    """The exporter holds exactly these replicas, each with its current run's labels and both engines."""
    state = fleet_state(exporter)
    return set(state) == {replica.name for replica in replicas} and all(
        state[replica.name][0] == replica.run
        and state[replica.name][1] == replica.vllm_labels
        and [(index, response["num_gpu_blocks"]) for index, response in state[replica.name][2]]
        == [(0, replica.blocks), (1, replica.blocks + 1)]
        for replica in replicas
    )


def shown(exporter: ExporterProcess) -> set[str]:
    """The replicas of the deployment that ``/metrics`` shows."""
    exposition = get(exporter, "/metrics")
    return {
        s.labels["replica"] for s in samples(exposition, "cache_config_info") if s.labels["deployment"] == DEPLOYMENT
    }


def expired(exporter: ExporterProcess) -> float:
    return samples(get(exporter, "/metrics"), "cache_config_exporter_replicas_expired_total")[0].value


def test_three_replicas_with_two_engines_each_and_a_restart_of_one_leaves_the_others_untouched(
    start_exporter: Callable[..., ExporterProcess], fleet: Callable[..., Replica]
) -> None:
    exporter = start_exporter()
    replicas = [fleet(8000 + number, [exporter.url], run=f"run-{number}", blocks=1000 * number) for number in (1, 2, 3)]
    wait_until(lambda: holds(exporter, *replicas))

    exposition = get(exporter, "/metrics")
    for replica in replicas:
        info = {
            s.labels["engine"]: s.labels
            for s in samples(exposition, "cache_config_info")
            if s.labels["replica"] == replica.name
        }
        # Each replica's series are exactly what its own vLLM frontend publishes, with the true Mamba block size.
        assert set(info) == {"0", "1"}
        for labels in info.values():
            own = {name: value for name, value in labels.items() if name not in ("deployment", "replica", "engine")}
            assert own == {**replica.vllm_labels, "mamba_block_size": TRUE_MAMBA_BLOCK_SIZE}
    # The fleet's blocks are the sum of what each replica's frontend counts for its own engines.
    fleet_blocks = sum(s.value for s in samples(exposition, "cache_config_num_gpu_blocks"))
    assert fleet_blocks == sum(int(replica.vllm_labels["num_gpu_blocks"]) for replica in replicas) == 12003

    # The second server crashes and comes back: a new run replaces its engines, and only its engines.
    before = fleet_state(exporter)
    replicas[1].stop(signal.SIGKILL)
    replicas[1] = fleet(8002, [exporter.url], run="run-2-again", blocks=7000)
    wait_until(lambda: holds(exporter, *replicas))
    after = fleet_state(exporter)
    assert {name: state for name, state in after.items() if name != replicas[1].name} == {
        name: state for name, state in before.items() if name != replicas[1].name
    }


def test_a_killed_replica_expires_and_a_clean_shutdown_says_goodbye(
    start_exporter: Callable[..., ExporterProcess],
    fleet: Callable[..., Replica],
    record_property: Callable[[str, object], None],
) -> None:
    exporter = start_exporter("--expiry.missed-heartbeats", "2")
    killed = fleet(8001, [exporter.url], run="run-1", blocks=1000)
    stopped = fleet(8002, [exporter.url], run="run-2", blocks=2000)
    wait_until(lambda: holds(exporter, killed, stopped))
    # Heartbeats keep both for longer than the expiry period (2 missed intervals of 1 s).
    kept_until = time.monotonic() + 3
    while time.monotonic() < kept_until:
        assert shown(exporter) == {killed.name, stopped.name}
        time.sleep(0.25)

    killed.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: shown(exporter) == {stopped.name}, timeout=10)
    silent = time.monotonic() - killed_at
    record(record_property, "plugin replica expiry after SIGKILL", heartbeat_seconds=1, missed_heartbeats=2,
           gone_after_seconds=round(silent, 2))  # fmt: skip
    # Gone within the expiry (2 s after its last heartbeat), the expiry check's 1 s precision, and 1 s to spare.
    assert silent < 2 + 1 + 1
    assert expired(exporter) == 1

    # vLLM shutting down cleanly: gone by the time the process has exited, not expired.
    assert stopped.stop(signal.SIGTERM) == 0
    assert shown(exporter) == set()
    assert fleet_state(exporter) == {}
    assert expired(exporter) == 1


def test_exporter_away_for_60_seconds_while_replicas_start_gets_every_replica_within_one_heartbeat(
    later: Callable[[str], ExporterProcess],
    fleet: Callable[..., Replica],
    record_property: Callable[[str, object], None],
) -> None:
    heartbeat = 5.0
    exporter = later("exporter")
    replicas = [
        fleet(8000 + number, [exporter.url], run=f"run-{number}", blocks=1000 * number, heartbeat=heartbeat)
        for number in (1, 2, 3)
    ]
    pids = [replica.process.pid for replica in replicas]
    away_until = time.monotonic() + 60
    while time.monotonic() < away_until:
        # vLLM serves on, untouched.
        assert all(replica.process.poll() is None for replica in replicas)
        time.sleep(1)

    exporter.start()
    back = time.monotonic()
    wait_until(lambda: holds(exporter, *replicas), timeout=heartbeat + 5, interval=0.02)
    recovery = time.monotonic() - back
    record(record_property, "plugin recovery after a 60 s outage", replicas=3, heartbeat_seconds=heartbeat,
           recovery_seconds=round(recovery, 2))  # fmt: skip
    assert recovery < heartbeat + 1
    # The same vLLM processes: nothing restarted.
    assert [replica.process.pid for replica in replicas] == pids
    assert all(replica.process.poll() is None for replica in replicas)


def test_two_exporters_one_hanging_then_back_end_with_the_same_state(
    start_exporter: Callable[..., ExporterProcess],
    later: Callable[[str], ExporterProcess],
    fleet: Callable[..., Replica],
) -> None:
    up = start_exporter()
    down = later("down")
    with socket.socket() as hanging:
        # The second exporter's host takes connections and never answers: every attempt waits its whole timeout.
        hanging.bind(("127.0.0.1", down.port))
        hanging.listen(64)
        replicas = [
            fleet(8000 + number, [down.url, up.url], run=f"run-{number}", blocks=1000 * number) for number in (1, 2)
        ]
        # Not held up by the one that hangs (1 s per attempt there), although it comes first in the list.
        wait_until(lambda: holds(up, *replicas), timeout=5)
        replicas[0].stop(signal.SIGKILL)
        replicas[0] = fleet(8001, [down.url, up.url], run="run-1-again", blocks=5000)
        wait_until(lambda: holds(up, *replicas), timeout=5)
    down.start()
    wait_until(lambda: holds(down, *replicas), timeout=5)
    assert fleet_state(down) == fleet_state(up)


def serve(arguments: list[str]) -> None:
    """A replica's frontend: apply the engines' ready responses through the plugin, then serve until stopped."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--blocks", type=int, required=True)
    options = parser.parse_args(arguments)
    sys.path.insert(0, str(STANDIN))
    vllm_plugin.register()
    core_client = importlib.import_module("vllm.v1.engine.core_client")
    cache_config = importlib.import_module("vllm.config").CacheConfig(mamba_cache_mode="align")
    client = frontend_client(core_client.MPClient, cache_config, DEPLOYMENT)
    response_class = importlib.import_module("vllm.v1.engine").EngineCoreReadyResponse
    for rank in (0, 1):
        fields = {"data_parallel_size": 2, "data_parallel_rank": rank, "instance_id": options.run,
                  "num_gpu_blocks": options.blocks + rank}  # fmt: skip
        client._apply_ready_response(msgspec.msgpack.encode(response_class(**{**HYBRID_RESPONSE, **fields})))
    # As vLLM's API server does: SIGTERM is a clean shutdown, which runs the exit handlers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps(cache_config.metrics_info()), flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
