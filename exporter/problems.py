"""RFC 9457 problem details: every refusal says which field was wrong and why."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

PROBLEM_JSON = "application/problem+json"


class Problem(Exception):
    """An error answered as ``application/problem+json``; ``reason`` also labels the rejection counter."""

    def __init__(self, status: int, title: str, detail: str, field: str | None = None, reason: str = "invalid") -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.field = field
        self.reason = reason
        self.headers: dict[str, str] = {}


def problem_response(request: Request, problem: Problem) -> JSONResponse:
    body: dict[str, object] = {
        "type": f"urn:cache-config-exporter:problem:{problem.reason}",
        "title": problem.title,
        "status": problem.status,
        "detail": problem.detail,
        "instance": request.url.path,
    }
    if problem.field is not None:
        body["field"] = problem.field
    return JSONResponse(body, status_code=problem.status, media_type=PROBLEM_JSON, headers=problem.headers)


async def handle_problem(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, Problem)
    return problem_response(request, error)


async def handle_http_exception(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own errors (404 route, 405 method) in the same shape as ours."""
    assert isinstance(error, HTTPException)
    problem = Problem(error.status_code, str(error.detail), str(error.detail), reason="http")
    problem.headers = dict(error.headers or {})
    return problem_response(request, problem)


async def handle_validation_error(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's parameter validation (e.g. a non-numeric engine index), naming the parameter."""
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    return problem_response(
        request, Problem(422, "Invalid request", str(first.get("msg")), location, "invalid_request")
    )
