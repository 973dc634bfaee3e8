"""The engine core's KV-cache groups: read by the plugin in the engine core, carried in the ready response, shown.

The engine-core side runs against the stand-in ``vllm.v1.engine.core`` (vLLM
0.32.0's ``EngineCoreProc._make_ready_response``) with spec classes named as
vLLM's; ``tests/real_vllm/test_real_vllm.py`` proves the same path in a real ``vllm serve``.
The exporter side drives the real ASGI app: the group series, the true
``mamba_block_size`` taken from the Mamba group where the rule would be wrong,
and a group that does not fit the schema refused with the field named.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from exporter.vllm_plugin import engine_groups as vllm_engine_groups
from protocol import KV_CACHE_GROUPS_KEY, KVCacheGroup, KVCacheGroups, decode_ready_response, spec_kind
from protocol.releases import releases
from tests.helpers.exposition import info_labels, samples
from tests.helpers.http import MSGPACK
from tests.helpers.release_payloads import ready_payload

STANDIN = Path(__file__).resolve().parents[1] / "vllm_standin"
NEWEST = releases()[-1]


# Spec classes named as vLLM's (vllm/v1/kv_cache_interface.py), with the attributes the plugin reads.
@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    page_size_bytes: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return vllm_config.model_config.max_model_len // self.block_size * self.page_size_bytes


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    pass


@dataclasses.dataclass(frozen=True)
class MambaSpec:
    block_size: int
    page_size_bytes: int

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.page_size_bytes


@dataclasses.dataclass(frozen=True)
class UniformTypeKVCacheSpecs:
    block_size: int
    kv_cache_specs: dict[str, Any]

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any
    is_eagle_group: bool = False


def kv_cache_config(*groups: KVCacheGroupSpec, num_blocks: int = 1000, **resolved: int) -> SimpleNamespace:
    """vLLM's ``KVCacheConfig``; 0.32+ resolves ``hash_block_size`` and ``cache_hit_alignment_tokens`` on it."""
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=list(groups), **resolved)


VLLM_CONFIG = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1280))
# A Qwen3-Next engine: three linear-attention (Mamba-like) layers, one full-attention layer, a drafter's layer.
HYBRID_GROUPS = kv_cache_config(
    KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in range(3)], MambaSpec(640, 65536)),
    KVCacheGroupSpec(["model.layers.3.self_attn.attn"], FullAttentionSpec(640, 65536)),
    KVCacheGroupSpec(["draft.layers.0.self_attn.attn"], FullAttentionSpec(16, 2048), is_eagle_group=True),
    hash_block_size=16,
    cache_hit_alignment_tokens=640,
)


def test_spec_classes_become_kinds_and_unknown_ones_keep_their_name() -> None:
    assert [spec_kind(name) for name in ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowMLASpec",
            "MambaSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "TreeStateCache")] == [
        "full_attention", "mla_attention", "sliding_window_mla", "mamba", "chunked_local_attention",
        "cross_attention", "tree_state_cache"]  # fmt: skip


def test_the_groups_are_read_as_the_engine_core_holds_them() -> None:
    uniform = UniformTypeKVCacheSpecs(32, {"a": SlidingWindowSpec(32, 512, 128), "b": SlidingWindowSpec(32, 512, 64)})
    groups = vllm_engine_groups.groups_of(
        kv_cache_config(*HYBRID_GROUPS.kv_cache_groups, KVCacheGroupSpec(["x", "y"], uniform), hash_block_size=16,
                        cache_hit_alignment_tokens=640), VLLM_CONFIG,
    )  # fmt: skip
    assert (groups.num_blocks, groups.hash_block_size, groups.cache_hit_alignment_tokens) == (1000, 16, 640)
    mamba, attention, draft, windows = groups.groups
    assert (mamba.kind, mamba.block_size, len(mamba.layers), mamba.blocks_per_request) == ("mamba", 640, 3, 1)
    # max_model_len 1280 in 640-token blocks: two blocks a request.
    assert (attention.kind, attention.page_size_bytes, attention.blocks_per_request) == ("full_attention", 65536, 2)
    assert (draft.draft, draft.block_size, draft.blocks_per_request) == (True, 16, 80)
    # A wrapper of one spec class is that class; a figure the spec cannot give is left out.
    assert (windows.spec, windows.sliding_window, windows.page_size_bytes, windows.blocks_per_request) == (
        "SlidingWindowSpec", None, 0, None)  # fmt: skip


