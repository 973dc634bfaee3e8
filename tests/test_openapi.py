"""/openapi.json (exporter/openapi.py): written from the same Structs that validate each route's parameters."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.helpers.http import MSGPACK
from tests.support import fixture_bytes


def _parameters(document: dict[str, Any], path: str, method: str) -> dict[str, dict[str, Any]]:
    return {parameter["name"]: parameter for parameter in document["paths"][path][method]["parameters"]}


def test_every_route_is_documented_with_its_parameters(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.") and document["info"]["title"] == "cache-config-exporter"
    ready = _parameters(document, "/api/v1/deployments/{deployment}/ready", "post")
    assert ready["deployment"]["in"] == "path" and ready["deployment"]["required"]
    engine = ready["engine"]["schema"]["anyOf"][0]
    assert (engine["type"], engine["minimum"]) == ("integer", 0)
    assert ready["replica"]["schema"]["default"] == "default" and ready["replica"]["description"]
    heartbeat = _parameters(document, "/api/v1/deployments/{deployment}/heartbeat", "post")
    assert heartbeat["interval"]["required"] and not heartbeat["replica"]["required"]
    operations = [operation for methods in document["paths"].values() for operation in methods.values()]
    assert len(operations) == 9
    assert all(operation["summary"] and "application/problem+json" in operation["responses"]["4XX"]["content"]
               for operation in operations)  # fmt: skip


def test_what_the_document_bounds_the_route_refuses(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    bound = _parameters(document, "/api/v1/deployments/{deployment}/ready", "post")["engine"]["schema"]["anyOf"][0]
    past = bound["exclusiveMaximum"]
    refused = client.post(f"/api/v1/deployments/d/ready?engine={past}", content=fixture_bytes("dense-post50809"),
                          headers=MSGPACK)  # fmt: skip
    assert refused.status_code == 422
    assert refused.json()["field"] == "query.engine"
