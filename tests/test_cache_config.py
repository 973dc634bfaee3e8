"""vLLM's CacheConfig fields, defaults and label rendering."""

from __future__ import annotations

import msgspec
import pytest

from protocol import (
    CacheConfig,
    InvalidPayload,
    apply_update,
    decode_cache_config_update,
    decode_ready_response,
    render_labels,
    sync,
)
from protocol.cache_config import LABEL_NAMES
from tests.support import FIXTURES, fixture_bytes, samples


def vllm_sample() -> dict[str, str]:
    """The label set vLLM itself published for a hybrid model with two data-parallel engines."""
    [sample] = samples((FIXTURES.parent / "vllm-cache-config-info.prom").read_text(), "vllm:cache_config_info")
    return sample.labels


def test_label_names_are_exactly_vllms() -> None:
    assert set(LABEL_NAMES) == set(vllm_sample()) - {"engine"}


def test_rendering_matches_vllm_for_a_synced_hybrid_deployment() -> None:
    sample = vllm_sample()
    base = apply_update(CacheConfig(), decode_cache_config_update(b'{"mamba_cache_mode": "align"}'))
    engines = {}
    for rank in (0, 1):
        response = decode_ready_response(fixture_bytes(f"dp2-rank{rank}"))
        # vLLM's sample was taken on a smaller card: the same model with 1,000,000 tokens at 3.81x.
        engines[rank] = msgspec.structs.replace(response, kv_cache_size_tokens=1_000_000, kv_cache_max_concurrency=3.81)
    labels = render_labels(sync(base, engines).config)
    assert labels == {name: value for name, value in sample.items() if name != "engine"}


def test_defaults_render_like_python_str() -> None:
    labels = render_labels(CacheConfig())
    assert labels["block_size"] == "16"
    assert labels["gpu_memory_utilization"] == "0.92"
    assert labels["enable_prefix_caching"] == "True"
    assert labels["kv_cache_dtype_skip_layers"] == "[]"
    assert labels["mamba_block_size"] == "None"
    assert labels["prefix_cache_retention_interval"] == "0"
    assert labels["_block_size_resolved"] == "False"


def test_lists_render_as_python_lists() -> None:
    config = apply_update(CacheConfig(), decode_cache_config_update(b'{"kv_cache_dtype_skip_layers": ["sliding"]}'))
    assert render_labels(config)["kv_cache_dtype_skip_layers"] == "['sliding']"


@pytest.mark.parametrize("document_format", ["json", "toml", "yaml"])
def test_partial_documents_in_every_format_override_only_what_they_set(document_format: str) -> None:
    document = {
        "json": b'{"mamba_cache_mode": "align", "gpu_memory_utilization": 0.9}',
        "toml": b'mamba_cache_mode = "align"\ngpu_memory_utilization = 0.9\n',
        "yaml": b"mamba_cache_mode: align\ngpu_memory_utilization: 0.9\n",
    }[document_format]
    config = apply_update(CacheConfig(), decode_cache_config_update(document, document_format))
    assert (config.mamba_cache_mode, config.gpu_memory_utilization) == ("align", 0.9)
    assert config.block_size == 16


@pytest.mark.parametrize(
    ("document", "field"),
    [
        (b'{"blok_size": 16}', "$.blok_size"),
        (b'{"block_size": 0}', "$.block_size"),
        (b'{"gpu_memory_utilization": 1.5}', "$.gpu_memory_utilization"),
        (b'{"enable_prefix_caching": "yes"}', "$.enable_prefix_caching"),
        (b'{"kv_cache_dtype_skip_layers": "all"}', "$.kv_cache_dtype_skip_layers"),
    ],
)
def test_bad_documents_name_the_field(document: bytes, field: str) -> None:
    with pytest.raises(InvalidPayload) as refused:
        decode_cache_config_update(document)
    assert refused.value.field == field
