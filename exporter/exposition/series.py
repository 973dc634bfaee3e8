"""Which series a replica has: the cache-config metric families and their samples, as data.

``cache_config_info`` carries the labels of the sending vLLM release with the
block sizes the engines really run with; its numeric companions carry each
engine's figures as the sync worked them out (``protocol/sync.py``): nothing
here decides a value. Every scrape reflects the current state: a changed label
set or a dropped engine leaves no stale series behind.

``exporter/exposition/rendering.py`` renders these samples in each format, and caches
them per replica.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from exporter.state.replicas import Replica
from protocol import EngineFigures, KVCacheGroups, releases

Labels = tuple[tuple[str, str], ...]
Sample = tuple[Labels, float]


# Compared and hashed by identity (each family is one constant): a family keys the dict of every replica's samples,
# built on each render and each count of the byte budget, and a generated hash of its fields costs a Python call.
@dataclass(frozen=True, eq=False)
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
    Family(
        "hash_block_size",
        "Tokens per prefix-cache block hash as this engine core resolved it (absent where nothing told it: see "
        "cache_config_hash_block_size_source_info).",
    ),
    Family(
        "cache_hit_alignment_tokens",
        "Tokens at which this engine core's prefix-cache hits land, as it resolved them: a shorter prompt never "
        "hits (absent where nothing told it: see cache_config_cache_hit_alignment_tokens_source_info).",
    ),
)
UPDATED = Family(
    "last_update_timestamp_seconds", "When this engine's last ready response was accepted, in Unix seconds."
)
DISTINCT = Family(
    "distinct_values",
    "Distinct values the engines of a replica report for a field; above 1 they disagree and the lowest "
    "engine index wins.",
)
SOURCE = Family(
    "mamba_block_size_source_info",
    "Where an engine's true mamba_block_size came from: kv_cache_groups (the engine core's own KV-cache groups, "
    "reported by the plugin) or sync_rule (a rule over the ready response, for pushes without groups).",
)
# Where each engine-resolved value came from, named like SOURCE after the ``EngineFigures`` field it reports;
# ``unknown`` where nothing told it (vLLM's frontend never learns these values).
RESOLVED_SOURCES = (
    Family(
        "hash_block_size_source_info",
        "Where an engine's hash_block_size came from: kv_cache_groups (the engine core's own KV-cache config, "
        "reported by the plugin), prefix_hash_config (the engine's ready response, vLLM 0.34+) or unknown (the "
        "cache_config_info label then keeps vLLM's own value, None from vLLM's frontend).",
    ),
    Family(
        "cache_hit_alignment_tokens_source_info",
        "Where an engine's cache_hit_alignment_tokens came from: kv_cache_groups (the engine core's own KV-cache "
        "config, reported by the plugin) or unknown (the cache_config_info label then keeps vLLM's own value, None "
        "from vLLM's frontend).",
    ),
)
GROUP_INFO = Family(
    "kv_cache_group_info",
    "One KV-cache group of an engine core (layers sharing one block table), as the engine core holds it: kind, "
    "spec class, block size in tokens, page size in bytes, sliding window or attention chunk, drafter's layers.",
)
# Per-group figures, labelled deployment, replica, engine, group and kind.
GROUP_GAUGES = (
    (Family("kv_cache_group_block_size", "Block size in tokens this KV-cache group of the engine runs with."),
     lambda group: group.block_size),
    (Family("kv_cache_group_layers", "Model layers in this KV-cache group."), lambda group: len(group.layers)),
    (Family(
        "kv_cache_group_blocks_per_request",
        "Blocks one request of max_model_len takes from the engine's shared pool in this group, as the engine "
        "computed it; cache_config_num_gpu_blocks over their sum is the engine's concurrency.",
    ), lambda group: group.blocks_per_request),
)  # fmt: skip
PARALLEL = Family(
    "data_parallel_size",
    "Data-parallel size of a replica: the largest its engines report, and at least its highest engine index + 1 "
    "(vLLM runs a dense model's ranks as independent engines that report 1).",
)
SEEN = Family("last_seen_timestamp_seconds", "When the replica's sender was last heard from, in Unix seconds.")
HEARTBEAT = Family(
    "heartbeat_interval_seconds",
    "Seconds between the heartbeats the replica's sender promised; it expires after missing several of them. "
    "Absent for one-off pushes, which never expire.",
)
# What every heartbeat changes: the last family, so the others' lines can be kept across heartbeats. The interval
# comes with each heartbeat too but is the same each time: it sits with the config families, rendered when it changes.
LIVENESS = (SEEN,)
FAMILIES = (
    INFO, *ENGINE_GAUGES, SOURCE, *RESOLVED_SOURCES, GROUP_INFO, *(family for family, _ in GROUP_GAUGES), UPDATED,
    DISTINCT, PARALLEL, HEARTBEAT, *LIVENESS,
)  # fmt: skip
# Who a series belongs to: on every series, never chosen away (without them two engines' series would collide).
IDENTITY = ("deployment", "replica", "engine")
# Named label sets of ``--metric.labels-preset``, each an allowlist; docs/metrics.md shows each (its test checks).
LABEL_PRESETS: dict[str, tuple[str, ...]] = {
    # For hosted backends that cap label names (Grafana Mimir and Cortex: 30 by default): the true block sizes and
    # what decides them, the dtypes, prefix caching, memory and the replica's block count.
    "compact": (
        "block_size", "mamba_block_size", "effective_attention_block_size", "hash_block_size", "mamba_cache_mode",
        "cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "enable_prefix_caching",
        "prefix_caching_hash_algo", "gpu_memory_utilization", "num_gpu_blocks", "num_cpu_blocks", "sliding_window",
        "kv_cache_memory_bytes", "kv_offloading_backend",
    ),
}  # fmt: skip


class LabelFlags(NamedTuple):
    """What the messages of ``InfoLabels.parse`` call each choice: the flags of ``serve``."""

    allow: str
    deny: str
    preset: str


class LabelChoiceError(ValueError):
    """A choice of labels that cannot work, said in full: what is wrong and what would work."""


@functools.cache
def known_labels() -> frozenset[str]:
    """The labels some vLLM release of the table has, and the identity labels."""
    return frozenset({label.name for release in releases() for label in release.cache_config.labels}.union(IDENTITY))


@dataclass(frozen=True)
class InfoLabels:
    """Which of vLLM's labels ``cache_config_info`` carries (``--metric.labels-preset``, ``-allowlist``,
    ``-denylist``).

    Hosted backends refuse series with many label names (Grafana Mimir and Cortex: more than 30 by default), and
    ``cache_config_info`` has 39 in vLLM 0.34. ``allow`` None keeps every label; ``deny`` drops labels. The
    identity labels are always kept; the numeric gauges are never affected.
    """

    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, allow: Collection[str], deny: Collection[str], preset: str, flags: LabelFlags) -> InfoLabels:
        """From the allowlist, the denylist and the preset (empty: not given). A name no vLLM release of the table
        has is refused with the nearest known ones: a typo would otherwise drop a label without a word. Raises
        ``LabelChoiceError``."""
        if allow and deny:
            raise LabelChoiceError(f"{flags.allow} and {flags.deny} cannot be combined: give one of them")
        _refuse_unknown(flags.allow, allow)
        _refuse_unknown(flags.deny, deny)
        kept = [name for name in IDENTITY if name in deny]
        if kept:
            raise LabelChoiceError(
                f"{flags.deny} cannot drop {_joined(kept, 'or')}: deployment, replica and engine tell the series "
                "apart, so they are always kept"
            )
        if preset:
            allow = _preset_labels(preset, flags, allow, deny)
        return cls(frozenset(allow) - set(IDENTITY) if allow else None, frozenset(deny))

    def keeps(self, name: str) -> bool:
        return (self.allow is None or name in self.allow) and name not in self.deny

    def select(self, labels: Mapping[str, str]) -> Labels:
        """The labels kept, in the order of the sending vLLM release."""
        if self.allow is None and not self.deny:  # every label: no name to look at
            return tuple(labels.items())
        return tuple((name, value) for name, value in labels.items() if self.keeps(name))


def _preset_labels(preset: str, flags: LabelFlags, allow: Collection[str], deny: Collection[str]) -> tuple[str, ...]:
    """The allowlist ``preset`` names, which the denylist may shorten; refuses what would not work with it."""
    if preset not in LABEL_PRESETS:
        raise LabelChoiceError(
            f"{flags.preset}: there is no preset {preset!r} (known presets: {', '.join(LABEL_PRESETS)})"
        )
    if allow:
        raise LabelChoiceError(
            f"{flags.preset} and {flags.allow} cannot be combined: the preset is an allowlist already "
            f"({flags.deny} drops names from it)"
        )
    labels = LABEL_PRESETS[preset]
    outside = [name for name in deny if name not in labels]
    if outside:
        raise LabelChoiceError(
            f"{flags.deny} names {_joined([repr(name) for name in outside], 'and')}, which the {preset} preset does "
            "not keep anyway: there is nothing to drop"
        )
    return labels


def _refuse_unknown(flag: str, names: Collection[str]) -> None:
    """Refuse the names no vLLM release of the table has, each with the known names nearest to it."""
    unknown = [name for name in names if name not in known_labels()]
    if not unknown:
        return
    table = releases()
    raise LabelChoiceError(
        f"{flag}: no vLLM release from {table[0].version} to {table[-1].version} has a label named "
        f"{_joined([_with_nearest(name) for name in unknown], 'or')}"
    )


def _with_nearest(name: str) -> str:
    nearest = difflib.get_close_matches(name, sorted(known_labels()), n=3)
    return f"{name!r} (did you mean {_joined(nearest, 'or')}?)" if nearest else repr(name)


def _joined(words: Sequence[str], conjunction: str) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return f"{', '.join(words[:-1])} {conjunction} {words[-1]}" if len(words) > 1 else words[0]


EVERY_LABEL = InfoLabels()


def replica_samples(replica: Replica, info_labels: InfoLabels = EVERY_LABEL) -> tuple[list[Sample], ...]:
    """One replica's samples, a list per family of ``FAMILIES`` (in that order); ``cache_config_info`` carries the
    labels ``info_labels`` keeps."""
    samples = replica_own_samples(replica)
    if replica.engines:
        synced = replica.synced
        info = info_labels.select(synced.labels)
        identity = replica_identity(replica)
        for engine in sorted(replica.engines):
            engine_identity = (*identity, ("engine", str(engine)))
            samples[INFO].append(((*engine_identity, *info), 1.0))
            engine_samples(samples, engine_identity, synced.engines[engine], replica.engines[engine].received_at)
    return tuple(samples[family] for family in FAMILIES)


def replica_own_samples(replica: Replica) -> dict[Family, list[Sample]]:
    """A list per family of ``FAMILIES``, holding the replica's own samples (none of an engine's): apart, so that
    the byte budget can count a replica's lines an engine at a time (``exporter/exposition/lines.py``)."""
    samples: dict[Family, list[Sample]] = {family: [] for family in FAMILIES}
    identity = replica_identity(replica)
    (samples[SEEN],) = liveness_samples(replica)
    if replica.heartbeat_seconds is not None:
        samples[HEARTBEAT].append((identity, replica.heartbeat_seconds))
    if replica.engines:
        synced = replica.synced
        for field, count in synced.distinct_values.items():
            samples[DISTINCT].append(((*identity, ("field", field)), count))
        if synced.data_parallel_size is not None:
            samples[PARALLEL].append((identity, synced.data_parallel_size))
    return samples


