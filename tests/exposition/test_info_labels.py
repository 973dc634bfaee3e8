"""Choosing ``cache_config_info``'s labels (``--metric.labels-preset``, ``-allowlist``, ``-denylist``) for backends that
cap label names: Grafana Mimir and Cortex refuse series of more than 30 by default."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from exporter.exposition.series import IDENTITY, LABEL_PRESETS
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

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
MSGPACK = {"Content-Type": "application/vnd.msgpack"}
# Mimir's and Cortex's default max_label_names_per_series.
MIMIR_MAX_LABEL_NAMES = 30
# What Prometheus adds to every scraped series: the name, the job and instance, and the join label of the docs.
ADDED_BY_PROMETHEUS = ("__name__", "job", "instance", "exporter")


def documented_compact_set() -> list[str]:
    """The labels docs/metrics.md lists as the compact set."""
    (listed,) = re.findall(r"<!-- labels-preset:compact -->(.*?)<!-- end -->", METRICS_PAGE.read_text(), re.S)
    return re.findall(r"`(\w+)`", listed)


def newest_engine_labels(client: TestClient) -> dict[str, str]:
    """Push a hybrid engine of the newest vLLM release (its own ``cache_config_info`` labels) and scrape it."""
    release = releases()[-1]
    pushed = client.post("/api/v1/deployments/qwen/ready", content=ready_payload(release), headers=MSGPACK)
    assert pushed.status_code == 200, pushed.text
    return info_labels(scrape(client), "qwen")["0"]


def test_every_label_is_too_many_for_mimir(make_client: Callable[..., TestClient]) -> None:
    labels = newest_engine_labels(make_client())
    assert len(labels) + len(ADDED_BY_PROMETHEUS) > MIMIR_MAX_LABEL_NAMES


def test_the_docs_list_the_compact_preset_as_it_is() -> None:
    assert documented_compact_set() == list(LABEL_PRESETS["compact"])


def test_the_compact_preset_stays_under_mimirs_limit_and_keeps_the_true_block_sizes(
    make_client: Callable[..., TestClient],
) -> None:
    labels = newest_engine_labels(make_client(metric_labels_preset="compact"))
    assert set(labels) == {*IDENTITY, *documented_compact_set()}
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


def test_a_denylist_drops_names_from_the_preset(make_client: Callable[..., TestClient]) -> None:
    denied = ("gpu_memory_utilization", "num_cpu_blocks")
    labels = newest_engine_labels(make_client(metric_labels_preset="compact", metric_labels_denylist=denied))
    assert set(labels) == {*IDENTITY, *documented_compact_set()} - set(denied)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ("--metric.labels-allowlist", "block_size", "--metric.labels-denylist", "cache_dtype"),
            "--metric.labels-allowlist and --metric.labels-denylist cannot be combined: give one of them",
            id="allowlist-and-denylist",
        ),
        pytest.param(
            ("--metric.labels-preset", "compact", "--metric.labels-allowlist", "block_size"),
            "--metric.labels-preset and --metric.labels-allowlist cannot be combined",
            id="preset-and-allowlist",
        ),
        # A typo would drop the label without a word: refused, with the nearest names every release table knows.
        pytest.param(
            ("--metric.labels-allowlist", "block_size,blok_size,future_label"),
            f"--metric.labels-allowlist: no vLLM release from {releases()[0].version} to {releases()[-1].version} "
            "has a label named 'blok_size' (did you mean block_size, hash_block_size or mamba_block_size?) or "
            "'future_label'",
            id="unknown-allowed",
        ),
        pytest.param(
            ("--metric.labels-denylist", "kv_cache_dtype_skip_layer"),
            "has a label named 'kv_cache_dtype_skip_layer' (did you mean kv_cache_dtype_skip_layers",
            id="unknown-denied",
        ),
        pytest.param(
            ("--metric.labels-denylist", "deployment"),
            "--metric.labels-denylist cannot drop deployment: deployment, replica and engine tell the series apart, "
            "so they are always kept",
            id="identity-denied",
        ),
        pytest.param(
            ("--metric.labels-denylist", "replica,engine"),
            "--metric.labels-denylist cannot drop replica or engine:",
            id="identities-denied",
        ),
        pytest.param(
            ("--metric.labels-preset", "compact", "--metric.labels-denylist", "kv_cache_dtype_skip_layers"),
            "--metric.labels-denylist names 'kv_cache_dtype_skip_layers', which the compact preset does not keep "
            "anyway: there is nothing to drop",
            id="denied-outside-the-preset",
        ),
    ],
)
def test_serve_exits_2_on_label_choices_that_cannot_work(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    served = run_cli("serve", "--storage.path", str(tmp_path / "x.db"), *flags)
    assert served.returncode == 2
    assert message in served.stderr


def test_a_preset_named_in_the_environment_that_does_not_exist_stops_serve(tmp_path: Path) -> None:
    """The flag's choices refuse it on the command line; from the environment it reaches the settings' check."""
    served = run_cli(
        "serve", "--storage.path", str(tmp_path / "x.db"), env={"CACHE_CONFIG_EXPORTER_METRIC_LABELS_PRESET": "compat"}
    )
    assert served.returncode == 2
    assert "--metric.labels-preset: there is no preset 'compat' (known presets: compact)" in served.stderr


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
