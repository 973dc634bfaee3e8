"""The flags of ``serve``, declared once as a table in four groups (the web server, the state, the metrics,
the probe): each field is a setting with its ``Option``. ``Settings`` joins the groups and checks them together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from exporter.config.addresses import LISTEN_ADDRESS_FLAG, allowed_hosts
from exporter.config.option import file_setting, list_setting, setting
from exporter.exposition.series import LABEL_PRESETS

# 9100-9999, Prometheus' exporter range, is fully allocated; see docs/operators.md, "Default port".
DEFAULT_PORT = 10987
LOG_LEVELS = ("debug", "info", "warning", "error")


def default_storage_path() -> Path:
    """``$XDG_STATE_HOME/cache-config-exporter/exporter.db`` (``~/.local/state`` when unset)."""
    state_home = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state_home) / "cache-config-exporter" / "exporter.db"


@dataclass(frozen=True)
class WebOptions:
    """How the exporter listens and serves: ``--web.*``."""

    listen_address: str = setting(
        f"127.0.0.1:{DEFAULT_PORT}",
        LISTEN_ADDRESS_FLAG,
        f"HOST:PORT to listen on (:{DEFAULT_PORT}: every interface)",
    )
    telemetry_path: str = setting("/metrics", "--web.telemetry-path", "path of the metrics")
    workers: int = setting(1, "--web.workers", "worker processes sharing the storage")
    ingest_token_file: Path | None = file_setting(
        "--web.ingest-token-file",
        "file with the bearer tokens that ingest and changes require; without it ingest is open, "
        "on a loopback address only unless --web.allow-unauthenticated-ingest",
    )
    allow_unauthenticated_ingest: bool = setting(
        False, "--web.allow-unauthenticated-ingest", "allow ingest without a token on a non-loopback address"
    )
    metrics_token_file: Path | None = file_setting(
        "--web.metrics-token-file",
        "file with the bearer tokens that reading metrics and state requires; without it reading is open",
    )
    web_config_file: Path | None = file_setting(
        "--web.config.file",
        "exporter-toolkit web config (tls_server_config, basic_auth_users, http_server_config.headers), "
        "re-read when it changes; without it plain HTTP and no basic auth",
    )
    metrics_basic_auth_file: Path | None = file_setting(
        "--web.metrics-basic-auth-file",
        "deprecated, plain-text USER:PASSWORD lines; use basic_auth_users (bcrypt) in --web.config.file",
    )
    tls_cert_file: Path | None = file_setting(
        "--web.tls-cert-file",
        "TLS certificate (PEM); with --web.tls-key-file, serve HTTPS "
        "(tls_server_config of --web.config.file does the same)",
    )
    tls_key_file: Path | None = file_setting("--web.tls-key-file", "TLS private key (PEM)")
    max_request_bytes: int = setting(64 * 1024, "--web.max-request-bytes", "largest request body accepted (413 above)")
    read_timeout_seconds: float = setting(
        10.0, "--web.read-timeout", "seconds a client may take to send a request body (408 after)"
    )
    max_connections: int = setting(
        1024,
        "--web.max-connections",
        "concurrent connections; at the cap a new one closes an idle kept-alive one, or gets 503 if none is idle",
    )
    keep_alive_timeout_seconds: float = setting(
        65.0,
        "--web.keep-alive-timeout",
        "seconds an idle connection is kept for its next request: longer than the plugin's heartbeat interval "
        "(30 s), so that its heartbeats reuse one connection",
    )
    max_header_bytes: int = setting(
        16 << 10, "--web.max-header-bytes", "largest request line and headers accepted (431 above)"
    )
    header_timeout_seconds: float = setting(
        10.0,
        "--web.header-timeout",
        "seconds a client may take to send a request's line and headers (408 after, connection closed)",
    )
    shutdown_timeout_seconds: float = setting(
        10.0,
        "--web.shutdown-timeout",
        "seconds SIGTERM waits for open requests; connections still open then are closed and the exporter exits 0",
    )
    # Host names served besides loopback ones; None serves any (see ``allowed_hosts``).
    allowed_hosts: tuple[str, ...] | None = setting(
        None,
        "--web.allowed-hosts",
        "comma-separated Host names served besides loopback ones, '*' for any (421 otherwise, against DNS "
        "rebinding); empty: on a loopback address only localhost, 127.0.0.0/8 and ::1, elsewhere any name",
        flag_default="",
        parse=allowed_hosts,
        context=("listen_address",),
    )


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
