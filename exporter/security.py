"""Who may do what, and the files that say so, re-read whenever they change.

Ingest and every change need an ingest bearer token; reading metrics and state needs a metrics token or a
basic-auth user, when configured. ``--web.config.file`` is Prometheus' exporter-toolkit web configuration
(``tls_server_config``, ``basic_auth_users`` with bcrypt hashes, ``http_server_config.headers``). Every file
is checked for changes on each request (and each TLS handshake) and loaded again when it changed, so tokens,
passwords and certificates rotate without a restart; a file that no longer loads keeps the last good
content, logs why and sets ``cache_config_exporter_config_last_reload_successful`` to 0.

Secrets are compared in constant time and never appear in logs or error bodies.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import bcrypt
import yaml
from fastapi import Request
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exporter.problems import Problem
from exporter.settings import Settings, SettingsError, flag_of, read_file, read_secret

WEB_CONFIG_FLAG = flag_of("web_config_file")
_log = logging.getLogger("cache_config_exporter")
T = TypeVar("T")
Signature = tuple[tuple[int, int, int, int] | None, ...]


def _signature(paths: tuple[Path, ...]) -> Signature:
    """What changes when a file is rewritten, replaced or re-linked (a Kubernetes secret update)."""

    def one(path: Path) -> tuple[int, int, int, int] | None:
        try:
            status = os.stat(path)
        except OSError:
            return None
        return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns

    return tuple(one(path) for path in paths)


class Watched(Generic[T]):
    """A value loaded from files; loaded again when one of them changes, keeping the last good value on failure.

    ``load`` returns the value and every file it read. At start its ``SettingsError`` stops start-up.
    """

    def __init__(self, name: str, load: Callable[[], tuple[T, tuple[Path, ...]]]) -> None:
        self.name = name
        self._load = load
        self._lock = threading.Lock()
        self.value, self._files = load()
        self._signature = _signature(self._files)
        self.last_reload_successful = True
        self.last_success_time = time.time()

    def current(self) -> T:
        """The value, loaded again first if one of its files changed since the last look."""
        if _signature(self._files) != self._signature:
            with self._lock:
                before = _signature(self._files)
                if before != self._signature:
                    self._reload(before)
        return self.value

    def _reload(self, signature: Signature) -> None:
        # A failed load is remembered by the signature too: it is logged once, not on every request.
        self._signature = signature
        try:
            self.value, files = self._load()
        except SettingsError as error:
            self.last_reload_successful = False
            _log.error("%s: reload failed, keeping the last good content: %s", self.name, error)
            return
        self._files = files
        self._signature = _signature(files)
        self.last_reload_successful = True
        self.last_success_time = time.time()
        _log.info("%s: reloaded", self.name)


# ---------------------------------------------------------------------------------------------- token files


def _token_loader(flag: str, path: Path) -> Callable[[], tuple[frozenset[bytes], tuple[Path, ...]]]:
    """One token per line (blank lines and ``#`` comments ignored): several tokens overlap during a rotation."""

    def load() -> tuple[frozenset[bytes], tuple[Path, ...]]:
        lines = read_secret(flag, path).splitlines()
        tokens = frozenset(
            line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")
        )
        if not tokens:
            raise SettingsError(f"{flag} {path}: the file holds no token")
        return tokens, (path,)

    return load


# ---------------------------------------------------------------------------------------------- web config

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# exporter-toolkit's fields that this exporter does not implement: named as such rather than "unknown".
_UNSUPPORTED = {
    "tls_server_config": {
        "cert", "key", "client_ca", "client_ca_file", "client_auth_type", "client_allowed_sans",
        "cipher_suites", "curve_preferences", "prefer_server_cipher_suites",
    },
    "http_server_config": {"http2"},
}  # fmt: skip
# exporter-toolkit's allowed response headers, and the values it accepts where it restricts them.
_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Content-Security-Policy": None,
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}
_BCRYPT = re.compile(rb"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")


@dataclass(frozen=True)
class WebConfig:
    """What a web config file sets: a TLS context (``None``: plain HTTP), basic-auth users, response headers."""

    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[bytes, bytes], ...] = ()


