"""Ready responses that each carry a value of their own, pushing one, and reading the values back from the API."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tests.helpers.http import MSGPACK, request
from tests.support import fixture_bytes

_BASE_RESPONSE: dict[str, Any] = msgspec.msgpack.decode(fixture_bytes("dp2-rank0"))

# Nearly the largest static labels the default 64 KiB body cap admits: 15 values of 4,096 characters, which
# every engine of the deployment then carries in its info labels.
BULKY_STATIC_CONFIG = json.dumps({f"bulky_{index:02d}": "x" * 4096 for index in range(15)})


def ready_response(engine: int, num_gpu_blocks: int, engines: int, instance_id: str = "reliability-run") -> bytes:
    """A real-shaped msgpack ready response of engine ``engine`` of ``engines``, carrying ``num_gpu_blocks``."""
    document = dict(
        _BASE_RESPONSE,
        data_parallel_rank=engine,
        data_parallel_size=engines,
        world_size=engines,
        num_gpu_blocks=num_gpu_blocks,
        instance_id=instance_id,
    )
    return msgspec.msgpack.encode(document)


def engine_blocks(state: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """``GET /api/v1/deployments`` as {(deployment, engine): that engine's own num_gpu_blocks}."""
    return {
        (deployment["deployment"], engine["engine"]): engine["response"]["num_gpu_blocks"]
        for deployment in state
        for engine in deployment["engines"]
    }


def push_ready(url: str, deployment: str, body: bytes, query: str = "") -> Any:
    """POST ``body`` as ``deployment``'s msgpack ready response (it must be taken): the state it answers."""
    reply = request(url, "POST", f"/api/v1/deployments/{deployment}/ready{query}", body, MSGPACK)
    assert reply.status == 200, reply.body[:300]
    return reply.json()
