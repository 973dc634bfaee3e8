"""The exporter's settings, their defaults and checks, and the files they name (base config, secrets)."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from protocol import InvalidPayload, decode_static_labels

# 9100-9999, Prometheus' exporter range, is fully allocated; see README "Default port".
DEFAULT_PORT = 10987
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_CONFIG_FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}
# Where ``serve --web.workers N`` hands the settings to its worker processes.
SETTINGS_ENVIRONMENT = "CACHE_CONFIG_EXPORTER_SETTINGS_JSON"


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
    workers: int = 1
    ingest_token_file: Path | None = None
    allow_unauthenticated_ingest: bool = False
    metrics_token_file: Path | None = None
    metrics_basic_auth_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    web_config_file: Path | None = None
    max_request_bytes: int = 64 * 1024
    read_timeout_seconds: float = 10.0
    max_connections: int = 1024
    max_deployments: int = 10_000
    max_replicas_per_deployment: int = 1_024
    # Per replica: one vLLM server's data-parallel engines.
    max_engines_per_deployment: int = 1_024
    max_bytes: int = 128 << 20
    max_header_bytes: int = 16 << 10
    header_timeout_seconds: float = 10.0
    shutdown_timeout_seconds: float = 10.0
    # Host names served besides loopback ones; None serves any (see ``allowed_hosts``).
    allowed_hosts: tuple[str, ...] | None = None
    missed_heartbeats: int = 3

    def __post_init__(self) -> None:
        if self.metric_prefix and not _METRIC_PREFIX.fullmatch(self.metric_prefix):
            raise SettingsError(f"--metric.prefix {self.metric_prefix!r} is not a valid metric name prefix")
        if not self.telemetry_path.startswith("/") or self.telemetry_path.startswith(("/api/", "/-/")):
            raise SettingsError(f"--web.telemetry-path {self.telemetry_path!r} must start with / (not /api/ or /-/)")
        for flag, value in (
            ("--web.workers", self.workers),
            ("--web.max-request-bytes", self.max_request_bytes),
            ("--web.max-connections", self.max_connections),
            ("--limits.deployments", self.max_deployments),
            ("--limits.replicas-per-deployment", self.max_replicas_per_deployment),
            ("--limits.engines-per-deployment", self.max_engines_per_deployment),
            ("--expiry.missed-heartbeats", self.missed_heartbeats),
            ("--web.read-timeout", self.read_timeout_seconds),
            ("--limits.bytes", self.max_bytes),
            ("--web.max-header-bytes", self.max_header_bytes),
            ("--web.header-timeout", self.header_timeout_seconds),
            ("--web.shutdown-timeout", self.shutdown_timeout_seconds),
        ):
            if value <= 0:
                raise SettingsError(f"{flag} must be positive, got {value}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SettingsError("--web.tls-cert-file and --web.tls-key-file go together")
        if self.web_config_file is not None:
            if self.tls_cert_file is not None:
                raise SettingsError(
                    "--web.tls-cert-file/--web.tls-key-file and --web.config.file exclude each other: "
                    "put cert_file and key_file under tls_server_config in the web config file"
                )
            if self.metrics_basic_auth_file is not None:
                raise SettingsError(
                    "--web.metrics-basic-auth-file and --web.config.file exclude each other: "
                    "put the users, with bcrypt hashes, under basic_auth_users in the web config file"
                )
        host, _ = split_listen_address(self.listen_address)
        if not (_is_loopback(host) or self.ingest_token_file or self.allow_unauthenticated_ingest):
            raise SettingsError(
                f"--web.listen-address {self.listen_address} is reachable from other hosts, so ingest needs "
                "--web.ingest-token-file (or --web.allow-unauthenticated-ingest to accept anyone's ready responses)"
            )

    def base_labels(self) -> dict[str, str]:
        """Labels laid under every deployment's own, from ``--cache-config.file`` when given."""
        if self.cache_config_file is None:
            return {}
        path = self.cache_config_file
        document_format = _CONFIG_FORMATS.get(path.suffix.lower())
        if document_format is None:
            raise SettingsError(f"--cache-config.file {path}: use a .json, .toml, .yaml or .yml file")
        try:
            return decode_static_labels(read_file("--cache-config.file", path), document_format)
        except InvalidPayload as error:
            raise SettingsError(f"--cache-config.file {path}: {error.reason} at {error.field}") from None

    def to_environment(self) -> str:
        """These settings as JSON, for worker processes (``from_environment`` reads them back)."""
        return msgspec.json.encode(self, enc_hook=str).decode()

    @classmethod
    def from_environment(cls) -> Settings:
        return msgspec.json.decode(os.environ[SETTINGS_ENVIRONMENT], type=cls, dec_hook=_decode_path)


def allowed_hosts(flag: str, listen_host: str) -> tuple[str, ...] | None:
    """``--web.allowed-hosts``: a comma-separated list of host names served besides loopback ones; ``*`` serves
    any. Empty: loopback names only on a loopback listener (against DNS rebinding), any name otherwise."""
    names = tuple(name.strip().lower().rstrip(".") for name in flag.split(",") if name.strip())
    if "*" in names or (not names and not _is_loopback(listen_host)):
        return None
    return names


def _decode_path(kind: type, value: object) -> Path:
    if kind is Path and isinstance(value, str):
        return Path(value)
    raise NotImplementedError(kind)


def read_file(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise SettingsError(f"{flag} {path}: {error.strerror}") from None


def read_secret(flag: str, path: Path) -> str:
    """A secret from a file (surrounding white space stripped); never echoed in messages."""
    secret = read_file(flag, path).decode("utf-8", "replace").strip()
    if not secret:
        raise SettingsError(f"{flag} {path}: the file is empty")
    return secret


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_listen_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every IPv4 interface) as (host, port)."""
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(f"--web.listen-address {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    return host, int(port)
