"""The files of docker/: checked by the tools that consume them (promtool, shellcheck, the exporter itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import yaml

from protocol import KV_CACHE_GROUPS_KEY, releases
from tests.helpers.exposition import sample_names, scrape
from tests.helpers.prometheus import (
    DASHBOARD,
    DOCKER,
    REPO,
    RULE_TESTS,
    RULES,
    dashboard_queries,
    metric_names,
    promtool,
    recorded_names,
    shipped_rules,
)
from tests.helpers.ready_responses import push_ready
from tests.helpers.release_payloads import ready_payload
from tests.plugin.test_vllm_engine_groups import groups
from tests.support import ExporterProcess, fixture_bytes, free_port, require_binary

# Series that Prometheus makes itself for every target rather than scraping them.
SCRAPE_SERIES = {"up"}
# vLLM's own series that the rules and the dashboard join with the true capacity and the prefix-cache hit granularity
# (docs/metrics.md "Joining vLLM's own series").
VLLM_SERIES = {"vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_prompt_tokens_count"}


def test_promtool_checks_the_prometheus_config_and_the_rules_it_loads() -> None:
    checked = promtool("check", "config", "prometheus.yml")
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0, output
    assert "SUCCESS: 1 rule files found" in output
    assert f"Checking {RULES.relative_to(DOCKER)}" in output


def test_promtool_checks_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(shipped_rules())} rules found" in checked.stdout


@pytest.mark.parametrize("rule_test", RULE_TESTS, ids=lambda path: path.name)
def test_promtool_unit_tests_of_the_alerting_rules_pass(rule_test: Path) -> None:
    checked = promtool("test", "rules", str(rule_test))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_every_alert_and_recording_rule_is_unit_tested() -> None:
    """Each alert fires in some test, and each recording rule is evaluated by its own name (beside the joins of
    the docs, which the tests evaluate too)."""
    tests = [test for path in RULE_TESTS for test in yaml.safe_load(path.read_text())["tests"]]
    alerted = {
        case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    evaluated = {case["expr"] for test in tests for case in test.get("promql_expr_test", []) if case.get("exp_samples")}
    assert {rule["alert"] for rule in shipped_rules() if "alert" in rule} == alerted
    assert set(recorded_names()) <= evaluated


@pytest.fixture
def scraped_names(start_exporter: Callable[..., ExporterProcess]) -> set[str]:
    """Every sample name of a real scrape, with ready responses that fill every gauge pushed first."""
    exporter = start_exporter()
    for fixture in ("hybrid-tp1-post50809", "dp2-rank0", "dp2-rank1"):
        push_ready(exporter.url, fixture.split("-")[0], fixture_bytes(fixture))
    # An engine core's KV-cache groups, as the plugin adds them, with the granularity its prefix-cache hits land on.
    grouped = msgspec.msgpack.decode(ready_payload(releases()[-1]))
    grouped[KV_CACHE_GROUPS_KEY] = groups(("MambaSpec", 640), ("FullAttentionSpec", 640)) | {
        "cache_hit_alignment_tokens": 640
    }
    push_ready(exporter.url, "grouped", msgspec.msgpack.encode(grouped))
    return sample_names(scrape(exporter.url))


def test_the_dashboard_only_queries_metrics_the_exporter_exposes(scraped_names: set[str]) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    known = scraped_names | VLLM_SERIES | set(recorded_names())
    for query in queries:
        names = metric_names(query)
        assert names, f"no metric in {query}"
        assert names <= known, f"{query} needs {names - known}, neither exposed nor recorded by docker/rules"
    used = set().union(*(metric_names(query) for query in queries))
    for gauge in ("cache_config_block_size", "cache_config_num_gpu_blocks", "cache_config_data_parallel_size"):
        assert gauge in used
    assert "cache_config_info" not in used, "the dashboard reads numeric gauges, not info labels"


def test_the_alerting_rules_only_use_metrics_the_exporter_exposes(scraped_names: set[str]) -> None:
    known = scraped_names | SCRAPE_SERIES | VLLM_SERIES | set(recorded_names())
    for rule in shipped_rules():
        names = metric_names(rule["expr"])
        assert names, rule["expr"]
        assert names <= known, f"{rule.get('alert', rule.get('record'))} needs {names - known}"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'max by (deployment, engine) (cache_config_block_size{deployment=~"$deployment"})',
            {"cache_config_block_size"},
        ),
        ("sum(rate(a_total[$__rate_interval])) / on (x) group_left (y) b", {"a_total", "b"}),
        ('count by (d) (c{f="by (x)",g!~"{}"} offset 5m) > bool 1e3', {"c"}),
        (
            'up{job="x"} == 0 and absent(nothing{a="b"}) unless ignoring (i) z:recorded:rate5m',
            {"up", "nothing", "z:recorded:rate5m"},
        ),
    ],
)
def test_metric_names_reads_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_dashboard_is_provisioned_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "cache-config-exporter"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["type"] in {"table", "timeseries", "stat", "bargauge"}
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert {target["datasource"]["uid"] for target in panel["targets"]} == {"${datasource}"}
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/cache-config-exporter.yml").read_text())
    datasource = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["uid"] == dashboard["templating"]["list"][0]["current"]["value"]
    # The compose file mounts the dashboards where the provider reads them.
    grafana = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in grafana["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def test_compose_wires_the_exporter_prometheus_the_push_job_and_grafana() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"exporter", "push-hybrid-fixture", "prometheus", "grafana"}
    for name in ("exporter", "push-hybrid-fixture"):
        assert (REPO / "docker" / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).is_file()
    push_job = services["push-hybrid-fixture"]
    assert push_job["depends_on"] == {"exporter": {"condition": "service_healthy"}}
    fixtures, mounted = push_job["volumes"][0].split(":")[:2]
    assert (DOCKER / fixtures / push_job["command"][1].removeprefix(mounted + "/")).is_file()
    assert "--url=http://exporter:10987" in push_job["command"]
    # Prometheus scrapes the exporter service under the job name the rules expect.
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["exporter:10987"]
    assert f'up{{job="{job["job_name"]}"}}' in RULES.read_text()
    for volume in services["prometheus"]["volumes"][:2]:
        assert (DOCKER / volume.split(":")[0]).exists()


def test_compose_file_is_valid_for_docker_compose() -> None:
    compose = require_binary("docker-compose")
    checked = subprocess.run(
        [compose, "--file", str(DOCKER / "compose.yaml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr


def test_the_shell_scripts_pass_shellcheck() -> None:
    checked = subprocess.run(
        [require_binary("shellcheck"), *sorted(map(str, DOCKER.glob("*.sh"))), str(REPO / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout


def test_the_image_healthcheck_follows_the_listen_address(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()

    def healthcheck(address: str) -> subprocess.CompletedProcess[str]:
        environment = {**os.environ, "CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS": address}
        return subprocess.run(
            [sys.executable, str(DOCKER / "healthcheck.py")],
            env=environment,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    assert healthcheck(f"127.0.0.1:{exporter.port}").returncode == 0
    assert healthcheck(f"0.0.0.0:{exporter.port}").returncode == 0
    refused = healthcheck(f"127.0.0.1:{free_port()}")
    assert refused.returncode == 1
    assert "unhealthy" in refused.stderr
