"""Collects each replica's state into exposition lines: ``cache_config_info`` and its numeric companions.

A replica is rendered once per change (replicas are immutable, so the
rendered lines are cached by identity) and a scrape only joins the cached
lines. Every scrape still reflects the current state: a changed label set or a
dropped engine leaves no stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from exporter.state import Replica, ReplicaKey


@dataclass(frozen=True)
class Family:
    suffix: str
    help: str


INFO = Family(
    "info",
    "Information of the LLMEngine CacheConfig: the labels of the sending vLLM release, synced from the engines' "
    "ready responses, with the block sizes the engines really run with.",
)
# Per-engine figures, each named after the ready-response field it reports.
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


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    """Formatted as prometheus_client formats it (``1056.0``, ``2.108832e+06``), so output matches vLLM's."""
    return floatToGoString(float(value))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{name}="{escape_label_value(value)}"' for name, value in pairs)


def render_replica(replica: Replica, prefix: str) -> tuple[bytes, ...]:
    """The lines of one replica, one bytes string per family of ``FAMILIES`` (in that order)."""
    lines: dict[Family, list[str]] = {family: [] for family in FAMILIES}
    name = f"{prefix}cache_config_"
    replica_labels = (
        f'deployment="{escape_label_value(replica.deployment)}",replica="{escape_label_value(replica.name)}"'
    )
    lines[SEEN].append(f"{name}{SEEN.suffix}{{{replica_labels}}} {format_value(replica.last_seen)}\n")
    if replica.heartbeat_seconds is not None:
        lines[HEARTBEAT].append(
            f"{name}{HEARTBEAT.suffix}{{{replica_labels}}} {format_value(replica.heartbeat_seconds)}\n"
        )
    if replica.engines:
        info_labels = _labels(replica.synced.labels.items())
        for engine in sorted(replica.engines):
            key = f'{replica_labels},engine="{engine}"'
            lines[INFO].append(f"{name}info{{{key},{info_labels}}} 1.0\n")
            figures = replica.synced.engines[engine]
            for family in ENGINE_GAUGES:
                value = getattr(figures, family.suffix)
                if value is not None:
                    lines[family].append(f"{name}{family.suffix}{{{key}}} {format_value(value)}\n")
            received = replica.engines[engine].received_at
            lines[UPDATED].append(f"{name}{UPDATED.suffix}{{{key}}} {format_value(received)}\n")
        for field, count in replica.synced.distinct_values.items():
            lines[DISTINCT].append(
                f'{name}{DISTINCT.suffix}{{{replica_labels},field="{field}"}} {format_value(count)}\n'
            )
        parallel = replica.synced.data_parallel_size
        if parallel is not None:
            lines[PARALLEL].append(f"{name}{PARALLEL.suffix}{{{replica_labels}}} {format_value(parallel)}\n")
    return tuple("".join(lines[family]).encode() for family in FAMILIES)


class CacheConfigCollector:
    """Renders the cache-config families of every replica, re-rendering only replicas that changed."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix
        self._headers = tuple(
            f"# HELP {prefix}cache_config_{family.suffix} {family.help}\n"
            f"# TYPE {prefix}cache_config_{family.suffix} gauge\n".encode()
            for family in FAMILIES
        )
        self._rendered: dict[ReplicaKey, tuple[Replica, tuple[bytes, ...]]] = {}

    def lines(self, replica: Replica) -> tuple[bytes, ...]:
        """One replica's lines, rendered once per change of it: the byte budget measures what scrapes then join.

        Called from the writer thread (the budget) and from the scrape's thread; a render lost to a race is
        only done again.
        """
        cached = self._rendered.get(replica.key)
        if cached is not None and cached[0] is replica:
            return cached[1]
        lines = render_replica(replica, self._prefix)
        self._rendered[replica.key] = (replica, lines)
        return lines

    def collect(self, replicas: Mapping[ReplicaKey, Replica]) -> bytes:
        """The exposition of all ``replicas``; only called from one thread at a time."""
        parts = [self.lines(replicas[key]) for key in sorted(replicas)]
        # Forget replicas that are gone.
        for key in [key for key in list(self._rendered) if key not in replicas]:
            self._rendered.pop(key, None)
        return b"".join(
            self._headers[index] + b"".join(part[index] for part in parts) for index in range(len(FAMILIES))
        )
