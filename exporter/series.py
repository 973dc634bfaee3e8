"""Which series a replica has: the cache-config metric families and their samples, as data.

``cache_config_info`` carries the labels of the sending vLLM release with the
block sizes the engines really run with; its numeric companions carry each
engine's figures as the sync worked them out (``protocol/sync.py``): nothing
here decides a value. Every scrape reflects the current state: a changed label
set or a dropped engine leaves no stale series behind.

``exporter/exposition.py`` renders these samples in each format, and caches
them per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.replicas import Replica

Labels = tuple[tuple[str, str], ...]
Sample = tuple[Labels, float]


@dataclass(frozen=True)
class Family:
    suffix: str
    help: str


INFO = Family(
    "info",
    "Information of the LLMEngine CacheConfig: the labels of the sending vLLM release, synced from the engines' "
    "ready responses, with the block sizes the engines really run with.",
)
# Per-engine figures, each named after the ``EngineFigures`` field it reports.
ENGINE_GAUGES = (
    Family("block_size", "KV-cache block size in tokens this engine runs with."),
    Family("mamba_block_size", "Mamba block size in tokens this engine runs with (absent without Mamba layers)."),
    Family(
        "vllm_mamba_block_size",
        "mamba_block_size as vLLM's own cache_config_info shows it for this engine (the engine core's report from "
        "0.29, the configured value before); where it differs from cache_config_mamba_block_size, vLLM's is wrong.",
    ),
    Family("num_gpu_blocks", "GPU KV-cache blocks of this engine alone (the info metric shows the replica's total)."),
    Family("max_model_len", "Longest sequence this engine accepts, in tokens."),
    Family("kv_cache_size_tokens", "KV-cache capacity of this engine in tokens."),
    Family("kv_cache_max_concurrency", "Requests of max_model_len this engine's KV cache can hold at once."),
)
UPDATED = Family(
    "last_update_timestamp_seconds", "When this engine's last ready response was accepted, in Unix seconds."
)
DISTINCT = Family(
    "distinct_values",
    "Distinct values the engines of a replica report for a field; above 1 they disagree and the lowest "
    "engine index wins.",
)
PARALLEL = Family("data_parallel_size", "Data-parallel size the engines of a replica report (the largest).")
SEEN = Family("last_seen_timestamp_seconds", "When the replica's sender was last heard from, in Unix seconds.")
HEARTBEAT = Family(
    "heartbeat_interval_seconds",
    "Seconds between the heartbeats the replica's sender promised; it expires after missing several of them. "
    "Absent for one-off pushes, which never expire.",
)
FAMILIES = (INFO, *ENGINE_GAUGES, UPDATED, DISTINCT, PARALLEL, SEEN, HEARTBEAT)


def replica_samples(replica: Replica) -> tuple[list[Sample], ...]:
    """One replica's samples, a list per family of ``FAMILIES`` (in that order)."""
    samples: dict[Family, list[Sample]] = {family: [] for family in FAMILIES}
    identity: Labels = (("deployment", replica.deployment), ("replica", replica.name))
    samples[SEEN].append((identity, replica.last_seen))
    if replica.heartbeat_seconds is not None:
        samples[HEARTBEAT].append((identity, replica.heartbeat_seconds))
    if replica.engines:
        synced = replica.synced
        info = tuple(synced.labels.items())
        for engine in sorted(replica.engines):
            engine_identity = (*identity, ("engine", str(engine)))
            samples[INFO].append(((*engine_identity, *info), 1.0))
            figures = synced.engines[engine]
            for family in ENGINE_GAUGES:
                value = getattr(figures, family.suffix)
                if value is not None:
                    samples[family].append((engine_identity, value))
            samples[UPDATED].append((engine_identity, replica.engines[engine].received_at))
        for field, count in synced.distinct_values.items():
            samples[DISTINCT].append(((*identity, ("field", field)), count))
        if synced.data_parallel_size is not None:
            samples[PARALLEL].append((identity, synced.data_parallel_size))
    return tuple(samples[family] for family in FAMILIES)
