"""/openapi.json (exporter/server/openapi.py): written from the same Structs that validate each route's parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.testclient import TestClient

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
    # The nine API operations, /metrics, and the probes' /-/healthy and /-/ready.
    assert len(operations) == 12
    assert all(operation["summary"] and "application/problem+json" in operation["responses"]["4XX"]["content"]
               for operation in operations)  # fmt: skip
    assert len({operation["operationId"] for operation in operations}) == len(operations)


def test_metrics_and_the_probes_are_documented_with_what_they_answer(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert set(metrics) == {
        "text/plain; version=0.0.4; charset=utf-8",
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
    }
    for probe in ("/-/healthy", "/-/ready"):
        assert set(paths[probe]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "application/json" in paths["/api/v1/deployments"]["get"]["responses"]["200"]["content"]
    assert "content" not in paths["/api/v1/deployments/{deployment}"]["delete"]["responses"]["204"]


def test_a_moved_telemetry_path_is_documented_where_it_is(make_client: Callable[..., TestClient]) -> None:
    paths = make_client(telemetry_path="/exposition").get("/openapi.json").json()["paths"]
    assert "/exposition" in paths and "/metrics" not in paths


def test_the_texts_are_commonmark_not_restructuredtext(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    texts = [operation["summary"] for methods in document["paths"].values() for operation in methods.values()]
    texts += [parameter.get("description", "") for methods in document["paths"].values()
              for operation in methods.values() for parameter in operation["parameters"]]  # fmt: skip
    assert not [text for text in texts if "``" in text]
    assert "paged with `limit` and `after`" in document["paths"]["/api/v1/deployments"]["get"]["summary"]


def test_what_the_document_bounds_the_route_refuses(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    bound = _parameters(document, "/api/v1/deployments/{deployment}/ready", "post")["engine"]["schema"]["anyOf"][0]
    past = bound["exclusiveMaximum"]
    refused = client.post(f"/api/v1/deployments/d/ready?engine={past}", content=fixture_bytes("dense-post50809"),
                          headers=MSGPACK)  # fmt: skip
    assert refused.status_code == 422
    assert refused.json()["field"] == "query.engine"
