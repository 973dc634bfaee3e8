"""The exporter's settings, each declared once with its flag, and the files they name (base config, secrets).

Every ``Settings`` field carries its ``Option``: the flag of ``serve``, its help and how its text is read.
From these come the command line's flags and their environment variables (``CACHE_CONFIG_EXPORTER_`` and
the flag's name), the flag names in messages (``flag_of``) and the table of flags in the README
(``python -m exporter.settings --markdown``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from exporter.limits import Limits
from exporter.probe_targets import AllowList
from exporter.series import InfoLabels, LabelChoiceError
from protocol import InvalidPayload, decode_static_labels

# 9100-9999, Prometheus' exporter range, is fully allocated; see README "Default port".
DEFAULT_PORT = 10987
ENV_PREFIX = "CACHE_CONFIG_EXPORTER_"
LOG_LEVELS = ("debug", "info", "warning", "error")
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_CONFIG_FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}
_TRUE = ("1", "true", "yes", "on")
# Where ``serve --web.workers N`` hands the settings to its worker processes.
SETTINGS_ENVIRONMENT = "CACHE_CONFIG_EXPORTER_SETTINGS_JSON"
# The key of a ``Settings`` field's ``Option`` in the field's metadata.
_OPTION = "option"


def default_storage_path() -> Path:
    """``$XDG_STATE_HOME/cache-config-exporter/exporter.db`` (``~/.local/state`` when unset)."""
    state_home = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state_home) / "cache-config-exporter" / "exporter.db"


def env_name(flag: str) -> str:
    """``--web.listen-address`` -> ``CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS``."""
    return ENV_PREFIX + flag.lstrip("-").replace(".", "_").replace("-", "_").upper()


class SettingsError(ValueError):
    """A setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Option:
    """One flag, declared once: its name, help and default, how its text is read; its environment variable
    and its row in the README follow from these.

    ``parse`` turns the flag's text into the value (``None``: the text itself; for a setting, read by its type).
    ``context`` names settings whose values ``parse`` takes after the text. ``documented`` is the default as
    the README tells it, where the machine decides the value.
    """

    flag: str
    help: str
    default: object = None
    default_factory: Callable[[], object] | None = None
    parse: Callable[..., object] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    context: tuple[str, ...] = ()
    documented: str | None = None

    @property
    def variable(self) -> str:
        return env_name(self.flag)

    @property
    def dest(self) -> str:
        """The attribute of argparse's namespace: the variable's name without the prefix, lower case."""
        return self.variable.removeprefix(ENV_PREFIX).lower()

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """The flag, whose default comes from its environment variable, then from the declaration."""
        if self.switch:
            enabled = os.environ.get(self.variable, "").lower() in _TRUE
            parser.add_argument(
                self.flag,
                dest=self.dest,
                action="store_true",
                default=enabled,
                help=f"{self.help} (env {self.variable})",
            )
            return
        default = self.default_factory() if self.default_factory else self.default
        parser.add_argument(
            self.flag,
            dest=self.dest,
            default=os.environ.get(self.variable, default),
            type=None if self.context else self.parse,
            choices=self.choices,
            help=f"{self.help} (env {self.variable}; default: %(default)s)",
        )

    def markdown_row(self) -> str:
        return f"| `{self.flag}` | `{self.variable}` | {self._documented_default()} | {self.help} |"

    def _documented_default(self) -> str:
        if self.documented is not None:
            return f"`{self.documented}`"
        if self.switch:
            return "off"
        if self.default is None:
            return "none"
        if self.default == "":
            return "empty"
        return f"`{self.default:g}`" if isinstance(self.default, float) else f"`{self.default}`"


