"""Access (exporter/security/auth.py): basic credentials read as clients send them, and refusals through the one
table (exporter/server/problems.py), each with the headers a client needs."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

from starlette.testclient import TestClient

from exporter.security.auth import Unauthorized
from exporter.security.bcrypt_checks import AuthenticationBusy
from exporter.server.problems import problem_for


def test_a_401_carries_its_own_challenge() -> None:
    ingest = problem_for(Unauthorized("a valid ingest bearer token is required", 'Bearer realm="ingest"'))
    metrics = problem_for(Unauthorized("valid metrics credentials are required", 'Basic realm="metrics"'))
    assert (ingest.status, ingest.reason, ingest.field) == (401, "unauthorized", "Authorization")
    assert ingest.headers == {"WWW-Authenticate": 'Bearer realm="ingest"'}
    assert metrics.headers == {"WWW-Authenticate": 'Basic realm="metrics"'}, "one refusal's headers are its own"


def test_too_many_waiting_password_checks_say_when_to_retry() -> None:
    problem = problem_for(AuthenticationBusy("Authorization", "too many password checks are waiting"))
    assert (problem.status, problem.reason, problem.headers) == (503, "auth_busy", {"Retry-After": "1"})
    assert problem.field == "Authorization"


def scrape_as(client: TestClient, user: str, password: str) -> int:
    credentials = base64.b64encode(f"{user}:{password}".encode()).decode()
    return client.get("/metrics", headers={"Authorization": f"Basic {credentials}"}).status_code


def plain_users(directory: Path, lines: str) -> Path:
    users = directory / "users"
    users.write_text(lines)
    users.chmod(0o600)
    return users


def test_a_password_may_hold_colons(make_client: Callable[..., TestClient], tmp_path: Path) -> None:
    """Basic auth splits at the first colon: a user name has none, a password may have several."""
    client = make_client(metrics_basic_auth_file=plain_users(tmp_path, "prometheus:pass:with:colons\n"))
    assert scrape_as(client, "prometheus", "pass:with:colons") == 200
    assert scrape_as(client, "prometheus", "pass") == 401


def test_an_unknown_user_is_refused_whatever_the_password(
    make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    """Unknown users are compared against a stand-in password (so that timing tells nothing); it is no password."""
    client = make_client(metrics_basic_auth_file=plain_users(tmp_path, "prometheus:the-password\n"))
    assert scrape_as(client, "prometheus", "the-password") == 200
    for password in ("\0" * 32, "", "the-password"):
        assert scrape_as(client, "nobody", password) == 401
