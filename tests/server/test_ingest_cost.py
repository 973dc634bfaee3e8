"""What a ready response costs to decode and to encode as JSON, at ingest, at a scrape and in the listing: the
figures docs/architecture.md gives ("What a ready response costs to decode")."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from starlette.testclient import TestClient

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


def test_a_msgpack_ready_response_is_decoded_four_times_at_ingest_never_at_a_scrape_once_to_be_listed(
    client: TestClient, counts: Counter[str]
) -> None:
    pushed = client.post(
        "/api/v1/deployments/qwen/ready", content=fixture_bytes("hybrid-tp1-post50809"), headers=MSGPACK
    )
    assert pushed.status_code == 200
    assert counts == {"untyped decode": 3, "typed decode": 1, "JSON encode": 3}
    counts.clear()
    assert client.get("/metrics").status_code == 200
    assert counts == {}
    for _ in range(2):  # the listing keeps each replica's JSON until the replica changes
        assert client.get("/api/v1/deployments").status_code == 200
        assert counts == {"untyped decode": 1, "JSON encode": 1}