def engine_samples(
    samples: dict[Family, list[Sample]], engine_identity: Labels, figures: EngineFigures, received_at: float
) -> None:
    """Append an engine's samples of every family but ``INFO`` (whose labels are the replica's): they depend on
    its figures and when its response came only, so an unchanged engine's lines take the bytes they took."""
    for family in ENGINE_GAUGES:
        value = getattr(figures, family.suffix)
        if value is not None:
            samples[family].append((engine_identity, value))
    for family in (SOURCE, *RESOLVED_SOURCES):
        source = getattr(figures, family.suffix.removesuffix("_info"))
        if source is not None:
            samples[family].append(((*engine_identity, ("source", source)), 1.0))
    if figures.kv_cache_groups is not None:
        _group_samples(samples, engine_identity, figures.kv_cache_groups)
    samples[UPDATED].append((engine_identity, received_at))


def replica_identity(replica: Replica) -> Labels:
    """The labels of a replica's own series (an engine's add ``engine``)."""
    return (("deployment", replica.deployment), ("replica", replica.name))


def liveness_values(replica: Replica) -> tuple[float | None, ...]:
    """All that a heartbeat changes: the value of each ``LIVENESS`` family's one sample, labelled
    ``replica_identity``; ``None`` where the family has none."""
    return (replica.last_seen,)


def liveness_samples(replica: Replica) -> tuple[list[Sample], ...]:
    """The samples of the ``LIVENESS`` families."""
    identity = replica_identity(replica)
    return tuple([(identity, value)] if value is not None else [] for value in liveness_values(replica))


def _group_samples(samples: dict[Family, list[Sample]], engine_identity: Labels, groups: KVCacheGroups) -> None:
    """An engine's KV-cache groups: an info sample and the figures of each, in the engine core's order."""
    for index, group in enumerate(groups.groups):
        identity = (*engine_identity, ("group", str(index)), ("kind", group.kind))
        described = (
            ("spec", group.spec),
            ("block_size", str(group.block_size)),
            ("page_size_bytes", str(group.page_size_bytes)),
            ("sliding_window", str(group.sliding_window)),
            ("attention_chunk_size", str(group.attention_chunk_size)),
            ("draft", str(group.draft)),
        )
        samples[GROUP_INFO].append(((*identity, *described), 1.0))
        for family, value_of in GROUP_GAUGES:
            value = value_of(group)
            if value is not None:
                samples[family].append((identity, value))