def tls_context(
    cert_file: Path, key_file: Path, where: str, minimum: str = "TLS12", maximum: str = "TLS13"
) -> ssl.SSLContext:
    """A server context with this certificate and key; a pair that does not load is a ``SettingsError``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _TLS_VERSIONS[minimum]
    context.maximum_version = _TLS_VERSIONS[maximum]
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as error:
        reason = error.strerror or error.reason if isinstance(error, OSError) else error.reason or str(error)
        raise SettingsError(f"{where}: cannot load {cert_file} and {key_file}: {reason}") from None
    return context


class _Document:
    """A YAML document walked node by node, so that every error names the line it is on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key_lines: dict[int, int] = {}
        try:
            self.root = yaml.compose(
                read_file(WEB_CONFIG_FLAG, path).decode("utf-8", "replace"), Loader=yaml.SafeLoader
            )
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            raise self.error(
                mark.line + 1 if mark else 1, f"not valid YAML: {error.problem or error.context}"
            ) from None

    def line(self, node: yaml.Node) -> int:
        """The line of the key a value belongs to (a nested mapping starts on the line after its key)."""
        return self._key_lines.get(id(node), node.start_mark.line + 1)

    def error(self, line: int, message: str) -> SettingsError:
        return SettingsError(f"{WEB_CONFIG_FLAG} {self.path} line {line}: {message}")

    def mapping(self, node: yaml.Node | None, where: str, known: set[str]) -> dict[str, yaml.Node]:
        """A mapping's string keys and value nodes; unknown or repeated keys are errors. ``null`` is empty."""
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")):
            return {}
        if not isinstance(node, yaml.MappingNode):
            raise self.error(self.line(node), f"{where} must be a mapping")
        values: dict[str, yaml.Node] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            line = key.start_mark.line + 1
            if not isinstance(name, str) or not name:
                raise self.error(line, f"{where} has a key that is not a string")
            if name in _UNSUPPORTED.get(where, ()):
                raise self.error(line, f"{where}.{name} is not supported by cache-config-exporter")
            if known and name not in known:
                raise self.error(line, f"{where}.{name} is unknown")
            if name in values:
                raise self.error(line, f"{where}.{name} appears twice")
            values[name] = value
            self._key_lines[id(value)] = line
        return values

    def string(self, node: yaml.Node, where: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.tag.endswith(":null") or not node.value:
            raise self.error(self.line(node), f"{where} must be a non-empty string")
        return str(node.value)

    def file(self, node: yaml.Node, where: str) -> Path:
        """A file name; relative ones are relative to the web config file, as in exporter-toolkit."""
        return self.path.parent / self.string(node, where)


def _load_web_config(path: Path) -> tuple[WebConfig, tuple[Path, ...]]:
    document = _Document(path)
    top = document.mapping(document.root, "the file", {"tls_server_config", "http_server_config", "basic_auth_users"})
    files = [path]
    tls = None
    if "tls_server_config" in top:
        where = "tls_server_config"
        node = top[where]
        fields = document.mapping(node, where, {"cert_file", "key_file", "min_version", "max_version"})
        if "cert_file" not in fields or "key_file" not in fields:
            raise document.error(document.line(node), f"{where} needs cert_file and key_file")
        versions = []
        for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
            version = document.string(fields[name], f"{where}.{name}") if name in fields else default
            if version not in _TLS_VERSIONS:
                raise document.error(
                    document.line(fields[name]), f"{where}.{name} must be one of {', '.join(_TLS_VERSIONS)}"
                )
            versions.append(version)
        cert_file = document.file(fields["cert_file"], f"{where}.cert_file")
        key_file = document.file(fields["key_file"], f"{where}.key_file")
        tls = tls_context(cert_file, key_file, f"{WEB_CONFIG_FLAG} {path} line {document.line(node)}", *versions)
        files += [cert_file, key_file]
    users: dict[str, bytes] = {}
    if "basic_auth_users" in top:
        for user, node in document.mapping(top["basic_auth_users"], "basic_auth_users", set()).items():
            hashed = document.string(node, f"basic_auth_users.{user}").encode()
            if not _BCRYPT.fullmatch(hashed):
                raise document.error(
                    node.start_mark.line + 1, f"basic_auth_users.{user} is not a bcrypt hash ($2y$...)"
                )
            users[user] = hashed
    headers = []
    if "http_server_config" in top:
        server = document.mapping(top["http_server_config"], "http_server_config", {"headers"})
        if "headers" in server:
            for name, node in document.mapping(server["headers"], "http_server_config.headers", set()).items():
                canonical = next((known for known in _HEADERS if known.lower() == name.lower()), None)
                line = document.line(node)
                if canonical is None:
                    raise document.error(line, f"header {name} cannot be set (allowed: {', '.join(_HEADERS)})")
                value = document.string(node, f"http_server_config.headers.{name}")
                allowed = _HEADERS[canonical]
                if allowed is not None and value.lower() not in allowed:
                    raise document.error(line, f"header {canonical} must be one of {', '.join(allowed)}")
                headers.append((canonical.lower().encode(), value.encode("latin-1", "replace")))
    return WebConfig(tls, users, tuple(headers)), tuple(files)


@functools.cache
def watched_web_config(path: Path) -> Watched[WebConfig]:
    """One watcher per file and process, shared by the TLS listener and the request handlers."""
    return Watched(f"{WEB_CONFIG_FLAG} {path}", functools.partial(_load_web_config, path))


@functools.cache
def _watched_legacy_tls(cert_file: Path, key_file: Path) -> Watched[WebConfig]:
    """``--web.tls-cert-file`` and ``--web.tls-key-file``: reloaded on change like the web config's TLS."""
    cert_flag = flag_of("tls_cert_file")

    def load() -> tuple[WebConfig, tuple[Path, ...]]:
        context = tls_context(cert_file, key_file, f"{cert_flag}/{flag_of('tls_key_file')}")
        return WebConfig(context), (cert_file, key_file)

    return Watched(f"{cert_flag} {cert_file}", load)


def watched_tls(settings: Settings) -> Watched[WebConfig] | None:
    """Where the listener's certificate comes from; ``None``: plain HTTP."""
    if settings.web_config_file is not None:
        watched = watched_web_config(settings.web_config_file)
        return watched if watched.value.tls is not None else None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        return _watched_legacy_tls(settings.tls_cert_file, settings.tls_key_file)
    return None


@dataclass(frozen=True)
class ReloadingTls:
    """uvicorn's ``ssl_context_factory``: every handshake gets the certificate of the files as they are now.

    A picklable recipe (worker processes build their own): the settings' web config or TLS flags.
    """

    settings: Settings

    def __call__(self, config: object, default_factory: object) -> ssl.SSLContext:
        watched = watched_tls(self.settings)
        assert watched is not None and watched.value.tls is not None
        served = watched.value.tls
        # The listener's context only picks, per handshake, the context of the newest good files; protocol
        # versions are fixed when the connection is made, so they are kept in step on the listener's context.
        listener = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        listener.minimum_version, listener.maximum_version = served.minimum_version, served.maximum_version

        def pick(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
            nonlocal served
            # A reload that drops TLS cannot turn a listening HTTPS port into plain HTTP: keep the last context.
            context = watched.current().tls or served
            if context is not served:
                served = context
                listener.minimum_version, listener.maximum_version = context.minimum_version, context.maximum_version
            connection.context = context

        listener.sni_callback = pick  # type: ignore[assignment]
        return listener


# ---------------------------------------------------------------------------------------------- access checks

_VERIFIED_LIMIT = 1024


@functools.cache
def _dummy_hash() -> bytes:
    """Checked against when the user is unknown, so that timing does not tell which users exist."""
    return bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(rounds=10))


class _BcryptCache:
    """Passwords already verified against a hash (keyed digests only), so a scrape costs one bcrypt per rotation."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._verified: set[bytes] = set()

    def _digest(self, user: str, password: bytes, hashed: bytes) -> bytes:
        return hmac.new(self._key, b"\0".join((user.encode(), password, hashed)), hashlib.sha256).digest()

    async def matches(self, user: str, password: bytes, hashed: bytes | None) -> bool:
        if hashed is not None and self._digest(user, password, hashed) in self._verified:
            return True
        try:
            matched = await run_in_threadpool(bcrypt.checkpw, password, hashed or _dummy_hash())
        except ValueError:  # longer than bcrypt's 72 bytes: never a valid password
            matched = False
        if matched and hashed is not None:
            if len(self._verified) >= _VERIFIED_LIMIT:
                self._verified.clear()
            self._verified.add(self._digest(user, password, hashed))
            return True
        return False


@dataclass(eq=False)  # hashable by identity: it is registered as a metrics collector
class Credentials:
    """The access files of one exporter process, each re-read when it changes; ``None``: that access is open."""

    ingest_tokens: Watched[frozenset[bytes]] | None
    metrics_tokens: Watched[frozenset[bytes]] | None
    web_config: Watched[WebConfig] | None
    plain_users: dict[str, bytes] | None
    _bcrypt: _BcryptCache = field(default_factory=_BcryptCache)

    @classmethod
    def from_settings(cls, settings: Settings) -> Credentials:
        def tokens(flag: str, path: Path | None) -> Watched[frozenset[bytes]] | None:
            return Watched(f"{flag} {path}", _token_loader(flag, path)) if path is not None else None

        plain_users = None
        if settings.metrics_basic_auth_file is not None:
            basic_auth_flag = flag_of("metrics_basic_auth_file")
            _log.warning(
                "%s keeps passwords in plain text and is deprecated: "
                "put bcrypt hashes under basic_auth_users in %s instead",
                basic_auth_flag,
                WEB_CONFIG_FLAG,
            )
            plain_users = {}
            lines = read_secret(basic_auth_flag, settings.metrics_basic_auth_file).splitlines()
            for number, line in enumerate(lines, 1):
                user, separator, password = line.strip().partition(":")
                if not separator or not user or not password:
                    raise SettingsError(f"{basic_auth_flag} line {number}: expected USER:PASSWORD")
                plain_users[user] = password.encode()
        web_config = None
        if settings.web_config_file is not None:
            web_config = watched_web_config(settings.web_config_file)
        elif settings.tls_cert_file is not None:
            web_config = watched_tls(settings)
        return cls(
            ingest_tokens=tokens(flag_of("ingest_token_file"), settings.ingest_token_file),
            metrics_tokens=tokens(flag_of("metrics_token_file"), settings.metrics_token_file),
            web_config=web_config,
            plain_users=plain_users,
        )

    def require_ingest(self, request: Request) -> None:
        """Ingest and every change need an ingest token, when a token file is configured."""
        if self.ingest_tokens is not None and not _bearer_matches(request, self.ingest_tokens.current()):
            raise _unauthorized("a valid ingest bearer token is required", 'Bearer realm="ingest"')

    async def require_reader(self, request: Request) -> None:
        """Metrics and the JSON state need a metrics token or a metrics user, when configured."""
        users = self.web_config.current().users if self.web_config is not None else {}
        if self.metrics_tokens is None and not users and self.plain_users is None:
            return
        if self.metrics_tokens is not None and _bearer_matches(request, self.metrics_tokens.current()):
            return
        basic = _basic_credentials(request)
        if basic is not None:
            user, password = basic
            if users and await self._bcrypt.matches(user, password, users.get(user)):
                return
            if self.plain_users is not None and _plain_matches(user, password, self.plain_users):
                return
        challenge = 'Basic realm="metrics"' if users or self.plain_users is not None else 'Bearer realm="metrics"'
        raise _unauthorized("valid metrics credentials are required", challenge)

    def response_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        return self.web_config.current().headers if self.web_config is not None else ()

    def _watched(self) -> Iterator[Watched[Any]]:
        yield from (watched for watched in (self.web_config, self.ingest_tokens, self.metrics_tokens) if watched)

    def collect(self) -> Iterator[Metric]:
        """Reload state of every watched file (a prometheus_client collector; each scrape looks at the files)."""
        successful = GaugeMetricFamily(
            "cache_config_exporter_config_last_reload_successful",
            "1 if the file loaded at the last change; 0: it does not load and the last good content is in use.",
            labels=["file"],
        )
        timestamp = GaugeMetricFamily(
            "cache_config_exporter_config_last_reload_success_timestamp_seconds",
            "When the file last loaded successfully, Unix seconds.",
            labels=["file"],
        )
        for watched in self._watched():
            watched.current()
            successful.add_metric([watched.name.partition(" ")[2]], float(watched.last_reload_successful))
            timestamp.add_metric([watched.name.partition(" ")[2]], watched.last_success_time)
        yield successful
        yield timestamp


class ResponseHeaders:
    """ASGI middleware adding ``http_server_config.headers`` of the web config (as it is now) to every response."""

    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.credentials.web_config is None:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = self.credentials.response_headers()
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _unauthorized(detail: str, challenge: str) -> Problem:
    return Problem(401, "Unauthorized", detail, "Authorization", "unauthorized", {"WWW-Authenticate": challenge})


def _bearer_matches(request: Request, tokens: frozenset[bytes]) -> bool:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    offered = value.strip().encode()
    # Every token is compared, so that timing does not tell which one (or how many) there are.
    return sum(hmac.compare_digest(offered, token) for token in tokens) > 0


def _basic_credentials(request: Request) -> tuple[str, bytes] | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user, password.encode()


def _plain_matches(user: str, password: bytes, users: dict[str, bytes]) -> bool:
    # Compare against a dummy for unknown users too, so timing does not reveal which users exist.
    expected = users.get(user, b"\0" * 32)
    return hmac.compare_digest(password, expected) and user in users
