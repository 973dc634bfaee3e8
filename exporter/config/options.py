"""The option groups of the parts whose value types the command line carries (the state's limits, the output's
label choices): each field is a setting with its ``Option``. ``Settings`` joins them with the web group
(``exporter/security/options.py``) and the probe's, and checks them together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from exporter.exposition.series import LABEL_PRESETS
from exporter.flags.option import file_setting, list_setting, setting

LOG_LEVELS = ("debug", "info", "warning", "error")


def default_storage_path() -> Path:
    """``$XDG_STATE_HOME/cache-config-exporter/exporter.db`` (``~/.local/state`` when unset)."""
    state_home = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state_home) / "cache-config-exporter" / "exporter.db"


@dataclass(frozen=True)
class StateOptions:
    """What the exporter keeps: ``--limits.*``, ``--expiry.*``, ``--storage.*``, ``--cache-config.*``."""

    max_deployments: int = setting(10_000, "--limits.deployments", "most deployments kept")
    max_replicas_per_deployment: int = setting(
        1_024, "--limits.replicas-per-deployment", "most replicas (vLLM servers) kept per deployment"
    )
    # Per replica: one vLLM server's data-parallel engines.
    max_engines_per_replica: int = setting(
        1_024, "--limits.engines-per-deployment", "most engines kept per replica of a deployment"
    )
    # 80,000 engines of DP=8 servers (a hybrid model's, about 310 engines a MiB) with half again to spare.
    max_bytes: int = setting(
        384 << 20,
        "--limits.bytes",
        "most bytes all deployments take: the rendered exposition, the ready responses as received and as JSON",
    )
    missed_heartbeats: int = setting(
        3, "--expiry.missed-heartbeats", "a replica that promised heartbeats expires after missing this many"
    )
    storage_path: Path = setting(
        None,
        "--storage.path",
        "SQLite file that keeps every accepted ready response",
        default_factory=default_storage_path,
        documented="$XDG_STATE_HOME/cache-config-exporter/exporter.db",
    )
    cache_config_file: Path | None = file_setting(
        "--cache-config.file",
        "JSON, TOML or YAML file with the base cache config (labels) of every deployment; without it vLLM's defaults",
    )


@dataclass(frozen=True)
class OutputOptions:
    """How the metrics look, and the log: ``--metric.*``, ``--log.*``."""

    metric_prefix: str = setting(
        "", "--metric.prefix", "prefix of the cache_config_* metric names ('vllm:' gives vLLM's names)"
    )
    # kube-state-metrics' --metric-labels-allowlist, for the one metric that has labels to choose.
    metric_labels_allowlist: tuple[str, ...] = list_setting(
        "--metric.labels-allowlist",
        "comma-separated vLLM labels cache_config_info keeps (deployment, replica and engine always stay); "
        "empty: every label",
    )
    metric_labels_denylist: tuple[str, ...] = list_setting(
        "--metric.labels-denylist",
        "comma-separated vLLM labels cache_config_info drops; excludes --metric.labels-allowlist",
    )
    # An allowlist by name, for backends that cap label names (Grafana Mimir and Cortex: 30 by default).
    metric_labels_preset: str = setting(
        "",
        "--metric.labels-preset",
        f"named set of vLLM labels cache_config_info keeps: {', '.join(LABEL_PRESETS)} (docs/metrics.md lists them); "
        "--metric.labels-denylist drops names from it, --metric.labels-allowlist excludes it; empty: none",
        choices=tuple(LABEL_PRESETS),
    )
    log_level: str = setting("info", "--log.level", "log level", choices=LOG_LEVELS)
