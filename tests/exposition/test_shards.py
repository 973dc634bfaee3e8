"""Shards of /metrics (exporter/exposition/shards.py, ``?shard=i&total_shards=n``): each deployment in exactly one
shard, the shards' union the whole exposition, and the query's bounds at the bound and one past it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from exporter.exposition.rendering import SHARDS_KEPT
from exporter.exposition.shards import MAX_SHARDS, Shard, fnv1a_32
from tests.helpers.exposition import cache_config_samples
from tests.support import fixture_bytes

MSGPACK = {"Content-Type": "application/vnd.msgpack"}
DEPLOYMENTS = [f"model-{index}" for index in range(12)]


def test_the_hash_is_fnv1a_32_as_published() -> None:
    # The FNV test vectors (draft-eastlake-fnv): the same value in every process, unlike Python's hash().
    assert [fnv1a_32(text) for text in (b"", b"a", b"foobar")] == [0x811C9DC5, 0xE40C292C, 0xBF9CF968]


def test_a_deployment_is_in_exactly_one_shard_whatever_its_replica() -> None:
    for total in (1, 2, 3, 7):
        for deployment in DEPLOYMENTS:
            holding = [index for index in range(total) if Shard(index, total).keeps((deployment, "r"))]
            assert len(holding) == 1
            assert all(Shard(holding[0], total).keeps((deployment, replica)) for replica in ("a", "b", "c"))


def fleet(client: TestClient) -> None:
    """Two replicas of each deployment, so that a shard's lines are whole deployments."""
    for deployment in DEPLOYMENTS:
        for replica in ("a", "b"):
            answer = client.post(
                f"/api/v1/deployments/{deployment}/ready?replica={replica}",
                content=fixture_bytes("dp2-rank0"),
                headers=MSGPACK,
            )
            assert answer.status_code == 200, answer.text


def cache_config(text: str) -> set[tuple[str, tuple, float]]:
    return set(cache_config_samples(text))


@pytest.mark.parametrize("total", [1, 3, 5])
def test_the_shards_union_is_the_whole_exposition_and_no_line_is_in_two(client: TestClient, total: int) -> None:
    fleet(client)
    whole = cache_config(client.get("/metrics").text)
    shards = [cache_config(client.get(f"/metrics?shard={index}&total_shards={total}").text) for index in range(total)]
    assert set().union(*shards) == whole
    assert sum(map(len, shards)) == len(whole), "a line in two shards"
    for index, lines in enumerate(shards):
        deployments = {dict(labels)["deployment"] for _, labels, _ in lines}
        assert deployments == {name for name in DEPLOYMENTS if Shard(index, total).keeps((name, "a"))}


def test_a_gzip_shard_is_the_text_shard_compressed_and_every_shard_has_the_exporters_own_metrics(
    client: TestClient,
) -> None:
    fleet(client)
    for index in range(3):
        path = f"/metrics?shard={index}&total_shards=3"
        text = client.get(path).text
        zipped = client.get(path, headers={"Accept-Encoding": "gzip"})
        assert zipped.headers["content-encoding"] == "gzip"  # the client inflates it
        assert cache_config(zipped.text) == cache_config(text)
        assert "cache_config_exporter_ready_responses_accepted_total" in text


def test_a_shard_shows_a_change_of_its_deployment_at_the_next_scrape(client: TestClient) -> None:
    fleet(client)
    shard = next(Shard(index, 2) for index in range(2) if Shard(index, 2).keeps(("model-0", "a")))
    path = f"/metrics?shard={shard.index}&total_shards=2"
    assert 'deployment="model-0"' in client.get(path).text
    assert client.delete("/api/v1/deployments/model-0").status_code == 204
    assert 'deployment="model-0"' not in client.get(path).text


@pytest.mark.parametrize(
    ("query", "field"),
    [
        (f"shard={MAX_SHARDS - 1}&total_shards={MAX_SHARDS}", None),  # at the bounds
        (f"shard=0&total_shards={MAX_SHARDS + 1}", "query.total_shards"),  # one past the most shards
        ("shard=0&total_shards=0", "query.total_shards"),
        ("shard=2&total_shards=3", None),
        ("shard=3&total_shards=3", "query.shard"),  # one past the last shard
        ("shard=-1&total_shards=3", "query.shard"),
        ("shard=0", "query.total_shards"),
        ("total_shards=3", "query.shard"),
        ("shard=one&total_shards=3", "query.shard"),
    ],
)
def test_the_shard_query_at_its_bounds_and_one_past_them(client: TestClient, query: str, field: str | None) -> None:
    fleet(client)
    answer = client.get(f"/metrics?{query}")
    if field is None:
        assert answer.status_code == 200
        return
    assert answer.status_code == 422
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert answer.json()["field"] == field


def test_the_lines_of_the_last_shards_kept_are_kept_and_one_more_drops_the_oldest(client: TestClient) -> None:
    fleet(client)
    exposition = client.app.state.exporter.exposition  # type: ignore[attr-defined]
    total = SHARDS_KEPT + 1
    for index in range(SHARDS_KEPT):
        assert client.get(f"/metrics?shard={index}&total_shards={total}").status_code == 200
    assert all(exposition.is_fresh(False, Shard(index, total)) for index in range(SHARDS_KEPT)), "at the bound"
    assert client.get(f"/metrics?shard={SHARDS_KEPT}&total_shards={total}").status_code == 200  # one past it
    assert not exposition.is_fresh(False, Shard(0, total)), "the oldest is dropped"
    assert all(exposition.is_fresh(False, Shard(index, total)) for index in range(1, total))
