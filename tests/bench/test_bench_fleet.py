"""``python -m bench --fleet``'s machinery at a small N against a real exporter and the real floor server: every
scheduled request is sent at its time and answered, the restarts land, the timeline has its samples, and the table
and plot are drawn from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import fleet, fleet_report
from tests.helpers.http import request

REPLICAS = 20
PHASE_SECONDS = 4.0


@pytest.fixture(scope="module")
def exporter_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The whole fleet timeline against a real exporter (quiet 1 s, idle 2 s, 4 s phases); its result and the state
    it held."""
    workdir = tmp_path_factory.mktemp("fleet")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fleet, "QUIET_SECONDS", 1.0)
        patch.setattr(fleet, "IDLE_SECONDS", 2.0)
        with fleet._exporter(workdir) as server:
            names = fleet.replica_names(REPLICAS)
            result = fleet.run_server(server, names, fleet.Work("exporter", {}), PHASE_SECONDS, 30.0)
            held = request(f"http://127.0.0.1:{server.port}", "GET", "/api/v1/deployments").json()
    yield result, held


@pytest.fixture(scope="module")
def floor_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The floor's timeline (quiet 1 s, 4 s of heartbeats) on the plugin's requests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fleet, "QUIET_SECONDS", 1.0)
        with fleet._floor(tmp_path_factory.mktemp("floor")) as server:
            return fleet.run_server(server, fleet.replica_names(REPLICAS), fleet.Work("floor", {}), PHASE_SECONDS, 30.0)


def test_the_fleet_is_started_and_every_heartbeat_and_restart_is_answered(
    exporter_run: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    result, _ = exporter_run
    assert result["fill"]["replicas"] == REPLICAS and not result["fill"]["errors"]
    # 20 replicas every 30 s: those due in the first 4 s of each phase.
    heartbeats = result["phases"]["heartbeats"]
    assert heartbeats["due"] == {"heartbeat": 3}
    assert heartbeats["events"]["heartbeat"]["count"] == 3
    fleet_phase = result["phases"]["fleet"]
    assert fleet_phase["due"] == {"heartbeat": 3, "restart": 2}
    assert fleet_phase["events"]["restart"]["count"] == 2
    assert all(not phase["errors"] for phase in result["phases"].values())
    # Sampled every second; not scraped while quiet, every second while idle, then every 15 s as Prometheus does.
    assert len(heartbeats["samples"]) >= PHASE_SECONDS - 1
    assert result["phases"]["quiet"]["scrape"]["count"] == 0 and result["phases"]["quiet"]["samples"]
    assert result["phases"]["idle"]["scrape"]["count"] >= 2
    assert heartbeats["scrape"]["count"] == fleet_phase["scrape"]["count"] == 1
    assert result["peak_rss_mb"] >= result["empty_rss_mb"] > 0
    # Each server's heartbeats and restart went on the connection it opened as it started, as the plugin's do.
    assert result["connections_opened"] == REPLICAS


def test_each_replica_is_held_with_its_eight_engines_and_the_restarted_ones_in_their_new_run(
    exporter_run: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    _, held = exporter_run
    replicas = {replica["replica"]: replica for replica in held}
    assert len(replicas) == REPLICAS
    assert all(len(replica["engines"]) == 8 for replica in replicas.values())
    restarted = {name for name, replica in replicas.items() if replica["instance_id"].startswith("restart-")}
    assert restarted == {"vllm-00000:8000", "vllm-00010:8000"}


def test_the_floor_gets_the_plugins_fill_and_heartbeats_and_nothing_else(floor_run: dict[str, Any]) -> None:
    assert floor_run["fill"]["replicas"] == REPLICAS and not floor_run["fill"]["errors"]
    assert list(floor_run["phases"]) == ["quiet", "heartbeats"]
    heartbeats = floor_run["phases"]["heartbeats"]
    assert heartbeats["due"] == {"heartbeat": 3} and heartbeats["events"]["heartbeat"]["count"] == 3
    assert floor_run["phases"]["quiet"]["samples"] and floor_run["connections_opened"] == REPLICAS


def test_the_table_and_plot_show_the_three_servers(
    exporter_run: tuple[dict[str, Any], list[dict[str, Any]]], floor_run: dict[str, Any], tmp_path: Path
) -> None:
    result, _ = exporter_run
    settings = {"replicas": [REPLICAS], "phase_seconds": PHASE_SECONDS, "quiet_seconds": 1.0, "idle_seconds": 2.0,
                "heartbeat_seconds": 30, "fill_budget_seconds": 30, "in_flight": 64, "data_parallel": 8}  # fmt: skip
    runs = {"exporter": result, "pushgateway": result, "floor": floor_run}
    results = {"settings": settings, "runs": {str(REPLICAS): runs}, "run_seconds": 60}
    table = fleet_report.render(results)
    assert "| heartbeats: done / due | 3 / 3 | 3 / 3 | 3 / 3 | - | - |" in table
    # The floor runs no restarts, and its scrapes (of nothing) are not compared.
    assert "| fleet: restarts done / due | 2 / 2 | 2 / 2 | - | - | - |" in table
    row = next(line for line in table.splitlines() if line.startswith("| heartbeats: heartbeat p50 ms |"))
    exporter, _, floor, to_pushgateway, to_floor = (cell.strip() for cell in row.split("|")[2:7])
    assert to_pushgateway == "1.000" and float(to_floor) == pytest.approx(float(exporter) / float(floor), rel=0.05)
    fleet_report.plot(results, tmp_path / "fleet.png")
    assert (tmp_path / "fleet.png").read_bytes().startswith(b"\x89PNG")
