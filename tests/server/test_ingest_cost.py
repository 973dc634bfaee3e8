"""What a ready response costs to decode and to encode as JSON, at ingest, at a scrape and in the listing: the
figures docs/architecture.md gives ("What a ready response costs to decode")."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from exporter.server.routes import INLINE_VIEW_ENGINES
from protocol import ready_response
from tests.helpers.http import MSGPACK
from tests.support import fixture_bytes


class Counted:
    """A msgspec decoder or encoder whose calls are counted under ``name``."""

    def __init__(self, counts: Counter[str], name: str, inner: Any) -> None:
        self.counts, self.name, self.inner = counts, name, inner

    def decode(self, payload: bytes) -> Any:
        self.counts[self.name] += 1
        return self.inner.decode(payload)

    def encode(self, value: Any) -> bytes:
        self.counts[self.name] += 1
        return self.inner.encode(value)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The protocol's msgspec decoders and JSON encoder of ready responses, counted."""
    counted: Counter[str] = Counter()
    for attribute, name in (("_raw_decoders", "untyped decode"), ("_decoders", "typed decode")):
        decoders = getattr(ready_response, attribute)
        monkeypatch.setattr(
            ready_response, attribute, {kind: Counted(counted, name, d) for kind, d in decoders.items()}
        )
    monkeypatch.setattr(ready_response, "_json_encoder", Counted(counted, "JSON encode", ready_response._json_encoder))
    return counted


def test_a_msgpack_ready_response_is_decoded_twice_at_ingest_never_at_a_scrape_once_to_be_listed(
    client: TestClient, counts: Counter[str]
) -> None:
    pushed = client.post(
        "/api/v1/deployments/qwen/ready", content=fixture_bytes("hybrid-tp1-post50809"), headers=MSGPACK
    )
    assert pushed.status_code == 200
    assert counts == {"untyped decode": 1, "typed decode": 1, "JSON encode": 1}
    assert pushed.json()["engines"][0]["response"] == msgspec.msgpack.decode(fixture_bytes("hybrid-tp1-post50809"))
    counts.clear()
    assert client.get("/metrics").status_code == 200
    assert counts == {}
    for _ in range(2):  # the listing keeps each replica's JSON until the replica changes
        assert client.get("/api/v1/deployments").status_code == 200
        assert counts == {"untyped decode": 1, "JSON encode": 1}


@pytest.mark.parametrize("engines", [INLINE_VIEW_ENGINES, INLINE_VIEW_ENGINES + 1])
def test_the_answer_at_the_event_loops_bound_and_one_past_it_shows_every_engine_as_sent(
    client: TestClient, engines: int
) -> None:
    """Up to INLINE_VIEW_ENGINES the answer is encoded on the event loop, past it in the thread pool: the same
    answer, the engine just sent from the JSON its decode made, the others from their kept bytes."""
    sent = {}
    for rank in range(engines):
        response = {**msgspec.msgpack.decode(fixture_bytes("dp2-rank0")), "data_parallel_size": engines,
                    "data_parallel_rank": rank}  # fmt: skip
        sent[rank] = response
        answer = client.post(
            "/api/v1/deployments/wide/ready", content=msgspec.msgpack.encode(response), headers=MSGPACK
        )
        assert answer.status_code == 200, answer.text
    shown = {engine["engine"]: engine["response"] for engine in answer.json()["engines"]}
    assert shown == sent
