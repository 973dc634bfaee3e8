"""Access refusals go through the one table (exporter/server/problems.py), each with the headers a client needs."""

from __future__ import annotations

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
