"""The exporter's settings, their defaults, and the base cache config file they may name."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from protocol import CacheConfig, InvalidPayload, apply_update, decode_cache_config_update

# 9100-9999, Prometheus' exporter range, is fully allocated; see README "Default port".
DEFAULT_PORT = 10987
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_CONFIG_FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}


def default_storage_path() -> Path:
    """``$XDG_STATE_HOME/cache-config-exporter/exporter.db`` (``~/.local/state`` when unset)."""
    state_home = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state_home) / "cache-config-exporter" / "exporter.db"


class SettingsError(ValueError):
    """A setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Settings:
    listen_address: str = f"127.0.0.1:{DEFAULT_PORT}"
    telemetry_path: str = "/metrics"
    storage_path: Path = field(default_factory=default_storage_path)
    cache_config_file: Path | None = None
    metric_prefix: str = ""
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.metric_prefix and not _METRIC_PREFIX.fullmatch(self.metric_prefix):
            raise SettingsError(f"--metric.prefix {self.metric_prefix!r} is not a valid metric name prefix")
        if not self.telemetry_path.startswith("/") or self.telemetry_path.startswith("/api/"):
            raise SettingsError(f"--web.telemetry-path {self.telemetry_path!r} must start with / and not with /api/")
        split_listen_address(self.listen_address)

    def base_config(self) -> CacheConfig:
        """vLLM's defaults, overridden by ``--cache-config.file`` when given."""
        if self.cache_config_file is None:
            return CacheConfig()
        path = self.cache_config_file
        document_format = _CONFIG_FORMATS.get(path.suffix.lower())
        if document_format is None:
            raise SettingsError(f"--cache-config.file {path}: use a .json, .toml, .yaml or .yml file")
        try:
            update = decode_cache_config_update(path.read_bytes(), document_format)
        except OSError as error:
            raise SettingsError(f"--cache-config.file {path}: {error.strerror}") from None
        except InvalidPayload as error:
            raise SettingsError(f"--cache-config.file {path}: {error.reason} at {error.field}") from None
        return apply_update(CacheConfig(), update)


def split_listen_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every IPv4 interface) as (host, port)."""
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"--web.listen-address {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    return host, int(port)
