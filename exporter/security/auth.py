"""Who may do what: ingest and every change need an ingest bearer token; reading metrics and state needs a
metrics token or a basic-auth user, when configured.

The access files are watched (``exporter/flags/watched_files.py``): tokens, passwords and certificates rotate without
a restart. Secrets are compared in constant time and never appear in logs or error bodies. A refusal is an
``Unauthorized`` (401 with its challenge) or, when too many password checks wait, an ``AuthenticationBusy``;
``exporter/server/problems.py``'s table gives both their status.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter.errors import Refused
from exporter.flags.option import SettingsError
from exporter.flags.watched_files import Watched
from exporter.secret_files import read_secret
from exporter.security.bcrypt_checks import BcryptChecks
from exporter.security.https_listener import watched_tls
from exporter.security.options import WebOptions, web_flag
from exporter.security.token_file import watched_tokens
from exporter.security.web_config import WEB_CONFIG_FLAG, WebConfig, watched_web_config

_log = logging.getLogger("cache_config_exporter")


class Unauthorized(Refused):
    """No valid credential for what was asked; ``headers`` carry the ``WWW-Authenticate`` challenge."""

    def __init__(self, reason: str, challenge: str) -> None:
        super().__init__("Authorization", reason)
        self.headers: Mapping[str, str] = {"WWW-Authenticate": challenge}


@dataclass(eq=False)  # hashable by identity: it is registered as a metrics collector
class Credentials:
    """The access files of one exporter process, each re-read when it changes; ``None``: that access is open."""

    ingest_tokens: Watched[frozenset[bytes]] | None
    metrics_tokens: Watched[frozenset[bytes]] | None
    web_config: Watched[WebConfig] | None
    plain_users: dict[str, bytes] | None
    _bcrypt: BcryptChecks = field(default_factory=BcryptChecks)

    @classmethod
    def from_settings(cls, settings: WebOptions) -> Credentials:
        def tokens(flag: str, path: Path | None) -> Watched[frozenset[bytes]] | None:
            return watched_tokens(flag, path) if path is not None else None

        web_config = None
        if settings.web_config_file is not None:
            web_config = watched_web_config(settings.web_config_file)
        elif settings.tls_cert_file is not None:
            web_config = watched_tls(settings)
        return cls(
            ingest_tokens=tokens(web_flag("ingest_token_file"), settings.ingest_token_file),
            metrics_tokens=tokens(web_flag("metrics_token_file"), settings.metrics_token_file),
            web_config=web_config,
            plain_users=_plain_users(settings.metrics_basic_auth_file),
        )

    def require_ingest(self, authorization: str) -> None:
        """Ingest and every change need an ingest token, when a token file is configured; ``authorization`` is
        the request's ``Authorization`` header."""
        if self.ingest_tokens is not None and not _bearer_matches(authorization, self.ingest_tokens.current()):
            raise Unauthorized("a valid ingest bearer token is required", 'Bearer realm="ingest"')

    async def require_reader(
        self, authorization: str, departure: Callable[[], AbstractContextManager[Callable[[], bool]]]
    ) -> None:
        """Metrics and the JSON state need a metrics token or a metrics user, when configured.

        ``departure`` watches, while a password's hash is checked, whether the client has hung up (its check is
        then dropped): it is entered only for such a check, which alone waits."""
        config = self.web_config.current() if self.web_config is not None else WebConfig()
        users = config.users
        if self.metrics_tokens is None and not users and self.plain_users is None:
            return
        if self.metrics_tokens is not None and _bearer_matches(authorization, self.metrics_tokens.current()):
            return
        basic = _basic_credentials(authorization)
        if basic is not None:
            user, password = basic
            if users:
                with departure() as hung_up:
                    if await self._bcrypt.matches(user, password, users.get(user), config.bcrypt_cost, hung_up):
                        return
            if self.plain_users is not None and _plain_matches(user, password, self.plain_users):
                return
        challenge = 'Basic realm="metrics"' if users or self.plain_users is not None else 'Bearer realm="metrics"'
        raise Unauthorized("valid metrics credentials are required", challenge)

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
        open_to_others = GaugeMetricFamily(
            "cache_config_exporter_config_file_open_to_others",
            "1 if others, or the group of a file the exporter's user owns, may read this secret file "
            "(ssh's rule for private keys): chmod 600 it.",
            labels=["file"],
        )
        for watched in self._watched():
            watched.current()
            file = watched.name.partition(" ")[2]
            successful.add_metric([file], float(watched.last_reload_successful))
            timestamp.add_metric([file], watched.last_success_time)
            if watched in (self.ingest_tokens, self.metrics_tokens):
                open_to_others.add_metric([file], float(watched.open_to_others))
        yield successful
        yield timestamp
        yield open_to_others
        checks = CounterMetricFamily(
            "cache_config_exporter_password_checks",
            "Basic-auth passwords by outcome: remembered (verified before), right, wrong, busy (refused with 503: "
            "too many checks waited), client_gone (hung up before its check).",
            labels=["outcome"],
        )
        for outcome, count in self._bcrypt.outcomes.items():
            checks.add_metric([outcome], count)
        yield checks


def _plain_users(path: Path | None) -> dict[str, bytes] | None:
    """``--web.metrics-basic-auth-file``: deprecated ``USER:PASSWORD`` lines, read once at start."""
    if path is None:
        return None
    flag = web_flag("metrics_basic_auth_file")
    _log.warning(
        "%s keeps passwords in plain text and is deprecated: put bcrypt hashes under basic_auth_users in %s instead",
        flag,
        WEB_CONFIG_FLAG,
    )
    users = {}
    for number, line in enumerate(read_secret(flag, path).splitlines(), 1):
        user, separator, password = line.strip().partition(":")
        if not separator or not user or not password:
            raise SettingsError(f"{flag} line {number}: expected USER:PASSWORD")
        users[user] = password.encode()
    return users


def _bearer_matches(authorization: str, tokens: frozenset[bytes]) -> bool:
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    offered = value.strip().encode()
    # Every token is compared, so that timing does not tell which one (or how many) there are.
    return sum(hmac.compare_digest(offered, token) for token in tokens) > 0


def _basic_credentials(authorization: str) -> tuple[str, bytes] | None:
    scheme, _, value = authorization.partition(" ")
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
