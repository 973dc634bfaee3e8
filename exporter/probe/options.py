"""The probe's group of ``serve``'s flags, ``--probe.*``, and what else the prober reads of the joined settings
(``ProbeSettings``). Declared here so that the probe names its own flags in its messages (``probe_flag``)
without the command line, which joins this group with the others into ``Settings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from exporter.exposition.series import InfoLabels
from exporter.flags.option import file_setting, flag_in, list_setting, setting


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


def probe_flag(name: str) -> str:
    """The flag of the probe setting ``name``, for messages: ``probe_flag("probe_timeout_seconds")`` is
    ``--probe.timeout``."""
    return flag_in(ProbeOptions, name)


class ProbeSettings(Protocol):
    """What the prober reads of the joined settings: its own group, and the engine cap, the metric prefix and the
    label choices, which other groups own (``exporter.config.settings.Settings`` is one)."""

    probe_allowed_targets: tuple[str, ...]
    probe_timeout_seconds: float
    probe_max_body_bytes: int
    probe_max_concurrent: int
    probe_scheme: str
    probe_tls_ca_file: Path | None
    probe_tls_server_name: str
    probe_tls_insecure_skip_verify: bool
    probe_bearer_token_file: Path | None
    probe_basic_auth_username: str
    probe_basic_auth_password_file: Path | None
    max_engines_per_replica: int
    metric_prefix: str

    def info_labels(self) -> InfoLabels: ...

    def flag(self, name: str) -> str:
        """The flag of any setting ``name``, for messages about a setting of another group."""
        ...
