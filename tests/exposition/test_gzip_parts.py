"""The gzip body of a large fleet compressed in parts (exporter/exposition/rendering.py): a change compresses
again only the parts holding the changed replica's lines, and the body stays one valid gzip member (its CRC-32
combined from the parts') of the same exposition as the plain one."""

from __future__ import annotations

import zlib

import msgspec
import pytest
from fastapi.testclient import TestClient

from exporter.exposition import rendering
from tests.support import fixture_bytes

MSGPACK = {"Content-Type": "application/vnd.msgpack"}
REPLICAS = 60


def push(client: TestClient, replica: int, blocks: int) -> None:
    body = msgspec.msgpack.encode({**msgspec.msgpack.decode(fixture_bytes("dp2-rank0")), "num_gpu_blocks": blocks})
    answer = client.post(f"/api/v1/deployments/fleet/ready?replica=r{replica:03d}", content=body, headers=MSGPACK)
    assert answer.status_code == 200, answer.text


def scrapes(client: TestClient) -> tuple[str, str]:
    """The gzip body, decompressed as one member whose CRC-32 and length zlib checks, and the plain body."""
    with client.stream("GET", "/metrics", headers={"Accept-Encoding": "gzip"}) as response:
        zipped = b"".join(response.iter_raw())
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    text = decompressor.decompress(zipped) + decompressor.flush()
    assert decompressor.eof and decompressor.unused_data == b""
    plain = client.get("/metrics", headers={"Accept-Encoding": "identity"}).text
    return text.decode(), plain


def config(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("cache_config_") or line.startswith("# ")]


def test_a_change_compresses_only_the_parts_of_its_replica_and_the_body_stays_valid(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    compressed: list[int] = []
    compress = rendering._Part.of

    def counted(segment: rendering.Segment) -> rendering._Part:
        compressed.append(segment.number)
        return compress(segment)

    monkeypatch.setattr(rendering._Part, "of", counted)
    for replica in range(REPLICAS):
        push(client, replica, 1000)
    whole, plain = scrapes(client)
    assert config(whole) == config(plain)
    parts = len(compressed)
    compressed.clear()
    push(client, 17, 2000)
    changed, plain = scrapes(client)
    assert config(changed) == config(plain) and 'num_gpu_blocks="2000"' in changed
    assert 0 < len(compressed) < parts, "only the parts holding the changed replica's lines"
    assert sorted(set(compressed)) == sorted(compressed)
