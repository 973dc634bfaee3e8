"""The endpoint table (exporter/server/endpoints.py, exporter/server/routes.py): every route the apps serve comes
from a declaration naming its access, and the one place that enforces it refuses what each access refuses. The
heartbeats answered beneath the app take the same check: tests/server/test_quick_heartbeats.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from exporter.server.endpoints import Access, Endpoint
from tests.helpers.http import Reply
from tests.probe.test_probe import LOOPBACK

INGEST_TOKEN, READ_TOKEN = "ingest-token", "read-token"


@pytest.fixture
def guarded(make_client: Callable[..., TestClient], tmp_path: Path) -> Callable[..., TestClient]:
    """An app with an ingest token and a metrics token configured; keyword arguments go to ``Settings``."""
    (tmp_path / "ingest.token").write_text(INGEST_TOKEN + "\n")
    (tmp_path / "metrics.token").write_text(READ_TOKEN + "\n")

    def make(**settings: object) -> TestClient:
        if not settings.get("probe_only"):  # a probe-only exporter refuses an ingest token: it has no ingest
            settings["ingest_token_file"] = tmp_path / "ingest.token"
        return make_client(metrics_token_file=tmp_path / "metrics.token", **settings)

    return make


def declared(client: TestClient) -> list[Endpoint]:
    """The declaration of every route the app serves; a route without one fails the test naming its path."""
    found = []
    for route in client.app.router.routes:  # type: ignore[attr-defined]
        declaration = getattr(getattr(route, "endpoint", None), "declared", None)
        assert isinstance(declaration, Endpoint), f"{route.path} is served without a declaration"
        assert isinstance(declaration.access, Access), route.path
        found.append(declaration)
    return found


def concrete(path: str) -> str:
    """A request path for a declared path: its deployment ``qwen``, its engine 0."""
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda match: "0" if match[1] == "engine" else "qwen", path)


@pytest.mark.parametrize("probe_only", [False, True], ids=["exporter", "probe-only"])
def test_every_route_served_is_declared_with_its_access(guarded: Callable[..., TestClient], probe_only: bool) -> None:
    client = guarded(probe_only=probe_only, probe_allowed_targets=(LOOPBACK,))
    endpoints = declared(client)
    served = {(method, endpoint.path) for endpoint in endpoints for method in endpoint.methods}
    assert ("GET", "/openapi.json") in served and ("GET", "/metrics") in served
    assert len(served) == len([method for endpoint in endpoints for method in endpoint.methods])


def test_each_route_refuses_what_its_declared_access_refuses(guarded: Callable[..., TestClient]) -> None:
    """Without credentials an ingest or read route is a 401 naming its realm; with the other kind's token too;
    an open route never asks for any. The checks come before the query's: none here has a valid one."""
    client = guarded()
    endpoints = declared(client)
    assert {endpoint.access for endpoint in endpoints} == set(Access)
    for endpoint in endpoints:
        for method in endpoint.methods:
            path = concrete(endpoint.path)
            anonymous = client.request(method, path)
            if endpoint.access is Access.OPEN:
                assert anonymous.status_code != 401, (method, path)
                continue
            realm = "ingest" if endpoint.access is Access.INGEST else "metrics"
            Reply.of(anonymous).problem(401)
            assert f'realm="{realm}"' in anonymous.headers["www-authenticate"], (method, path)
            other = READ_TOKEN if endpoint.access is Access.INGEST else INGEST_TOKEN
            Reply.of(client.request(method, path, headers={"Authorization": f"Bearer {other}"})).problem(401)
            right = INGEST_TOKEN if endpoint.access is Access.INGEST else READ_TOKEN
            admitted = client.request(method, path, headers={"Authorization": f"Bearer {right}"})
            assert admitted.status_code != 401, (method, path)
