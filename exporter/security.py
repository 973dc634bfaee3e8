"""Who may do what: a bearer token for ingest and changes, bearer or basic auth for reading metrics.

Secrets are compared in constant time and never appear in logs or error bodies.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass

from fastapi import Request

from exporter.problems import Problem
from exporter.settings import Settings, SettingsError, read_secret


@dataclass(frozen=True)
class Credentials:
    """The secrets read at start-up; ``None`` means that kind of access is open."""

    ingest_token: bytes | None
    metrics_token: bytes | None
    metrics_users: dict[str, bytes] | None

    @classmethod
    def from_settings(cls, settings: Settings) -> Credentials:
        def token(flag: str, path: object) -> bytes | None:
            return read_secret(flag, path).encode() if path is not None else None

        users = None
        if settings.metrics_basic_auth_file is not None:
            users = {}
            lines = read_secret("--web.metrics-basic-auth-file", settings.metrics_basic_auth_file).splitlines()
            for number, line in enumerate(lines, 1):
                user, separator, password = line.strip().partition(":")
                if not separator or not user or not password:
                    raise SettingsError(f"--web.metrics-basic-auth-file line {number}: expected USER:PASSWORD")
                users[user] = password.encode()
        return cls(
            ingest_token=token("--web.ingest-token-file", settings.ingest_token_file),
            metrics_token=token("--web.metrics-token-file", settings.metrics_token_file),
            metrics_users=users,
        )

    def require_ingest(self, request: Request) -> None:
        """Ingest and every change need the ingest token, when one is configured."""
        if self.ingest_token is not None and not _bearer_matches(request, self.ingest_token):
            raise _unauthorized("a valid ingest bearer token is required", 'Bearer realm="ingest"')

    def require_reader(self, request: Request) -> None:
        """Metrics and the JSON state need the metrics token or a metrics user, when configured."""
        if self.metrics_token is None and self.metrics_users is None:
            return
        if self.metrics_token is not None and _bearer_matches(request, self.metrics_token):
            return
        if self.metrics_users is not None and _basic_matches(request, self.metrics_users):
            return
        challenge = 'Basic realm="metrics"' if self.metrics_users is not None else 'Bearer realm="metrics"'
        raise _unauthorized("valid metrics credentials are required", challenge)


def _unauthorized(detail: str, challenge: str) -> Problem:
    problem = Problem(401, "Unauthorized", detail, "Authorization", "unauthorized")
    problem.headers["WWW-Authenticate"] = challenge
    return problem


def _bearer_matches(request: Request, token: bytes) -> bool:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token)


def _basic_matches(request: Request, users: dict[str, bytes]) -> bool:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, _, password = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    # Compare against a dummy for unknown users too, so timing does not reveal which users exist.
    expected = users.get(user, b"\0" * 32)
    return hmac.compare_digest(password.encode(), expected) and user in users
