"""The HTTP API, driven through the real ASGI app with its own store and registry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from starlette.testclient import TestClient

from tests.helpers.exposition import info_labels, samples
from tests.helpers.http import MSGPACK
from tests.support import fixture_bytes

READY = "/api/v1/deployments/qwen/ready"


def post(client: TestClient, name: str, deployment: str = "qwen", **params: object):
    return client.post(
        f"/api/v1/deployments/{deployment}/ready", content=fixture_bytes(name), headers=MSGPACK, params=params
    )


def scrape(client: TestClient) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.text


def stored_state(client: TestClient) -> bytes:
    return client.get("/api/v1/deployments").content


@pytest.mark.parametrize("content_type", ["application/vnd.msgpack", "application/msgpack", "application/x-msgpack"])
def test_msgpack_ready_response_shows_true_block_sizes(client: TestClient, content_type: str) -> None:
    response = client.post(READY, content=fixture_bytes("hybrid-tp1-post50809"), headers={"Content-Type": content_type})
    assert response.status_code == 200
    state = response.json()
    assert state["deployment"] == "qwen"
    assert state["labels"]["block_size"] == state["labels"]["mamba_block_size"] == "1056"
    assert [engine["engine"] for engine in state["engines"]] == [0]
    labels = info_labels(scrape(client), "qwen")["0"]
    assert (labels["block_size"], labels["mamba_block_size"]) == ("1056", "1056")


def test_json_body_is_accepted_too(client: TestClient) -> None:
    response = client.post(
        READY,
        content=fixture_bytes("hybrid-tp4-post50809", "json"),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200
    assert info_labels(scrape(client), "qwen")["0"]["block_size"] == "528"


def test_default_deployment_route(client: TestClient) -> None:
    assert client.post("/api/v1/ready", content=fixture_bytes("dense-post50809"), headers=MSGPACK).status_code == 200
    assert client.get("/api/v1/deployments/default").json()["labels"]["num_gpu_blocks"] == "27450"


def test_numeric_gauges_are_each_engines_own_figures(client: TestClient) -> None:
    post(client, "dp2-rank0")
    post(client, "dp2-rank1")
    exposition = scrape(client)
    blocks = {s.labels["engine"]: s.value for s in samples(exposition, "cache_config_num_gpu_blocks")}
    assert blocks == {"0": 1997, "1": 1997}
    assert {label["num_gpu_blocks"] for label in info_labels(exposition, "qwen").values()} == {"3994"}
    tokens = {s.labels["engine"]: s.value for s in samples(exposition, "cache_config_kv_cache_size_tokens")}
    assert tokens == {"0": 2108832, "1": 2100000}
    assert {s.value for s in samples(exposition, "cache_config_data_parallel_size")} == {2}


def test_engines_that_disagree_are_visible(client: TestClient) -> None:
    post(client, "dp2-rank0")
    odd = msgspec.msgpack.decode(fixture_bytes("dp2-rank1"))
    odd["block_size"] = 528
    assert client.post(READY, content=msgspec.msgpack.encode(odd), headers=MSGPACK).status_code == 200
    distinct = {s.labels["field"]: s.value for s in samples(scrape(client), "cache_config_distinct_values")}
    # In align mode (inferred: a reported mamba_block_size with prefix caching) mamba follows the block size.
    assert distinct == {"block_size": 2, "mamba_block_size": 2}


def test_old_payloads_name_their_engine_in_the_query(client: TestClient) -> None:
    assert post(client, "minimal-pre42206", engine=3).status_code == 200
    exposition = scrape(client)
    assert set(info_labels(exposition, "qwen")) == {"3"}
    assert {s.value for s in samples(exposition, "cache_config_block_size")} == {32}


def test_pre_mamba_payload_keeps_the_static_mamba_block_size(client: TestClient) -> None:
    put = client.put("/api/v1/deployments/qwen/cache-config", json={"mamba_block_size": 2048})
    assert put.status_code == 200
    post(client, "hybrid-tp1-pre50809")
    exposition = scrape(client)
    assert info_labels(exposition, "qwen")["0"]["mamba_block_size"] == "2048"
    assert {s.value for s in samples(exposition, "cache_config_mamba_block_size")} == {2048}


def test_restart_with_new_instance_id_drops_the_previous_runs_engines(client: TestClient) -> None:
    post(client, "dp2-rank0")
    post(client, "dp2-rank1")
    restarted = msgspec.msgpack.decode(fixture_bytes("hybrid-tp4-post50809"))
    restarted["instance_id"] = "new-run"
    assert client.post(READY, content=msgspec.msgpack.encode(restarted), headers=MSGPACK).status_code == 200
    labels = info_labels(scrape(client), "qwen")
    assert set(labels) == {"0"}
    assert (labels["0"]["block_size"], labels["0"]["num_gpu_blocks"]) == ("528", "7130")


def test_resending_a_response_does_not_double_count(client: TestClient) -> None:
    for _ in range(3):
        post(client, "dp2-rank0")
    assert client.get("/api/v1/deployments/qwen").json()["labels"]["num_gpu_blocks"] == "1997"


def test_metric_prefix_gives_vllms_names(make_client: Callable[..., TestClient]) -> None:
    client = make_client(metric_prefix="vllm:")
    post(client, "hybrid-tp1-post50809")
    exposition = scrape(client)
    assert info_labels(exposition, "qwen", "vllm:cache_config_info")["0"]["block_size"] == "1056"
    assert samples(exposition, "vllm:cache_config_block_size")
    assert not samples(exposition, "cache_config_info")


def test_cache_config_file_is_the_base_of_every_deployment(
    make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    config = tmp_path / "cache.toml"
    config.write_text('mamba_cache_mode = "align"\ngpu_memory_utilization = 0.9\n')
    client = make_client(cache_config_file=config)
    post(client, "hybrid-tp1-post50809", deployment="a")
    client.put("/api/v1/deployments/b/cache-config", json={"gpu_memory_utilization": 0.5})
    post(client, "hybrid-tp1-post50809", deployment="b")
    exposition = scrape(client)
    a, b = info_labels(exposition, "a")["0"], info_labels(exposition, "b")["0"]
    assert (a["mamba_cache_mode"], a["gpu_memory_utilization"]) == ("align", "0.9")
    assert (b["mamba_cache_mode"], b["gpu_memory_utilization"]) == ("align", "0.5")


def test_deployment_names_may_hold_a_served_model_path(client: TestClient) -> None:
    assert post(client, "hybrid-tp1-post50809", deployment="Qwen/Qwen3.6-35B-A3B").status_code == 200
    assert client.get("/api/v1/deployments/Qwen/Qwen3.6-35B-A3B").json()["deployment"] == "Qwen/Qwen3.6-35B-A3B"
    assert set(info_labels(scrape(client), "Qwen/Qwen3.6-35B-A3B")) == {"0"}


def test_delete_engine_and_deployment_remove_their_series(client: TestClient) -> None:
    post(client, "dp2-rank0")
    post(client, "dp2-rank1")
    after_delete = client.delete("/api/v1/deployments/qwen/engines/1")
    assert after_delete.status_code == 200
    assert after_delete.json()["labels"]["num_gpu_blocks"] == "1997"
    assert set(info_labels(scrape(client), "qwen")) == {"0"}
    assert client.delete("/api/v1/deployments/qwen/engines/1").status_code == 404
    assert client.delete("/api/v1/deployments/qwen").status_code == 204
    assert info_labels(scrape(client), "qwen") == {}
    assert client.get("/api/v1/deployments/qwen").status_code == 404
    assert client.get("/api/v1/deployments").json() == []


def _mutated(**changes: object) -> bytes:
    document = msgspec.msgpack.decode(fixture_bytes("hybrid-tp1-post50809"))
    document.update(changes)
    return msgspec.msgpack.encode(document)


BAD_REQUESTS = [
    # (what, method, path, body, headers, status, field)
    ("zero block size", "POST", READY, _mutated(block_size=0), MSGPACK, 422, "$.block_size"),
    ("string block size", "POST", READY, _mutated(block_size="16"), MSGPACK, 422, "$.block_size"),
    ("NaN concurrency", "POST", READY, _mutated(kv_cache_max_concurrency=float("nan")), MSGPACK, 422,
     "$.kv_cache_max_concurrency"),
    ("truncated msgpack", "POST", READY, fixture_bytes("hybrid-tp1-post50809")[:40], MSGPACK, 400, "$"),
    ("broken JSON", "POST", READY, b'{"max_model_len": 1,', {"Content-Type": "application/json"}, 400, "$"),
    # An array is several ready responses, each checked alone: the problem names the first refused one.
    ("JSON array of numbers", "POST", READY, b"[1, 2]", {"Content-Type": "application/json"}, 422, "$[0]"),
    ("empty array", "POST", READY, b"\x90", MSGPACK, 422, "$"),
    ("array with an engine query", "POST", READY + "?engine=1", b"\x91" + fixture_bytes("dp2-rank1"), MSGPACK, 422,
     "query.engine"),
    ("truncated array", "POST", READY, b"\x92" + fixture_bytes("dp2-rank1"), MSGPACK, 400, "$"),
    ("no content type", "POST", READY, fixture_bytes("hybrid-tp1-post50809"), {}, 415, "Content-Type"),
    ("text body", "POST", READY, b"hello", {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("rank outside dp size", "POST", READY, _mutated(data_parallel_rank=2, data_parallel_size=2), MSGPACK, 422,
     "$.data_parallel_rank"),
    ("engine query against rank", "POST", READY + "?engine=2", fixture_bytes("hybrid-tp1-post50809"), MSGPACK, 422,
     "$.data_parallel_rank"),
    ("negative engine query", "POST", READY + "?engine=-1", fixture_bytes("minimal-pre42967"), MSGPACK, 422,
     "query.engine"),
    ("heartbeat without interval", "POST", "/api/v1/deployments/qwen/heartbeat", b"", {}, 422, "query.interval"),
    ("heartbeat of no interval", "POST", "/api/v1/deployments/qwen/heartbeat?interval=0", b"", {}, 422,
     "query.interval"),
    ("heartbeat of a wrong replica name", "POST", "/api/v1/deployments/qwen/heartbeat?interval=30&replica=a%20b",
     b"", {}, 422, "query.replica"),
    ("quote in deployment of a heartbeat", "POST", '/api/v1/deployments/a"b/heartbeat?interval=30', b"", {}, 422,
     "deployment"),
    ("ready response missing a required field", "POST", READY, b'{"max_model_len": 8}',
     {"Content-Type": "application/json"}, 422, "$.num_gpu_blocks"),
    ("quote in deployment", "POST", '/api/v1/deployments/a"b/ready', fixture_bytes("dense-post50809"), MSGPACK, 422,
     "deployment"),
    ("brace in deployment", "POST", "/api/v1/deployments/a}b/ready", fixture_bytes("dense-post50809"), MSGPACK, 422,
     "deployment"),
    ("newline in deployment", "POST", "/api/v1/deployments/a%0Ab/ready", fixture_bytes("dense-post50809"), MSGPACK,
     422, "deployment"),
    ("label name Prometheus refuses", "PUT", "/api/v1/deployments/qwen/cache-config", b'{"blok-size": 16}',
     {"Content-Type": "application/json"}, 422, "$.blok-size"),
    ("label the exporter adds", "PUT", "/api/v1/deployments/qwen/cache-config", b'{"engine": "7"}',
     {"Content-Type": "application/json"}, 422, "$.engine"),
    ("mode vLLM does not have", "PUT", "/api/v1/deployments/qwen/cache-config", b'{"mamba_cache_mode": "fast"}',
     {"Content-Type": "application/json"}, 422, "$.mamba_cache_mode"),
    ("empty config", "PUT", "/api/v1/deployments/qwen/cache-config", b"", {"Content-Type": "application/json"}, 400,
     "$"),
    ("config of wrong type", "PUT", "/api/v1/deployments/qwen/cache-config", b'{"block_size": "big"}',
     {"Content-Type": "application/json"}, 422, "$.block_size"),
    ("config as msgpack", "PUT", "/api/v1/deployments/qwen/cache-config", b"\x80", MSGPACK, 415, "Content-Type"),
    ("non-numeric engine", "DELETE", "/api/v1/deployments/qwen/engines/x", b"", {}, 422, "path.engine"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "method", "path", "body", "headers", "status", "field"), BAD_REQUESTS,
                         ids=[case[0] for case in BAD_REQUESTS])  # fmt: skip
def test_bad_input_gets_a_problem_naming_the_field_and_changes_nothing(
    client: TestClient, what: str, method: str, path: str, body: bytes, headers: dict, status: int, field: str
) -> None:
    post(client, "dp2-rank0")
    before_state, before_series = stored_state(client), info_labels(scrape(client), "qwen")
    response = client.request(method, path, content=body, headers=headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert (problem["status"], problem["field"]) == (status, field)
    assert problem["detail"]
    assert stored_state(client) == before_state
    assert info_labels(scrape(client), "qwen") == before_series


def test_conflicting_stats_address_is_a_409_and_changes_nothing(client: TestClient) -> None:
    post(client, "dp2-rank0")
    before = stored_state(client)
    response = post(client, "dp2-rank1-conflicting-stats-address")
    assert response.status_code == 409
    assert response.json()["field"] == "$.dp_stats_address"
    assert stored_state(client) == before


def test_rejections_and_acceptances_are_counted_by_reason(client: TestClient) -> None:
    post(client, "dp2-rank0")
    post(client, "dp2-rank1-conflicting-stats-address")
    client.post(READY, content=b"\xc1", headers=MSGPACK)
    exposition = scrape(client)
    [accepted] = samples(exposition, "cache_config_exporter_ready_responses_accepted_total")
    rejected = {
        s.labels["reason"]: s.value for s in samples(exposition, "cache_config_exporter_ready_responses_rejected_total")
    }
    assert accepted.value == 1
    assert rejected["conflict"] == rejected["malformed"] == 1
    assert rejected["invalid"] == 0


def test_unknown_routes_and_deployments_are_problems_too(client: TestClient) -> None:
    heartbeat = "/api/v1/deployments/qwen/heartbeat?interval=30"
    for response in (client.get("/nope"), client.get("/api/v1/deployments/ghost"), client.put(READY),
                     client.put(heartbeat), client.post("/api/v1/deployments//heartbeat?interval=30")):  # fmt: skip
        assert response.status_code in (404, 405)
        assert response.headers["content-type"] == "application/problem+json"


def test_health_readiness_and_landing_page(client: TestClient) -> None:
    assert client.get("/-/healthy").status_code == 200
    assert client.get("/-/ready").status_code == 200
    landing = client.get("/")
    assert landing.status_code == 200
    assert 'href="/metrics"' in landing.text


def test_build_info(client: TestClient) -> None:
    [info] = samples(scrape(client), "cache_config_exporter_build_info")
    assert info.value == 1
    assert info.labels["version"]


def array(*names: str) -> bytes:
    """Several fixtures' ready responses as one msgpack array, each as its engine encoded it."""
    return msgspec.msgpack.encode([msgspec.Raw(fixture_bytes(name)) for name in names])


