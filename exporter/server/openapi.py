"""The OpenAPI document of the routes, written from their declarations (``Endpoint``,
``exporter/server/endpoints.py``): each handler's docstring and the msgspec Struct of its query parameters (the
same schema that validates them)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from exporter.server.endpoints import Endpoint

_PATH_PARAMETER = re.compile(r"\{(\w+)(?::\w+)?\}")
# reStructuredText's inline literal (the docstrings'), as CommonMark (OpenAPI's) writes it.
_LITERAL = re.compile(r"``(.+?)``")
_PROBLEM = {
    "description": "A problem (RFC 9457) naming the field at fault",
    "content": {"application/problem+json": {}},
}


def _parameters(endpoint: Endpoint) -> list[dict[str, Any]]:
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "integer" if name == "engine" else "string"}}
        for name in _PATH_PARAMETER.findall(endpoint.path)
    ]
    if endpoint.query is not None:
        (_,), components = msgspec.json.schema_components([endpoint.query], ref_template="#/components/schemas/{name}")
        schema = components[endpoint.query.__name__]
        required = set(schema.get("required", ()))
        for name, field in schema["properties"].items():
            description = field.pop("description", None) or next(
                (option.pop("description") for option in field.get("anyOf", ()) if "description" in option), ""
            )
            parameters.append(
                {
                    "name": name,
                    "in": "query",
                    "required": name in required,
                    "description": markdown(description),
                    "schema": field,
                }
            )
    return parameters


def markdown(text: str) -> str:
    """A docstring's text as CommonMark: ````x```` becomes ```x```."""
    return _LITERAL.sub(r"`\1`", text)


def openapi_document(title: str, version: str, endpoints: Iterable[Endpoint]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    named: set[str] = set()
    for endpoint in endpoints:
        if not endpoint.documented:
            continue
        # Unique, as OpenAPI requires: a handler that serves a second path gets that path in its name.
        operation_id = endpoint.handler.__name__
        if operation_id in named:
            operation_id += "_" + re.sub(r"\W+", "_", _PATH_PARAMETER.sub(r"\1", endpoint.path)).strip("_")
        named.add(operation_id)
        done: dict[str, Any] = {"description": "Done"}
        if endpoint.status != 204:
            done["content"] = {media: {} for media in endpoint.answers}
        operation: dict[str, Any] = {
            "summary": markdown((endpoint.handler.__doc__ or "").strip().splitlines()[0]),
            "operationId": operation_id,
            "parameters": _parameters(endpoint),
            "responses": {str(endpoint.status): done, "4XX": _PROBLEM, "503": _PROBLEM},
        }
        if endpoint.body:
            operation["requestBody"] = {"required": True, "content": {media: {} for media in endpoint.body}}
        path = _PATH_PARAMETER.sub(r"{\1}", endpoint.path)
        for method in endpoint.methods:
            paths.setdefault(path, {})[method.lower()] = operation
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths}
