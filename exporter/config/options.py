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


@dataclass(frozen=True)
class ProbeOptions:
    """How ``/probe`` reaches stock vLLM servers: ``--probe.*``."""

    # /probe (exporter/probe/prober.py): off until targets are allowed, so that the exporter is nobody's proxy.
    probe_allowed_targets: tuple[str, ...] = list_setting(
        "--probe.allowed-targets",
        "comma-separated targets /probe may fetch: CIDRs (10.0.0.0/8) and HOST:PORT patterns with * and ? "
        "(vllm-*.example:8000, gpu-?:*); empty: /probe answers 403",
    )
    # A probe-only exporter needs nothing that ingest needs: no token on a public address, no writable store.
    probe_only: bool = setting(
        False,
        "--probe.only",
        "serve /probe, the exporter's own metrics and health alone: no ingest routes, no ingest token, "
        "no storage opened; needs --probe.allowed-targets",
    )
    probe_timeout_seconds: float = setting(
        10.0,
        "--probe.timeout",
        "most seconds a probe takes; Prometheus' X-Prometheus-Scrape-Timeout-Seconds less 0.5 s shortens it",
    )
    probe_max_body_bytes: int = setting(
        8 << 20, "--probe.max-body-bytes", "largest /metrics body a probe reads; past it the probe fails"
    )
    # A probe holds its slot until it answers (a target that never answers: until its timeout); no queue.
    probe_max_concurrent: int = setting(
        16, "--probe.max-concurrent", "most probes running at once; past it /probe answers 503 at once (retry)"
    )
    probe_scheme: str = setting("http", "--probe.scheme", "how /probe reaches targets", choices=("http", "https"))
    probe_tls_ca_file: Path | None = file_setting(
        "--probe.tls-ca-file", "CA certificates (PEM) that sign the targets' certificates; default: the system's"
    )
    probe_tls_server_name: str = setting(
        "", "--probe.tls-server-name", "name the targets' certificates must hold; empty: the target's host"
    )
    probe_tls_insecure_skip_verify: bool = setting(
        False, "--probe.tls-insecure-skip-verify", "accept any certificate from targets (not for production)"
    )
    probe_bearer_token_file: Path | None = file_setting(
        "--probe.bearer-token-file", "file with the bearer token targets' /metrics require, re-read on change"
    )
    probe_basic_auth_username: str = setting(
        "", "--probe.basic-auth-username", "user for targets' /metrics behind basic auth"
    )
    probe_basic_auth_password_file: Path | None = file_setting(
        "--probe.basic-auth-password-file",
        "file with that user's password, re-read on change",
    )
