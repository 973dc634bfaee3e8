"""The exporter's settings, each declared once with its flag, and the files they name (base config, secrets).

Every ``Settings`` field carries its ``Option``: the flag of ``serve``, its help and how its text is read.
From these come the command line's flags and their environment variables (``CACHE_CONFIG_EXPORTER_`` and
the flag's name), the flag names in messages (``flag_of``) and the table of flags in the README
(``python -m exporter.config.settings --markdown``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from exporter.exposition.options import OutputOptions
from exporter.exposition.series import InfoLabels, LabelChoiceError, LabelFlags
from exporter.flags.option import OPTION, Option, SettingsError, optional_path, read_file
from exporter.probe.allowlist import AllowList
from exporter.probe.options import ProbeOptions
from exporter.security.addresses import is_loopback, split_listen_address
from exporter.security.options import WebOptions
from exporter.state.limits import Limits
from exporter.state.options import StateOptions
from protocol import InvalidPayload, decode_static_labels

_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_CONFIG_FORMATS = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}
# Where ``serve --web.workers N`` hands the settings to its worker processes.
SETTINGS_ENVIRONMENT = "CACHE_CONFIG_EXPORTER_SETTINGS_JSON"


@dataclass(frozen=True)
class Settings(ProbeOptions, OutputOptions, StateOptions, WebOptions):
    """What ``serve`` runs with: the four groups of ``options``, checked together. Every number is a count, a
    size or seconds, and must be positive."""

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
        self._check_ingest()
        self._check_probe()

    def _check_ingest(self) -> None:
        """Ingest beyond loopback needs a token, or the explicit choice of none; a probe-only exporter has no ingest,
        so a token file would be a secret kept for nothing."""
        if self.probe_only:
            if self.ingest_token_file is not None:
                raise SettingsError(
                    f"{flag_of('ingest_token_file')} has no use with {flag_of('probe_only')}, which serves no ingest"
                )
            return
        host, _ = split_listen_address(self.listen_address)
        if not (is_loopback(host) or self.ingest_token_file or self.allow_unauthenticated_ingest):
            raise SettingsError(
                f"{flag_of('listen_address')} {self.listen_address} is reachable from other hosts, so ingest needs "
                f"{flag_of('ingest_token_file')} (or {flag_of('allow_unauthenticated_ingest')} to accept anyone's "
                "ready responses)"
            )

    def _check_probe(self) -> None:
        """The /probe settings that cannot work together, or entries of the allowlist that mean nothing."""
        try:
            AllowList.parse(self.probe_allowed_targets)
        except ValueError as error:
            raise SettingsError(f"{flag_of('probe_allowed_targets')} {error}") from None
        if self.probe_only and not self.probe_allowed_targets:
            raise SettingsError(
                f"{flag_of('probe_only')} needs {flag_of('probe_allowed_targets')}, the vLLM servers /probe may read "
                "(CIDRs such as the pod network, or HOST:PORT patterns): without it every probe is refused"
            )
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

    def flag(self, name: str) -> str:
        """``flag_of`` for the parts that take the settings as a protocol of their own (``ProbeSettings``)."""
        return flag_of(name)

    def info_labels(self) -> InfoLabels:
        """The labels ``cache_config_info`` keeps: ``--metric.labels-preset``, ``-allowlist`` or ``-denylist``."""
        names = ("metric_labels_allowlist", "metric_labels_denylist", "metric_labels_preset")
        try:
            return InfoLabels.parse(
                self.metric_labels_allowlist,
                self.metric_labels_denylist,
                self.metric_labels_preset,
                LabelFlags(*(flag_of(name) for name in names)),
            )
        except LabelChoiceError as error:
            raise SettingsError(str(error)) from None

    def limits(self) -> Limits:
        """The cardinality caps of ``--limits.*``."""
        return Limits(
            self.max_deployments, self.max_replicas_per_deployment, self.max_engines_per_replica, self.max_bytes
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
        option: Option = item.metadata[OPTION]
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
    Path | None: optional_path,
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


def main(argv: Sequence[str]) -> int:
    """``python -m exporter.config.settings --markdown``: the table of ``serve``'s flags that the README holds."""
    if list(argv) != ["--markdown"]:
        print("usage: python -m exporter.config.settings --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table(list(serve_options().values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