def _setting(default: object, flag: str, help_text: str, **declared: Any) -> Any:
    """A ``Settings`` field and the flag that sets it. The flag's default is the field's, unless
    ``flag_default`` says otherwise; a ``default_factory`` makes both."""
    flag_default = declared.pop("flag_default", default)
    option = Option(flag, help_text, flag_default, **declared)
    if option.default_factory is not None:
        return field(default_factory=option.default_factory, metadata={_OPTION: option})
    return field(default=default, metadata={_OPTION: option})


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def _entries(text: str) -> tuple[str, ...]:
    """A comma-separated list, blank entries dropped."""
    return tuple(entry.strip() for entry in text.split(",") if entry.strip())


def allowed_hosts(names: str, listen_address: str) -> tuple[str, ...] | None:
    """``--web.allowed-hosts``: a comma-separated list of host names served besides loopback ones; ``*`` serves
    any. Empty: loopback names only on a loopback listener (against DNS rebinding), any name otherwise."""
    hosts = tuple(name.strip().lower().rstrip(".") for name in names.split(",") if name.strip())
    if "*" in hosts or (not hosts and not is_loopback(split_listen_address(listen_address)[0])):
        return None
    return hosts


@dataclass(frozen=True)
class Settings:
    """What ``serve`` runs with. Every number is a count, a size or seconds, and must be positive."""

    listen_address: str = _setting(
        f"127.0.0.1:{DEFAULT_PORT}",
        "--web.listen-address",
        f"HOST:PORT to listen on (:{DEFAULT_PORT}: every interface)",
    )
    telemetry_path: str = _setting("/metrics", "--web.telemetry-path", "path of the metrics")
    workers: int = _setting(1, "--web.workers", "worker processes sharing the storage")
    ingest_token_file: Path | None = _setting(
        None,
        "--web.ingest-token-file",
        "file with the bearer tokens that ingest and changes require; without it ingest is open, "
        "on a loopback address only unless --web.allow-unauthenticated-ingest",
    )
    allow_unauthenticated_ingest: bool = _setting(
        False, "--web.allow-unauthenticated-ingest", "allow ingest without a token on a non-loopback address"
    )
    metrics_token_file: Path | None = _setting(
        None,
        "--web.metrics-token-file",
        "file with the bearer tokens that reading metrics and state requires; without it reading is open",
    )
    web_config_file: Path | None = _setting(
        None,
        "--web.config.file",
        "exporter-toolkit web config (tls_server_config, basic_auth_users, http_server_config.headers), "
        "re-read when it changes; without it plain HTTP and no basic auth",
    )
    metrics_basic_auth_file: Path | None = _setting(
        None,
        "--web.metrics-basic-auth-file",
        "deprecated, plain-text USER:PASSWORD lines; use basic_auth_users (bcrypt) in --web.config.file",
    )
    tls_cert_file: Path | None = _setting(
        None,
        "--web.tls-cert-file",
        "TLS certificate (PEM); with --web.tls-key-file, serve HTTPS "
        "(tls_server_config of --web.config.file does the same)",
    )
    tls_key_file: Path | None = _setting(None, "--web.tls-key-file", "TLS private key (PEM)")
    max_request_bytes: int = _setting(64 * 1024, "--web.max-request-bytes", "largest request body accepted (413 above)")
    read_timeout_seconds: float = _setting(
        10.0, "--web.read-timeout", "seconds a client may take to send a request body (408 after)"
    )
    max_connections: int = _setting(
        1024,
        "--web.max-connections",
        "concurrent connections; at the cap a new one closes an idle kept-alive one, or gets 503 if none is idle",
    )
    keep_alive_timeout_seconds: float = _setting(
        65.0,
        "--web.keep-alive-timeout",
        "seconds an idle connection is kept for its next request: longer than the plugin's heartbeat interval "
        "(30 s), so that its heartbeats reuse one connection",
    )
    max_header_bytes: int = _setting(
        16 << 10, "--web.max-header-bytes", "largest request line and headers accepted (431 above)"
    )
    header_timeout_seconds: float = _setting(
        10.0,
        "--web.header-timeout",
        "seconds a client may take to send a request's line and headers (408 after, connection closed)",
    )
    shutdown_timeout_seconds: float = _setting(
        10.0,
        "--web.shutdown-timeout",
        "seconds SIGTERM waits for open requests; connections still open then are closed and the exporter exits 0",
    )
    # Host names served besides loopback ones; None serves any (see ``allowed_hosts``).
    allowed_hosts: tuple[str, ...] | None = _setting(
        None,
        "--web.allowed-hosts",
        "comma-separated Host names served besides loopback ones, '*' for any (421 otherwise, against DNS "
        "rebinding); empty: on a loopback address only localhost, 127.0.0.0/8 and ::1, elsewhere any name",
        flag_default="",
        parse=allowed_hosts,
        context=("listen_address",),
    )
    max_deployments: int = _setting(10_000, "--limits.deployments", "most deployments kept")
    max_replicas_per_deployment: int = _setting(
        1_024, "--limits.replicas-per-deployment", "most replicas (vLLM servers) kept per deployment"
    )
    # Per replica: one vLLM server's data-parallel engines.
    max_engines_per_deployment: int = _setting(
        1_024, "--limits.engines-per-deployment", "most engines kept per replica of a deployment"
    )
    max_bytes: int = _setting(
        128 << 20,
        "--limits.bytes",
        "most bytes all deployments take: the rendered exposition, the ready responses as received and as JSON",
    )
    missed_heartbeats: int = _setting(
        3, "--expiry.missed-heartbeats", "a replica that promised heartbeats expires after missing this many"
    )
    storage_path: Path = _setting(
        None,
        "--storage.path",
        "SQLite file that keeps every accepted ready response",
        default_factory=default_storage_path,
        documented="$XDG_STATE_HOME/cache-config-exporter/exporter.db",
    )
    cache_config_file: Path | None = _setting(
        None,
        "--cache-config.file",
        "JSON, TOML or YAML file with the base cache config (labels) of every deployment; without it vLLM's defaults",
    )
    metric_prefix: str = _setting(
        "", "--metric.prefix", "prefix of the cache_config_* metric names ('vllm:' gives vLLM's names)"
    )
    # kube-state-metrics' --metric-labels-allowlist, for the one metric that has labels to choose.
    metric_labels_allowlist: tuple[str, ...] = _setting(
        (),
        "--metric.labels-allowlist",
        "comma-separated vLLM labels cache_config_info keeps (deployment, replica and engine always stay); "
        "empty: every label",
        flag_default="",
        parse=_entries,
    )
    metric_labels_denylist: tuple[str, ...] = _setting(
        (),
        "--metric.labels-denylist",
        "comma-separated vLLM labels cache_config_info drops; excludes --metric.labels-allowlist",
        flag_default="",
        parse=_entries,
    )
    log_level: str = _setting("info", "--log.level", "log level", choices=LOG_LEVELS)
    # /probe (exporter/probe.py): off until targets are allowed, so that the exporter is nobody's proxy.
    probe_allowed_targets: tuple[str, ...] = _setting(
        (),
        "--probe.allowed-targets",
        "comma-separated targets /probe may fetch: CIDRs (10.0.0.0/8) and HOST:PORT patterns with * and ? "
        "(vllm-*.example:8000, gpu-?:*); empty: /probe answers 403",
        flag_default="",
        parse=_entries,
    )
    probe_timeout_seconds: float = _setting(
        10.0,
        "--probe.timeout",
        "most seconds a probe takes; Prometheus' X-Prometheus-Scrape-Timeout-Seconds less 0.5 s shortens it",
    )
    probe_max_body_bytes: int = _setting(
        8 << 20, "--probe.max-body-bytes", "largest /metrics body a probe reads; past it the probe fails"
    )
    probe_scheme: str = _setting("http", "--probe.scheme", "how /probe reaches targets", choices=("http", "https"))
    probe_tls_ca_file: Path | None = _setting(
        None, "--probe.tls-ca-file", "CA certificates (PEM) that sign the targets' certificates; default: the system's"
    )
    probe_tls_server_name: str = _setting(
        "", "--probe.tls-server-name", "name the targets' certificates must hold; empty: the target's host"
    )
    probe_tls_insecure_skip_verify: bool = _setting(
        False, "--probe.tls-insecure-skip-verify", "accept any certificate from targets (not for production)"
    )
    probe_bearer_token_file: Path | None = _setting(
        None, "--probe.bearer-token-file", "file with the bearer token targets' /metrics require, re-read on change"
    )
    probe_basic_auth_username: str = _setting(
        "", "--probe.basic-auth-username", "user for targets' /metrics behind basic auth"
    )
    probe_basic_auth_password_file: Path | None = _setting(
        None,
        "--probe.basic-auth-password-file",
        "file with that user's password, re-read on change",
    )

    def __post_init__(self) -> None:
        if self.metric_prefix and not _METRIC_PREFIX.fullmatch(self.metric_prefix):
            raise SettingsError(f"{flag_of('metric_prefix')} {self.metric_prefix!r} is not a valid metric name prefix")
        if (
            not self.telemetry_path.startswith("/")
            or self.telemetry_path.startswith(("/api/", "/-/"))
            or self.telemetry_path == "/probe"
        ):
            raise SettingsError(
                f"{flag_of('telemetry_path')} {self.telemetry_path!r} must start with / (not /api/ or /-/) "
                "and cannot be /probe"
            )
        self.info_labels()
        for name in _numbers():
            value = getattr(self, name)
            if value <= 0:
                raise SettingsError(f"{flag_of(name)} must be positive, got {value}")
        cert, key, web_config = flag_of("tls_cert_file"), flag_of("tls_key_file"), flag_of("web_config_file")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise SettingsError(f"{cert} and {key} go together")
        if self.web_config_file is not None:
            if self.tls_cert_file is not None:
                raise SettingsError(
                    f"{cert}/{key} and {web_config} exclude each other: "
                    "put cert_file and key_file under tls_server_config in the web config file"
                )
            if self.metrics_basic_auth_file is not None:
                raise SettingsError(
                    f"{flag_of('metrics_basic_auth_file')} and {web_config} exclude each other: "
                    "put the users, with bcrypt hashes, under basic_auth_users in the web config file"
                )
        host, _ = split_listen_address(self.listen_address)
        if not (is_loopback(host) or self.ingest_token_file or self.allow_unauthenticated_ingest):
            raise SettingsError(
                f"{flag_of('listen_address')} {self.listen_address} is reachable from other hosts, so ingest needs "
                f"{flag_of('ingest_token_file')} (or {flag_of('allow_unauthenticated_ingest')} to accept anyone's "
                "ready responses)"
            )
        self._check_probe()

    def _check_probe(self) -> None:
        """The /probe settings that cannot work together, or entries of the allowlist that mean nothing."""
        try:
            AllowList.parse(self.probe_allowed_targets)
        except ValueError as error:
            raise SettingsError(f"{flag_of('probe_allowed_targets')} {error}") from None
        tls_names = ("probe_tls_ca_file", "probe_tls_server_name", "probe_tls_insecure_skip_verify")
        tls = [name for name in tls_names if getattr(self, name)]
        if tls and self.probe_scheme != "https":
            raise SettingsError(f"{flag_of(tls[0])} needs {flag_of('probe_scheme')} https")
        if bool(self.probe_basic_auth_username) != (self.probe_basic_auth_password_file is not None):
            raise SettingsError(
                f"{flag_of('probe_basic_auth_username')} and {flag_of('probe_basic_auth_password_file')} go together"
            )
        if ":" in self.probe_basic_auth_username:
            raise SettingsError(f"{flag_of('probe_basic_auth_username')} cannot hold a colon (RFC 7617)")
        if self.probe_bearer_token_file is not None and self.probe_basic_auth_password_file is not None:
            raise SettingsError(
                f"{flag_of('probe_bearer_token_file')} and {flag_of('probe_basic_auth_password_file')} "
                "exclude each other"
            )

    def info_labels(self) -> InfoLabels:
        """The labels ``cache_config_info`` keeps, of ``--metric.labels-allowlist`` or ``--metric.labels-denylist``."""
        try:
            return InfoLabels.parse(self.metric_labels_allowlist, self.metric_labels_denylist)
        except LabelChoiceError as error:
            allow, deny = flag_of("metric_labels_allowlist"), flag_of("metric_labels_denylist")
            flag = {"allow": allow, "deny": deny}.get(error.which, f"{allow} and {deny}")
            raise SettingsError(f"{flag}: {error}") from None

    def limits(self) -> Limits:
        """The cardinality caps of ``--limits.*``."""
        return Limits(
            self.max_deployments, self.max_replicas_per_deployment, self.max_engines_per_deployment, self.max_bytes
        )

    def base_labels(self) -> dict[str, str]:
        """Labels laid under every deployment's own, from ``--cache-config.file`` when given."""
        if self.cache_config_file is None:
            return {}
        path, flag = self.cache_config_file, flag_of("cache_config_file")
        document_format = _CONFIG_FORMATS.get(path.suffix.lower())
        if document_format is None:
            raise SettingsError(f"{flag} {path}: use a .json, .toml, .yaml or .yml file")
        try:
            return decode_static_labels(read_file(flag, path), document_format)
        except InvalidPayload as error:
            raise SettingsError(f"{flag} {path}: {error.reason} at {error.field}") from None

    def to_environment(self) -> str:
        """These settings as JSON, for worker processes (``from_environment`` reads them back)."""
        return msgspec.json.encode(self, enc_hook=str).decode()

    @classmethod
    def from_environment(cls) -> Settings:
        return msgspec.json.decode(os.environ[SETTINGS_ENVIRONMENT], type=cls, dec_hook=_decode_path)


