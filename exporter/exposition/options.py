"""The output's options group: how the metrics look, and the log (``--metric.*``, ``--log.*``), each field a
setting with its ``Option``; the command line joins it with the other parts' groups
(``exporter/config/settings.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.exposition.series import LABEL_PRESETS
from exporter.flags.option import list_setting, setting

LOG_LEVELS = ("debug", "info", "warning", "error")


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