def test_an_array_of_a_replicas_engines_is_taken_in_one_commit(client: TestClient) -> None:
    state = client.app.state.exporter.state
    before = state.version
    response = client.post(READY, content=array("dp2-rank0", "dp2-rank1"), headers=MSGPACK, params={"replica": "r1"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["refused"] == []
    assert [engine["engine"] for engine in answer["replica"]["engines"]] == [0, 1]
    assert state.version == before + 1
    assert set(info_labels(scrape(client), "qwen")) == {"0", "1"}


def test_an_array_in_json_is_taken_too(client: TestClient) -> None:
    body = b"[" + fixture_bytes("dp2-rank0", "json") + b", " + fixture_bytes("dp2-rank1", "json") + b"]"
    response = client.post(READY, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert [engine["wire_format"] for engine in response.json()["replica"]["engines"]] == ["json", "json"]


def test_a_refused_response_of_an_array_is_named_and_the_others_are_taken(client: TestClient) -> None:
    body = array("dp2-rank0", "dp2-rank1-conflicting-stats-address")
    response = client.post(READY, content=body, headers=MSGPACK)
    assert response.status_code == 200, response.text
    answer = response.json()
    [refused] = answer["refused"]
    assert (refused["index"], refused["status"], refused["field"]) == (1, 409, "$[1].dp_stats_address")
    assert refused["type"] == "urn:cache-config-exporter:problem:conflict"
    assert [engine["engine"] for engine in answer["replica"]["engines"]] == [0]
    exposition = scrape(client)
    assert set(info_labels(exposition, "qwen")) == {"0"}
    [accepted] = samples(exposition, "cache_config_exporter_ready_responses_accepted_total")
    rejected = {
        s.labels["reason"]: s.value for s in samples(exposition, "cache_config_exporter_ready_responses_rejected_total")
    }
    assert (accepted.value, rejected["conflict"]) == (1, 1)


def test_an_array_none_of_which_is_taken_is_a_problem_naming_each(client: TestClient) -> None:
    post(client, "dp2-rank0")
    before = stored_state(client)
    body = msgspec.msgpack.encode(
        [msgspec.Raw(_mutated(block_size=0)), msgspec.Raw(fixture_bytes("dp2-rank1-conflicting-stats-address"))]
    )
    response = client.post(READY, content=body, headers=MSGPACK)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["field"] == "$[0].block_size"
    assert [(item["index"], item["status"], item["field"]) for item in problem["refused"]] == [
        (0, 422, "$[0].block_size"),
        (1, 409, "$[1].dp_stats_address"),
    ]
    assert stored_state(client) == before
