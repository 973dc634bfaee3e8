"""``--web.config.file``: Prometheus exporter-toolkit's web configuration, decoded by strict msgspec Structs.

The file sets ``tls_server_config`` (certificate, key, protocol versions), ``basic_auth_users`` (bcrypt hashes)
and ``http_server_config.headers``. As exporter-toolkit (yaml ``UnmarshalStrict``) does, unknown fields and
repeated keys are refused; exporter-toolkit's fields this exporter does not implement are refused by name. Every
error names the file and the ``$.path`` at fault, never a secret. The file, and the certificate and key it names,
are watched (``exporter/flags/watched_files.py``): a change applies at the next request or TLS handshake.
"""

from __future__ import annotations

import functools
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from exporter.flags.option import SettingsError, read_file
from exporter.flags.watched_files import Watched
from exporter.security.options import web_flag
from exporter.security.tls import TlsVersion, tls_context
from protocol import InvalidPayload

WEB_CONFIG_FLAG = web_flag("web_config_file")
FileName = Annotated[str, msgspec.Meta(min_length=1)]
# exporter-toolkit's fields that this exporter does not implement: named as such rather than "unknown".
_UNSUPPORTED = {
    "tls_server_config": (
        "cert", "key", "client_ca", "client_ca_file", "client_auth_type", "client_allowed_sans",
        "cipher_suites", "curve_preferences", "prefer_server_cipher_suites",
    ),
    "http_server_config": ("http2",),
}  # fmt: skip
# exporter-toolkit's allowed response headers, and the values it accepts where it restricts them.
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Content-Security-Policy": None,
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
# The costs a hash may have. bcrypt's own lowest is 4; a check doubles with each step (1.5 s at 14 on one core of
# the machine the tests run on), and every guess, an anonymous one included, costs a check at the highest cost:
# past 14 a few guesses would hold the check pool, and a SIGTERM would wait for the check in progress.
MIN_BCRYPT_COST = 4
MAX_BCRYPT_COST = 14


class TlsServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    cert_file: FileName
    key_file: FileName
    min_version: TlsVersion = "TLS12"
    max_version: TlsVersion = "TLS13"


class HttpServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    headers: dict[str, Any] | None = None


class WebConfigFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The file as written; values that msgspec's types cannot say (bcrypt hashes, header names) are checked after."""

    tls_server_config: TlsServerConfig | None = None
    http_server_config: HttpServerConfig | None = None
    basic_auth_users: dict[str, Any] | None = None


@dataclass(frozen=True)
class WebConfig:
    """What a web config file sets: a TLS context (``None``: plain HTTP), basic-auth users, response headers."""

    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @functools.cached_property
    def bcrypt_cost(self) -> int:
        """The highest cost among the users' hashes: what a check of an unknown user must cost too."""
        return max((int(hashed[4:6]) for hashed in self.users.values()), default=10)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    raise yaml.MarkedYAMLError(problem=f"{key.value!r} appears twice", problem_mark=key.start_mark)
                seen.add(key.value)
        return super().construct_mapping(node, deep)


def _error(path: Path, where: str, message: str) -> SettingsError:
    return SettingsError(f"{WEB_CONFIG_FLAG} {path}: {where} {message}")


def _decoded(path: Path) -> WebConfigFile:
    try:
        document = yaml.load(read_file(WEB_CONFIG_FLAG, path).decode("utf-8", "replace"), Loader=_StrictLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f"line {mark.line + 1}" if mark else "the file"
        raise _error(path, line, f"is not valid YAML: {error.problem or error.context}") from None
    except yaml.YAMLError as error:  # a character YAML does not allow, at a position rather than on a line
        raise _error(path, "the file", f"is not valid YAML: {str(error).splitlines()[0]}") from None
    for section, names in _UNSUPPORTED.items():
        fields = document.get(section) if isinstance(document, dict) else None
        for name in names:
            if isinstance(fields, dict) and name in fields:
                raise _error(path, f"$.{section}.{name}", "is not supported by cache-config-exporter")
    try:
        return msgspec.convert(document, WebConfigFile | None) or WebConfigFile()
    except msgspec.ValidationError as error:
        invalid = InvalidPayload.from_msgspec(error)
        raise _error(path, f"{invalid.field}:", invalid.reason) from None


def _users(path: Path, users: dict[str, Any]) -> dict[str, bytes]:
    for user, hashed in users.items():
        matched = _BCRYPT.fullmatch(hashed) if isinstance(hashed, str) else None
        if matched is None:
            raise _error(path, f"$.basic_auth_users.{user}", "is not a bcrypt hash ($2y$...)")
        cost = int(matched.group(1))
        if cost > MAX_BCRYPT_COST:
            raise _error(
                path,
                f"$.basic_auth_users.{user}",
                f"has cost {cost}, more than the {MAX_BCRYPT_COST} "
                "allowed (every guess costs a check at the highest cost: hash again with htpasswd -nBC 12)",
            )
        if cost < MIN_BCRYPT_COST:
            raise _error(
                path, f"$.basic_auth_users.{user}", f"has cost {cost}, less than the {MIN_BCRYPT_COST} bcrypt allows"
            )
    return {user: hashed.encode() for user, hashed in users.items()}


def _headers(path: Path, headers: dict[str, Any]) -> tuple[tuple[bytes, bytes], ...]:
    checked = []
    for name, value in headers.items():
        where = f"$.http_server_config.headers.{name}"
        canonical = next((known for known in _HEADERS if known.lower() == name.lower()), None)
        if canonical is None:
            raise _error(path, where, f"cannot be set (allowed: {', '.join(_HEADERS)})")
        if not isinstance(value, str) or not value:
            raise _error(path, where, "must be a non-empty string")
        allowed = _HEADERS[canonical]
        if allowed is not None and value.lower() not in allowed:
            raise _error(path, where, f"must be one of {', '.join(allowed)}")
        checked.append((canonical.lower().encode(), value.encode("latin-1", "replace")))
    return tuple(checked)


def load_web_config(path: Path) -> tuple[WebConfig, tuple[Path, ...]]:
    """The file's settings, and every file they were read from (relative names are relative to the file)."""
    decoded = _decoded(path)
    files = [path]
    tls = None
    if decoded.tls_server_config is not None:
        server = decoded.tls_server_config
        cert_file, key_file = path.parent / server.cert_file, path.parent / server.key_file
        where = f"{WEB_CONFIG_FLAG} {path}: $.tls_server_config"
        tls = tls_context(cert_file, key_file, where, server.min_version, server.max_version)
        files += [cert_file, key_file]
    users = _users(path, decoded.basic_auth_users or {})
    http = decoded.http_server_config
    headers = _headers(path, http.headers or {}) if http is not None else ()
    return WebConfig(tls, users, headers), tuple(files)


@functools.cache
def watched_web_config(path: Path) -> Watched[WebConfig]:
    """One watcher per file and process, shared by the TLS listener and the request handlers."""
    return Watched(f"{WEB_CONFIG_FLAG} {path}", functools.partial(load_web_config, path))


def response_headers(web_config: Watched[WebConfig] | None) -> tuple[tuple[bytes, bytes], ...]:
    """The headers every response carries: ``http_server_config.headers`` of the web config as it is now."""
    return web_config.current().headers if web_config is not None else ()
