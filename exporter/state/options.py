"""The state's options group: what the exporter keeps (``--limits.*``, ``--expiry.*``, ``--storage.*``,
``--cache-config.*``), each field a setting with its ``Option``; the command line joins it with the other parts'
groups (``exporter/config/settings.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from exporter.flags.option import file_setting, setting


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
        1_024,
        "--limits.engines-per-replica",
        "most engines kept per replica of a deployment",
        formerly=("--limits.engines-per-deployment",),
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
