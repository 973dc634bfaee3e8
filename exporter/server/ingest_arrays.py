"""A request that sends an array of one replica's engines' ready responses: each checked alone, the accepted ones
committed together, each refused one named by its ``index`` in the array.

Some taken: 200 with the replica and the refusals. None taken: the first refusal's problem, with all of them.
The route (``post_ready``, ``exporter/server/routes.py``) tells an array from a single response; the state
(``ExporterState.apply_ready_many``) applies the accepted ones in one pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from exporter.exposition.views import ReplicaView, view
from exporter.server.problems import PROBLEM_JSON, Problem, problem_for, problem_response
from exporter.server.queries import MAX_READY_BATCH, MSGPACK_ARRAY, item_decoders
from exporter.state.changes import EngineReady, ReadyOutcome
from exporter.state.exporter_state import ExporterState
from exporter.state.replicas import ReplicaKey
from protocol import (
    EngineCoreReadyResponse,
    InvalidPayload,
    MalformedPayload,
    check_engine_index,
    decode_shown_ready_response,
)
from protocol.ready_response import MSGPACK


def engine_of(given: int | None, response: EngineCoreReadyResponse) -> int:
    """The engine index of a response: ``?engine=``, else its ``data_parallel_rank``, else 0; checked against it."""
    rank = response.data_parallel_rank
    index = given if given is not None else rank if isinstance(rank, int) else 0
    check_engine_index(index, response)
    return index


def is_array(payload: bytes, wire_format: str) -> bool:
    """Whether a ready request's body is an array of ready responses (else it is one)."""
    if wire_format == MSGPACK:
        return payload[:1] != b"" and payload[0] in MSGPACK_ARRAY
    return payload.lstrip(b" \t\r\n")[:1] == b"["


def items_of(payload: bytes, wire_format: str) -> list[bytes]:
    """The ready responses of an array, each as its own bytes (checked one by one afterwards)."""
    try:
        items = item_decoders[wire_format].decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:
        raise MalformedPayload("$", "nested too deeply") from None
    if not 1 <= len(items) <= MAX_READY_BATCH:
        raise InvalidPayload("$", f"an array holds 1 to {MAX_READY_BATCH} ready responses, not {len(items)}")
    return [bytes(item) for item in items]


class ReadyManyAnswer(msgspec.Struct):
    """The answer to several ready responses of which some were taken: the replica as committed, and each
    refused response's problem, with its ``index`` in the array."""

    replica: ReplicaView
    refused: list[dict[str, Any]]


async def ingest_array(
    request: Request,
    state: ExporterState,
    reject: Callable[[str], None],
    key: ReplicaKey,
    items: list[bytes],
    wire_format: str,
    heartbeat: float | None,
) -> Response:
    """Check each response alone, commit the accepted ones together and answer (see the module); each refusal is
    counted by its reason with ``reject``."""
    reports, refused, places = [], {}, {}
    for index, item in enumerate(items):
        try:
            response, shown = decode_shown_ready_response(item, wire_format)
            report = EngineReady(engine_of(None, response), response, item, wire_format, shown)
        except InvalidPayload as error:
            refused[index] = error
            continue
        reports.append(report)
        places[report.engine] = index
    outcome = ReadyOutcome(None, {})
    if reports:
        outcome = await asyncio.wrap_future(state.apply_ready_many(key, reports, heartbeat))
    refused.update((places[engine], error) for engine, error in outcome.refused.items())
    problems = [_item_problem(request, index, error) for index, error in sorted(refused.items())]
    for problem in problems:
        reject(problem["reason"])
        del problem["reason"]
    if len(refused) < len(items) and outcome.replica is not None:
        body = msgspec.json.encode(ReadyManyAnswer(view(outcome.replica), problems))
        return Response(body, media_type="application/json")
    first = problems[0]
    body = msgspec.json.encode(
        {**{name: value for name, value in first.items() if name != "index"}, "refused": problems}
    )
    return Response(body, first["status"], media_type=PROBLEM_JSON)


def _item_problem(request: Request, index: int, error: Exception) -> dict[str, Any]:
    """The problem of the ``index``-th response of an array, its field as a path into the array."""
    problem = problem_for(error)
    field = problem.field
    if field is not None and field.startswith("$"):
        field = f"$[{index}]{field[1:]}"
    named = Problem(problem.status, problem.title, problem.detail, field, problem.reason)
    return {**msgspec.json.decode(problem_response(request, named).body), "index": index, "reason": problem.reason}
