"""Choosing ``cache_config_info``'s labels (``--metric.labels-allowlist``/``-denylist``) for backends that cap label
names: Grafana Mimir and Cortex refuse series of more than 30 by default."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from exporter.exposition.series import IDENTITY
from protocol import releases
from tests.helpers.exposition import info_labels, samples
from tests.helpers.release_payloads import ready_payload
from tests.probe.test_probe import (  # noqa: F401  (serve_target: a fixture)
    LOOPBACK,
    MODEL,
    TargetServer,
    probed,
    recorded_line,
    serve_target,
    vllm_target,
)
from tests.server.test_cli import run_cli
from tests.server.test_service import scrape
from tests.support import ExporterProcess, wait_until

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
MSGPACK = {"Content-Type": "application/vnd.msgpack"}
# Mimir's and Cortex's default max_label_names_per_series.
MIMIR_MAX_LABEL_NAMES = 30
# What Prometheus adds to every scraped series: the name, the job and instance, and the join label of the docs.
ADDED_BY_PROMETHEUS = ("__name__", "job", "instance", "exporter")


def readme_compact_set() -> list[str]:
    """The allowlist docs/metrics.md documents as the compact set."""
    page = METRICS_PAGE.read_text()
    (listed,) = re.findall(r"^cache-config-exporter serve --metric\.labels-allowlist (\S+)$", page, re.M)
    return listed.split(",")


def newest_engine_labels(client: TestClient) -> dict[str, str]:
    """Push a hybrid engine of the newest vLLM release (its own ``cache_config_info`` labels) and scrape it."""
    release = releases()[-1]
    pushed = client.post("/api/v1/deployments/qwen/ready", content=ready_payload(release), headers=MSGPACK)
    assert pushed.status_code == 200, pushed.text
    return info_labels(scrape(client), "qwen")["0"]


def test_every_label_is_too_many_for_mimir(make_client: Callable[..., TestClient]) -> None:
    labels = newest_engine_labels(make_client())
    assert len(labels) + len(ADDED_BY_PROMETHEUS) > MIMIR_MAX_LABEL_NAMES


def test_the_readme_compact_set_stays_under_mimirs_limit_and_keeps_the_true_block_sizes(
    make_client: Callable[..., TestClient],
) -> None:
    compact = readme_compact_set()
    labels = newest_engine_labels(make_client(metric_labels_allowlist=tuple(compact)))
    assert set(labels) == {*IDENTITY, *compact}
    total = len(labels) + len(ADDED_BY_PROMETHEUS)
    assert total < MIMIR_MAX_LABEL_NAMES
    assert total + 5 < MIMIR_MAX_LABEL_NAMES, "leave room for a few target labels (namespace, pod, cluster)"
    # The true block sizes, not vLLM's configured 16.
    assert (labels["block_size"], labels["mamba_block_size"]) == ("1056", "1056")


def test_an_allowlist_keeps_its_labels_in_vllms_order_and_touches_no_other_series(
    make_client: Callable[..., TestClient],
) -> None:
    client = make_client(metric_labels_allowlist=("num_gpu_blocks", "mamba_block_size", "engine", "cache_dtype"))
    labels = newest_engine_labels(client)
    assert list(labels) == ["deployment", "replica", "engine", "cache_dtype", "mamba_block_size", "num_gpu_blocks"]
    exposition = scrape(client)
    (block_size,) = samples(exposition, "cache_config_block_size")
    assert (block_size.labels, block_size.value) == ({"deployment": "qwen", "replica": "default", "engine": "0"}, 1056)


def test_a_denylist_drops_only_its_labels(make_client: Callable[..., TestClient], tmp_path: Path) -> None:
    every = newest_engine_labels(make_client(storage_path=tmp_path / "every.db"))
    denied = ("kv_cache_dtype_skip_layers", "_block_size_resolved")
    labels = newest_engine_labels(make_client(metric_labels_denylist=denied))
    assert list(labels) == [name for name in every if name not in denied]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--metric.labels-allowlist", "block_size", "--metric.labels-denylist", "cache_dtype"),
            "--metric.labels-allowlist and --metric.labels-denylist: the allowlist and the denylist exclude each other",
        ),
        (("--metric.labels-allowlist", "block_size,block-size"), "--metric.labels-allowlist: 'block-size' is not"),
        (("--metric.labels-denylist", "replica,engine"), "--metric.labels-denylist: engine, replica identify each"),
    ],
)
def test_serve_exits_2_on_label_lists_that_cannot_work(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    served = run_cli("serve", "--storage.path", str(tmp_path / "x.db"), *flags)
    assert served.returncode == 2
    assert message in served.stderr


def test_a_name_no_release_has_is_kept_and_logged_once_as_a_warning(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    # A newer vLLM may add a label; a typo looks the same, so the exporter says so but starts.
    flags = ("--web.workers", "2", "--metric.labels-allowlist", "block_size,blok_size,future_label")
    exporter = start_exporter(*flags)
    warning = "no vLLM release known here has the label(s) blok_size, future_label named by --metric.labels-*"
    # Once, not once per worker: both workers have started when each has logged its start-up.
    log = wait_until(lambda: text if (text := exporter.log.read_text()).count("startup complete") == 2 else None)
    assert log.count(warning) == 1


def test_a_probe_answers_only_the_allowlisted_labels_too(
    make_client: Callable[..., TestClient],
    serve_target: Callable[..., TargetServer],  # noqa: F811
) -> None:
    # /probe answers Prometheus too, so its series go where /metrics' go (a remote_write to Mimir).
    client = make_client(probe_allowed_targets=(LOOPBACK,), metric_labels_allowlist=("block_size", "mamba_block_size"))
    target = vllm_target(serve_target, recorded_line("qwen3-next"))
    (labels,) = info_labels(probed(client, target), MODEL).values()
    assert labels == {"deployment": MODEL, "replica": target, "engine": "0", "block_size": "640",
                      "mamba_block_size": "640"}  # fmt: skip