def test_a_vllm_that_resolves_neither_leaves_them_untold() -> None:
    """Before 0.32 a ``KVCacheConfig`` has no ``hash_block_size`` or ``cache_hit_alignment_tokens``."""
    groups = vllm_engine_groups.groups_of(kv_cache_config(*HYBRID_GROUPS.kv_cache_groups), VLLM_CONFIG)
    assert (groups.hash_block_size, groups.cache_hit_alignment_tokens) == (None, None)


@pytest.fixture
def engine_core(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in ``vllm.v1.engine.core``, its ``_make_ready_response`` restored after the test."""
    monkeypatch.syspath_prepend(str(STANDIN))
    forgotten = {name: module for name, module in sys.modules.items() if name == "vllm" or name.startswith("vllm.")}
    for name in forgotten:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module(vllm_engine_groups.ENGINE_CORE)
    monkeypatch.setattr(module.EngineCoreProc, "_make_ready_response", module.EngineCoreProc._make_ready_response)
    yield module
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]
    sys.modules.update(forgotten)


def engine_core_proc(module: ModuleType, kv_cache_config: Any) -> Any:
    """An ``EngineCoreProc`` with what its ``__init__`` sets before the engine core answers its frontends."""
    proc = module.EngineCoreProc.__new__(module.EngineCoreProc)
    proc.vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=1280, dtype="torch.bfloat16", enable_sleep_mode=False),
        cache_config=SimpleNamespace(num_gpu_blocks=1000, block_size=640, mamba_block_size=16,
                                     effective_attention_block_size=640, kv_cache_size_tokens=640000,
                                     kv_cache_max_concurrency=333.33),
        parallel_config=SimpleNamespace(world_size=1, data_parallel_size=1, tensor_parallel_size=1,
                                        pipeline_parallel_size=1, decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048),
        instance_id="run-1", lora_config=None, weight_transfer_config=None,
    )  # fmt: skip
    proc.scheduler = SimpleNamespace(kv_cache_config=kv_cache_config, get_kv_event_publisher_config=lambda: None)
    proc.model_executor = None
    proc.frontend_stats_publish_address = None
    proc.engine_index = 1
    return proc


def test_the_ready_response_carries_the_groups_and_vllm_frontend_reads_it_as_before(
    engine_core: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    plain = msgspec.msgpack.encode(engine_core_proc(engine_core, HYBRID_GROUPS)._make_ready_response())
    vllm_engine_groups.install()
    vllm_engine_groups.install()  # once only, however often vLLM loads the plugin
    method = engine_core.EngineCoreProc._make_ready_response
    assert getattr(method.__wrapped__, vllm_engine_groups.PATCHED_ATTRIBUTE, False) is False
    with caplog.at_level(logging.INFO, "vllm.cache_config_exporter"):
        payload = msgspec.msgpack.encode(engine_core_proc(engine_core, HYBRID_GROUPS)._make_ready_response())
    # The engine core's log says what it sent, for an operator to hold against the exporter's series.
    assert caplog.messages == [
        "cache-config-exporter: the engine core's KV-cache config: 1000 blocks, group block sizes (640, 640, 16), "
        "hash_block_size 16, cache_hit_alignment_tokens 640"
    ]

    response_class = importlib.import_module("vllm.v1.engine").EngineCoreReadyResponse
    # vLLM's frontend decodes it into its own dataclass: every field as without the plugin.
    assert msgspec.msgpack.decode(payload, type=response_class) == msgspec.msgpack.decode(plain, type=response_class)
    as_sent = msgspec.msgpack.decode(payload)
    assert list(as_sent)[:-1] == list(msgspec.msgpack.decode(plain)) and list(as_sent)[-1] == KV_CACHE_GROUPS_KEY
    decoded = decode_ready_response(payload)
    assert decoded.kv_cache_groups == vllm_engine_groups.groups_of(HYBRID_GROUPS, VLLM_CONFIG)
    assert decoded.data_parallel_rank == 1


def test_an_engine_core_without_readable_groups_sends_vllm_response_unchanged(
    engine_core: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    plain = msgspec.msgpack.encode(engine_core_proc(engine_core, None)._make_ready_response())
    vllm_engine_groups.install()
    with caplog.at_level(logging.WARNING, "vllm.cache_config_exporter"):
        payload = msgspec.msgpack.encode(engine_core_proc(engine_core, None)._make_ready_response())
    assert payload == plain
    assert "cannot read the engine core's KV-cache groups" in caplog.text


def groups(*specs: tuple[str, int], draft_block: int | None = None) -> dict[str, Any]:
    """A groups report as the plugin encodes it."""
    made = [KVCacheGroup(spec=spec, block_size=size, page_size_bytes=4096, layers=[f"l{i}"], blocks_per_request=2)
            for i, (spec, size) in enumerate(specs)]  # fmt: skip
    if draft_block is not None:
        made.append(KVCacheGroup(spec="FullAttentionSpec", block_size=draft_block, page_size_bytes=64,
                                 layers=["draft.0"], draft=True))  # fmt: skip
    return msgspec.to_builtins(
        KVCacheGroups(num_blocks=1997, groups=made, hash_block_size=640, cache_hit_alignment_tokens=1280)
    )


def post(client: TestClient, report: dict[str, Any] | None = None, **changes: Any) -> Any:
    """A 0.34 engine's ready response, with ``report`` added as the plugin adds the engine core's groups."""
    sent = msgspec.msgpack.decode(ready_payload(NEWEST, **changes))
    if report is not None:
        sent[KV_CACHE_GROUPS_KEY] = report
    return client.post("/api/v1/deployments/qwen/ready", content=msgspec.msgpack.encode(sent), headers=MSGPACK)


def engine_values(exposition: str, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(sample.labels[key] for key in ("engine", "group", "kind") if key in sample.labels): sample.value
            for sample in samples(exposition, name)}  # fmt: skip


def test_each_group_shows_and_the_mamba_group_gives_the_true_mamba_block_size(client: TestClient) -> None:
    """A drafter's 16-token attention group makes vLLM report block_size 16: the rule would say Mamba 16 too."""
    report = groups(("MambaSpec", 640), ("FullAttentionSpec", 640), draft_block=16)
    assert post(client, block_size=16, report=report).status_code == 200
    exposition = client.get("/metrics").text
    assert info_labels(exposition, "qwen")["0"]["mamba_block_size"] == "640"
    assert engine_values(exposition, "cache_config_mamba_block_size") == {("0",): 640}
    assert engine_values(exposition, "cache_config_vllm_mamba_block_size") == {("0",): 16}
    assert engine_values(exposition, "cache_config_hash_block_size") == {("0",): 640}
    assert engine_values(exposition, "cache_config_cache_hit_alignment_tokens") == {("0",): 1280}
    (source,) = samples(exposition, "cache_config_mamba_block_size_source_info")
    assert source.labels["source"] == "kv_cache_groups"
    assert engine_values(exposition, "cache_config_kv_cache_group_block_size") == {
        ("0", "0", "mamba"): 640, ("0", "1", "full_attention"): 640, ("0", "2", "full_attention"): 16}  # fmt: skip
    assert engine_values(exposition, "cache_config_kv_cache_group_layers") == {
        ("0", "0", "mamba"): 1, ("0", "1", "full_attention"): 1, ("0", "2", "full_attention"): 1}  # fmt: skip
    assert engine_values(exposition, "cache_config_kv_cache_group_blocks_per_request") == {
        ("0", "0", "mamba"): 2, ("0", "1", "full_attention"): 2}  # fmt: skip
    draft = [s.labels for s in samples(exposition, "cache_config_kv_cache_group_info") if s.labels["group"] == "2"]
    assert draft == [{"deployment": "qwen", "replica": "default", "engine": "0", "group": "2",
                      "kind": "full_attention", "spec": "FullAttentionSpec", "block_size": "16",
                      "page_size_bytes": "64", "sliding_window": "None", "attention_chunk_size": "None",
                      "draft": "True"}]  # fmt: skip
    figures = client.get("/api/v1/deployments/qwen").json()["engines"][0]["figures"]
    assert figures["mamba_block_size_source"] == "kv_cache_groups"
    assert [group["block_size"] for group in figures["kv_cache_groups"]["groups"]] == [640, 640, 16]
    assert '<td class="name">mamba 640, full_attention 640, full_attention 16 (draft)</td>' in client.get("/").text


def test_without_prefix_caching_the_mamba_group_is_the_smallest_and_still_true(client: TestClient) -> None:
    """Mode ``none``: the rule shows the configured 16; the engine's Mamba group runs 128-token blocks."""
    labels = {"mamba_cache_mode": "none", "enable_prefix_caching": "False"}
    assert client.put("/api/v1/deployments/qwen/cache-config", json=labels).status_code == 200
    assert post(client, block_size=128).status_code == 200
    assert engine_values(client.get("/metrics").text, "cache_config_mamba_block_size") == {("0",): 16}
    report = groups(("FullAttentionSpec", 640), ("MambaSpec", 128))
    assert post(client, block_size=128, report=report).status_code == 200
    exposition = client.get("/metrics").text
    assert engine_values(exposition, "cache_config_mamba_block_size") == {("0",): 128}
    assert info_labels(exposition, "qwen")["0"]["block_size"] == "128"


def test_a_push_without_groups_says_the_rule_gave_the_value(client: TestClient) -> None:
    assert post(client).status_code == 200
    (source,) = samples(client.get("/metrics").text, "cache_config_mamba_block_size_source_info")
    assert source.labels["source"] == "sync_rule"
    assert samples(client.get("/metrics").text, "cache_config_kv_cache_group_info") == []


def test_groups_without_a_mamba_group_mean_no_mamba_block_size(client: TestClient) -> None:
    report = groups(("FullAttentionSpec", 16))
    assert post(client, block_size=16, mamba_block_size=None, report=report).status_code == 200
    exposition = client.get("/metrics").text
    assert engine_values(exposition, "cache_config_mamba_block_size") == {}
    assert samples(exposition, "cache_config_mamba_block_size_source_info") == []
    assert info_labels(exposition, "qwen")["0"]["mamba_block_size"] == "None"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda report: report["groups"][0].update(block_size=0), "groups[0].block_size"),
        (lambda report: report["groups"][1].update(layers="not a list"), "groups[1].layers"),
        (lambda report: report.update(groups=[report["groups"][0]] * 257), "groups"),
    ],
)
def test_a_group_report_that_does_not_fit_is_refused_naming_the_field(
    client: TestClient, mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    assert post(client).status_code == 200
    before = client.get("/api/v1/deployments").content
    report = groups(("MambaSpec", 640), ("FullAttentionSpec", 640))
    mutate(report)
    refused = post(client, report)
    assert refused.status_code == 422
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["field"] == f"$.{KV_CACHE_GROUPS_KEY}.{field}"
    assert client.get("/api/v1/deployments").content == before


def test_the_groups_survive_a_restart_of_the_exporter(make_client: Callable[..., TestClient]) -> None:
    report = groups(("MambaSpec", 640), ("FullAttentionSpec", 640))
    assert post(make_client(), block_size=16, report=report).status_code == 200
    exposition = make_client().get("/metrics").text
    assert engine_values(exposition, "cache_config_mamba_block_size") == {("0",): 640}
    assert len(samples(exposition, "cache_config_kv_cache_group_info")) == 2