@functools.cache
def serve_options() -> dict[str, Option]:
    """Every setting's ``Option`` by ``Settings`` field name, in declaration order, reading its text by its type."""
    types = typing.get_type_hints(Settings)
    options = {}
    for item in dataclasses.fields(Settings):
        option: Option = item.metadata[_OPTION]
        if types[item.name] is bool:
            option = dataclasses.replace(option, switch=True)
        elif option.parse is None:
            option = dataclasses.replace(option, parse=_PARSERS[types[item.name]])
        options[item.name] = option
    return options


# How a setting's text becomes its value, by the field's type.
_PARSERS: dict[object, Callable[[str], object]] = {
    str: str,
    int: int,
    float: float,
    Path: Path,
    Path | None: _optional_path,
}


def _numbers() -> list[str]:
    types = typing.get_type_hints(Settings)
    return [name for name in serve_options() if types[name] in (int, float)]


def flag_of(name: str) -> str:
    """The flag of the setting ``name``, for messages: ``flag_of("max_bytes")`` is ``--limits.bytes``."""
    return serve_options()[name].flag


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for option in options:
        option.add_to(parser)


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings of ``serve``'s parsed flags."""
    options = serve_options()
    values = {name: getattr(args, option.dest) for name, option in options.items()}
    for name, option in options.items():
        if option.context and option.parse is not None:
            values[name] = option.parse(values[name], *(values[other] for other in option.context))
    return Settings(**values)


def markdown_table(options: Sequence[Option]) -> str:
    """The flags as the README's table: flag, environment variable, default, meaning."""
    header = ["| flag | environment variable | default | meaning |", "|---|---|---|---|"]
    return "\n".join([*header, *(option.markdown_row() for option in options)]) + "\n"


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


@functools.lru_cache(maxsize=256)  # asked of every request's Host header: the few names clients use
def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (IPv4 or IPv6): names DNS rebinding cannot point elsewhere."""
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
        raise SettingsError(f"{flag_of('listen_address')} {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]") or "0.0.0.0"
    return host, int(port)


def main(argv: Sequence[str]) -> int:
    """``python -m exporter.settings --markdown``: the table of ``serve``'s flags that the README holds."""
    if list(argv) != ["--markdown"]:
        print("usage: python -m exporter.settings --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table(list(serve_options().values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
