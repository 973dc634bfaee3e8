"""A real Prometheus server scraping a real exporter process on loopback, and promtool on a real scrape."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.exposition import scrape
from tests.helpers.prometheus import PrometheusServer, dashboard_queries, promtool
from tests.helpers.ready_responses import push_ready
from tests.support import ExporterProcess, fixture_bytes

ENGINE = 'deployment="qwen",engine="0"'


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[ExporterProcess], PrometheusServer]]:
    servers: list[PrometheusServer] = []

    def start(exporter: ExporterProcess) -> PrometheusServer:
        directory = tmp_path / f"prometheus-{len(servers)}"
        directory.mkdir()
        server = PrometheusServer(directory, [f"127.0.0.1:{exporter.port}"])
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


def test_prometheus_ingests_the_true_block_sizes_and_a_changed_config_replaces_the_old_series(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[[ExporterProcess], PrometheusServer],
) -> None:
    exporter = start_exporter()
    prometheus = start_prometheus(exporter)
    first_push = time.time()
    push_ready(exporter.url, "qwen", fixture_bytes("hybrid-tp1-post50809"))
    push_ready(exporter.url, "dense", fixture_bytes("dense-post50809"))

    (hybrid,) = prometheus.wait_for('cache_config_info{block_size="1056",mamba_block_size="1056"}')
    assert hybrid["metric"]["deployment"] == "qwen"
    assert hybrid["metric"]["num_gpu_blocks"] == "1997"
    assert hybrid["metric"]["job"] == "cache-config-exporter"
    (capacity,) = prometheus.wait_for(
        'cache_config_num_gpu_blocks{deployment="qwen"} * on (deployment, engine) cache_config_block_size'
    )
    assert float(capacity["value"][1]) == 1997 * 1056

    # The same engine re-reports at TP=4: block sizes 528. The 1056 series must go stale at the
    # very scrape that shows 528, so that no two series of one engine ever overlap.
    push_ready(exporter.url, "qwen", fixture_bytes("hybrid-tp4-post50809"))
    prometheus.wait_for(f'cache_config_info{{{ENGINE},block_size="528"}}')
    (current,) = prometheus.query(f"cache_config_info{{{ENGINE}}}")
    assert (current["metric"]["block_size"], current["metric"]["mamba_block_size"]) == ("528", "528")
    assert current["metric"]["num_gpu_blocks"] == "7130"
    assert prometheus.query(f'cache_config_info{{{ENGINE},block_size="1056"}}') == []
    (block_size,) = prometheus.query(f"cache_config_block_size{{{ENGINE}}}")
    assert block_size["value"][1] == "528"

    # Over the whole run, at every step, exactly one info series of the engine was there,
    # though both configurations were seen in that window (which ends after two scrapes of 528).
    prometheus.wait_for(f'count_over_time(cache_config_info{{{ENGINE},block_size="528"}}[1m]) >= 2')
    window = {"start": first_push, "end": time.time(), "step": 0.25}
    (overlap,) = prometheus.query_range(f"count by (deployment, engine) (cache_config_info{{{ENGINE}}})", **window)
    assert {value for _, value in overlap["values"]} == {"1"}, overlap["values"]
    seen = prometheus.query_range(f"cache_config_info{{{ENGINE}}}", **window)
    assert sorted(series["metric"]["block_size"] for series in seen) == ["1056", "528"]
    # The dense deployment, untouched, still has its one series.
    (dense,) = prometheus.query('cache_config_info{deployment="dense"}')
    assert (dense["metric"]["block_size"], dense["metric"]["mamba_block_size"]) == ("16", "None")


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[[ExporterProcess], PrometheusServer],
) -> None:
    exporter = start_exporter()
    push_ready(exporter.url, "qwen", fixture_bytes("hybrid-tp1-post50809"))
    push_ready(exporter.url, "dp2", fixture_bytes("dp2-rank0"))
    push_ready(exporter.url, "dp2", fixture_bytes("dp2-rank1"))
    prometheus = start_prometheus(exporter)
    # Grafana's variables as an "All" selection and a short rate window would expand them.
    # Without vLLM's own series (joined in tests/test_stock_vllm.py, against a real vLLM).
    queries = [
        query.replace("$deployment", ".*").replace("$__rate_interval", "10s")
        for query in dashboard_queries()
        if "vllm:" not in query
    ]
    # rate() needs two scrapes inside its window.
    prometheus.wait_for("count_over_time(cache_config_exporter_ready_responses_accepted_total[10s]) > 2")
    for query in queries:
        assert prometheus.query(query), f"no data for {query}"
    (capacity,) = [query for query in queries if "cache_config_num_gpu_blocks" in query and " * " in query]
    by_deployment = {series["metric"]["deployment"]: series["value"][1] for series in prometheus.query(capacity)}
    assert by_deployment == {"qwen": str(1997 * 1056), "dp2": str(2 * 1997 * 1056)}
    (engines,) = [query for query in queries if query.startswith("count by (deployment, replica)")]
    by_replica = {series["metric"]["deployment"]: series["value"][1] for series in prometheus.query(engines)}
    assert by_replica == {"qwen": "1", "dp2": "2"}
    (replicas,) = [query for query in queries if query.startswith("count by (deployment)")]
    by_deployment = {series["metric"]["deployment"]: series["value"][1] for series in prometheus.query(replicas)}
    assert by_deployment == {"qwen": "1", "dp2": "1"}


def test_promtool_check_metrics_passes_on_a_real_scrape(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    for fixture in ("hybrid-tp1-post50809", "dense-post50809", "minimal-pre42967", "dp2-rank0", "dp2-rank1"):
        push_ready(exporter.url, f"deployment-{fixture}", fixture_bytes(fixture))
    body = scrape(exporter.url).encode()
    assert b"cache_config_info{" in body
    checked = promtool("check", "metrics", stdin=body)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout + checked.stderr == ""


def test_an_expired_replica_goes_stale_in_prometheus(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[[ExporterProcess], PrometheusServer],
) -> None:
    exporter = start_exporter("--expiry.missed-heartbeats", "2")
    prometheus = start_prometheus(exporter)
    prometheus.wait_for('up{job="cache-config-exporter"} == 1')  # scraping before the replica appears
    # One replica that promises heartbeats every 3 s.
    push_ready(exporter.url, "qwen", fixture_bytes("hybrid-tp1-post50809"), "?replica=gpu-1:8000&heartbeat=3")
    prometheus.wait_for('cache_config_info{deployment="qwen",replica="gpu-1:8000"}')
    # No heartbeat follows: after two missed intervals the exporter drops the replica, and the
    # next scrape marks its series stale, so an instant query stops returning them at once.
    deadline = time.monotonic() + 20
    while prometheus.query('cache_config_info{deployment="qwen",replica="gpu-1:8000"}'):
        assert time.monotonic() < deadline, "the expired replica's series never went stale"
        time.sleep(0.2)
    prometheus.wait_for("cache_config_exporter_replicas_expired_total == 1")
