"""Reading what ``/metrics`` serves, with prometheus_client's own parsers (text and OpenMetrics): a real
parser fails the test on anything Prometheus could not read."""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from prometheus_client.samples import Sample

from tests.helpers.http import request

OPENMETRICS = "application/openmetrics-text; version=1.0.0"

# Per engine, where a value came from (a ``source`` label).
_SOURCE_FAMILIES = (
    "mamba_block_size_source_info",
    "hash_block_size_source_info",
    "cache_hit_alignment_tokens_source_info",
)
_ENGINE_FAMILIES = (
    "block_size",
    "mamba_block_size",
    "vllm_mamba_block_size",
    "num_gpu_blocks",
    "max_model_len",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    *_SOURCE_FAMILIES,
    "last_update_timestamp_seconds",
)
# Per KV-cache group of an engine; the info family also describes the group.
_GROUP_FAMILIES = (
    "kv_cache_group_info",
    "kv_cache_group_block_size",
    "kv_cache_group_layers",
    "kv_cache_group_blocks_per_request",
)
_GROUP_DESCRIPTION = ("spec", "block_size", "page_size_bytes", "sliding_window", "attention_chunk_size", "draft")
_REPLICA_FAMILIES = (
    "distinct_values",
    "data_parallel_size",
    "last_seen_timestamp_seconds",
    "heartbeat_interval_seconds",
)


def families(exposition: str, openmetrics: bool = False) -> list[Metric]:
    """Every metric family of an exposition, parsed as Prometheus text or (``openmetrics``) OpenMetrics."""
    return list((openmetrics_families if openmetrics else text_families)(exposition))


def samples(exposition: str, name: str) -> list[Sample]:
    """Every sample named ``name`` (e.g. ``..._total`` for a counter) in a Prometheus text exposition."""
    return [sample for family in families(exposition) for sample in family.samples if sample.name == name]


def sample_names(exposition: str) -> set[str]:
    """Every sample name of a text exposition (``_total`` and ``_created`` of counters included)."""
    return {sample.name for family in families(exposition) for sample in family.samples}


def single_value(exposition: str, name: str) -> float:
    """The value of the one sample named ``name`` (an unlabelled one, e.g. ``..._storage_healthy``)."""
    values = [sample.value for sample in samples(exposition, name)]
    assert len(values) == 1, (name, values)
    return values[0]


def info_labels(exposition: str, deployment: str, name: str = "cache_config_info") -> dict[str, dict[str, str]]:
    """``cache_config_info`` label sets of one deployment, by engine."""
    return {
        sample.labels["engine"]: sample.labels
        for sample in samples(exposition, name)
        if sample.labels["deployment"] == deployment
    }


def cache_config_samples(exposition: str, openmetrics: bool = False) -> list[tuple[str, tuple, float]]:
    """Every ``cache_config_*`` sample (not the exporter's own) as (name, sorted labels, value), sorted.

    Fails when a sample carries labels its family never has: no input may forge a series (the info
    family's other labels are the deployment's label map, which the API shows).
    """
    found = []
    for family in families(exposition, openmetrics):
        for sample in family.samples:
            if not sample.name.startswith("cache_config_") or sample.name.startswith("cache_config_exporter_"):
                continue
            suffix = sample.name.removeprefix("cache_config_")
            expected = {
                "distinct_values": {"deployment", "replica", "field"},
                "data_parallel_size": {"deployment", "replica"},
                "last_seen_timestamp_seconds": {"deployment", "replica"},
                "heartbeat_interval_seconds": {"deployment", "replica"},
                **{family: {"deployment", "replica", "engine", "source"} for family in _SOURCE_FAMILIES},
                "kv_cache_group_info": {"deployment", "replica", "engine", "group", "kind", *_GROUP_DESCRIPTION},
            }.get(suffix, {"deployment", "replica", "engine", "group", "kind"} if suffix in _GROUP_FAMILIES
                  else {"deployment", "replica", "engine"})  # fmt: skip
            assert suffix in ("info", *_REPLICA_FAMILIES, *_ENGINE_FAMILIES, *_GROUP_FAMILIES), sample
            assert set(sample.labels) >= expected if suffix == "info" else set(sample.labels) == expected, sample
            found.append((sample.name, tuple(sorted(sample.labels.items())), sample.value))
    return sorted(found)


def scrape(url: str) -> str:
    """``GET /metrics`` of a running exporter (it must answer 200): the text exposition."""
    reply = request(url, "GET", "/metrics")
    assert reply.status == 200, reply.body[:300]
    return reply.text
