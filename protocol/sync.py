"""The sync: from a deployment's static labels and its engines' ready responses to the true config.

It follows vLLM's ``_apply_ready_response`` (smallest ``max_model_len``, summed
``num_gpu_blocks``, block sizes from the engines, the first ``kv_cache_*``
figures, ``effective_attention_block_size`` only where all engines agree, one
``dp_stats_address`` and coordinator) but is a pure function of the *current*
response of each engine rather than a fold over arrival order, which removes
vLLM's weaknesses: a re-sent response changes nothing, an engine that
re-reports replaces its own contribution, the result is the same in any order
(the lowest engine index wins where vLLM takes the last to answer), and the
frontend's already-summed ``num_gpu_blocks`` is never counted twice.

And it corrects vLLM where its metric is wrong. The truth is the engine
core's own KV-cache groups, which the plugin adds to each ready response: the
Mamba group's block size is the true ``mamba_block_size``. Without them (a raw
push, an older plugin) a rule stands in: in ``align`` and ``all`` mode the
workers set ``mamba_block_size = block_size`` after raising the attention
block, and the engine core reports the smallest KV-cache group's block size,
which is the Mamba group's, so the reported ``block_size`` is taken (vLLM shows
the configured value, or in 0.29+ the engine core's copy, which stays configured
whenever the alignment ran in worker processes); in ``none`` mode the
configured value. The rule breaks where vLLM's smallest group is not the Mamba
group (a drafter's attention group, an explicit ``--block-size``), which the
groups never do. Each engine's figures say which of the two a value came from.

The values vLLM resolves in the engine core only, ``hash_block_size`` and
``cache_hit_alignment_tokens`` (0.32+), never reach vLLM's frontend: its
labels show ``None``. They come from the engine core's groups, and the hash
block size from 0.34's ``prefix_hash_config`` too; where neither tells, the
figures say ``unknown`` and the labels keep vLLM's own value.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import msgspec
from msgspec import UNSET, UnsetType

from protocol.errors import InvalidPayload, SyncConflict
from protocol.labels import parse_int
from protocol.ready_response import EngineCoreReadyResponse, KVCacheGroups
from protocol.releases import Release, newest, release_named, release_of

ALIGNED_MODES = frozenset({"align", "all"})
# Where an engine's true mamba_block_size came from.
FROM_GROUPS = "kv_cache_groups"
FROM_RULE = "sync_rule"
# Where an engine-resolved value came from besides its groups, or that nothing told it.
FROM_PREFIX_HASH_CONFIG = "prefix_hash_config"
UNKNOWN = "unknown"
# Values only the engine core resolves; vLLM's frontend labels keep None for them.
ENGINE_RESOLVED = ("hash_block_size", "cache_hit_alignment_tokens")
# Fields every engine of one vLLM server must agree on; vLLM asserts it.
_SHARED_ADDRESSES = ("dp_stats_address", "coordinator_input_address", "coordinator_output_address")


class EngineFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's numbers as the exporter shows them."""

    block_size: int | None
    mamba_block_size: int | None
    vllm_mamba_block_size: int | None
    num_gpu_blocks: int
    max_model_len: int
    kv_cache_size_tokens: int | None
    kv_cache_max_concurrency: float | None
    # ``kv_cache_groups`` when the engine core's groups gave mamba_block_size, ``sync_rule`` when a rule did.
    mamba_block_size_source: str | None
    # Tokens per prefix-cache block hash as the engine core resolved it; None where nothing told it.
    hash_block_size: int | None
    # Tokens at which the engine's prefix-cache hits land; None where nothing told it.
    cache_hit_alignment_tokens: int | None
    # Where each of the two came from: ``kv_cache_groups``, ``prefix_hash_config`` (the hash block size of a
    # 0.34 engine) or ``unknown``.
    hash_block_size_source: str
    cache_hit_alignment_tokens_source: str
    kv_cache_groups: KVCacheGroups | None


class FigureRule(NamedTuple):
    """The replica-wide inputs of every engine's figures: the Mamba cache mode, the configured
    ``mamba_block_size`` and the block size an engine that sent none shows."""

    mode: str
    configured: int | None
    default_block: int | None


class SyncedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The config a deployment really runs with, and what the sync learned on the way."""

    release: str
    labels: dict[str, str]
    mamba_cache_mode: str
    max_model_len: int | None
    dp_stats_address: str | None
    data_parallel_size: int | None
    distinct_values: dict[str, int]
    engines: dict[int, EngineFigures]
    # The replica-wide inputs the engines' figures were worked out with (``sync_inputs`` keeps them while it stays).
    figure_rule: FigureRule


class EngineInput(msgspec.Struct, frozen=True, gc=False):
    """What the sync reads of one engine's ready response, read once (``engine_input``).

    A replica's sync is then a fold over its engines' inputs and each engine's figures a function of its input and
    the replica-wide ``FigureRule``: an engine whose response did not change keeps its input, and its figures while
    the rule stays (``sync_inputs``), so a ready response of one engine of a large replica neither decodes its
    siblings' responses again nor works out their figures again. Fields that vLLM may send as ``None`` keep
    ``UNSET`` where the sync tells "not sent" from ``None``.
    """

    # What ``check_agreement`` compares: the shared addresses, then ``coord_store_port``.
    agreement: tuple[object, ...]
    release: Release
    cache_config_info: dict[str, str] | None
    block_size: int | None
    num_gpu_blocks: int
    max_model_len: int
    kv_cache_size_tokens: int | None
    kv_cache_max_concurrency: float | None
    effective_attention_block_size: int | UnsetType | None
    mamba_block_size: int | UnsetType | None
    dp_stats_address: str | None
    data_parallel_size: int | None
    kv_cache_groups: KVCacheGroups | None
    prefix_hash_block_size: int | None


def engine_input(response: EngineCoreReadyResponse) -> EngineInput:
    """What the sync reads of ``response``."""
    prefix_hash = response.reported("prefix_hash_config")
    version = response.reported("vllm_version")
    # By its version where it names one: the keys sent (a look at every field) only where it does not.
    release = (release_named(version) if version else None) or release_of(version, response.sent_keys())
    return EngineInput(
        agreement=(*(response.reported(name) for name in _SHARED_ADDRESSES), response.reported("coord_store_port")),
        release=release,
        cache_config_info=response.reported("cache_config_info"),
        block_size=response.reported("block_size"),
        num_gpu_blocks=response.num_gpu_blocks,
        max_model_len=response.max_model_len,
        kv_cache_size_tokens=response.reported("kv_cache_size_tokens"),
        kv_cache_max_concurrency=response.reported("kv_cache_max_concurrency"),
        effective_attention_block_size=response.effective_attention_block_size,
        mamba_block_size=response.mamba_block_size,
        dp_stats_address=response.reported("dp_stats_address"),
        data_parallel_size=response.reported("data_parallel_size"),
        kv_cache_groups=response.reported("kv_cache_groups"),
        prefix_hash_block_size=prefix_hash.hash_block_size if prefix_hash is not None else None,
    )


def check_agreement(engines: Sequence[EngineInput]) -> None:
    """Refuse engines that contradict each other where vLLM requires one value (two engines with the same
    ``agreement`` agree, or disagree, with any others alike: a check may look at one engine for each)."""
    for place, name in enumerate(_SHARED_ADDRESSES):
        values = sorted({value for engine in engines if (value := engine.agreement[place]) is not None})
        if len(values) > 1:
            raise SyncConflict(
                f"$.{name}", f"engines of one vLLM server must share one {name}, got {', '.join(values)}"
            )
    ports = sorted({port for engine in engines if (port := engine.agreement[-1])})
    if len(ports) > 1:
        raise SyncConflict(
            "$.coord_store_port", f"engines of one vLLM server must share one coord_store_port, got {ports}"
        )


def _first(values: Iterable[object]) -> object:
    return next((value for value in values if value is not None), None)


def _known(*candidates: tuple[int | None, str]) -> tuple[int | None, str]:
    """The first (value, source) whose value is known, else (None, ``unknown``)."""
    return next(((value, source) for value, source in candidates if value is not None), (None, UNKNOWN))


def _figures(engine: EngineInput, rule: FigureRule) -> EngineFigures:
    """One engine's figures: its own groups where it sent them (the truth), else vLLM's rule for ``mode``."""
    own_block = engine.block_size
    groups = engine.kv_cache_groups
    if groups is not None:
        # The engine's own groups: its Mamba groups' block size, and none without Mamba groups.
        true_mamba = _first(groups.block_sizes("mamba"))
        source = FROM_GROUPS
    else:
        true_mamba = own_block if rule.mode in ALIGNED_MODES and own_block is not None else rule.configured
        source = FROM_RULE
    hash_block_size, hash_source = _known(
        (groups.hash_block_size if groups is not None else None, FROM_GROUPS),
        (engine.prefix_hash_block_size, FROM_PREFIX_HASH_CONFIG),
    )
    alignment, alignment_source = _known(
        (groups.cache_hit_alignment_tokens if groups is not None else None, FROM_GROUPS)
    )
    return EngineFigures(
        block_size=own_block if own_block is not None else rule.default_block,
        mamba_block_size=true_mamba,
        vllm_mamba_block_size=engine.mamba_block_size if engine.mamba_block_size is not UNSET else rule.configured,
        num_gpu_blocks=engine.num_gpu_blocks,
        max_model_len=engine.max_model_len,
        kv_cache_size_tokens=engine.kv_cache_size_tokens,
        kv_cache_max_concurrency=engine.kv_cache_max_concurrency,
        mamba_block_size_source=source if true_mamba is not None else None,
        hash_block_size=hash_block_size,
        cache_hit_alignment_tokens=alignment,
        hash_block_size_source=hash_source,
        cache_hit_alignment_tokens_source=alignment_source,
        kv_cache_groups=groups,
    )


def sync(static: Mapping[str, str], engines: Mapping[int, EngineCoreReadyResponse]) -> SyncedConfig:
    """The synced config given the frontend's static labels and each engine's current ready response.

    Raises ``SyncConflict`` when engines report different addresses or ports
    that vLLM requires to be equal.
    """
    return sync_inputs(static, {index: engine_input(response) for index, response in engines.items()})


def sync_inputs(
    static: Mapping[str, str],
    engines: Mapping[int, EngineInput],
    previous: SyncedConfig | None = None,
    unchanged: Collection[int] = (),
) -> SyncedConfig:
    """``sync`` of the engines' inputs; ``unchanged``: the engines whose input is the one ``previous`` was synced
    from, which keep their figures from it while the ``FigureRule`` is the same (only the others' are worked out).
    """
    ordered = [engines[index] for index in sorted(engines)]
    check_agreement(ordered)
    release = ordered[0].release if ordered else newest()
    engine_info = _first(engine.cache_config_info for engine in ordered)
    labels = dict(engine_info) if isinstance(engine_info, dict) else release.default_labels()
    labels.update(static)

    block_sizes = [engine.block_size for engine in ordered if engine.block_size is not None]
    if block_sizes:
        labels["block_size"] = str(block_sizes[0])
    if ordered:
        labels["num_gpu_blocks"] = str(sum(engine.num_gpu_blocks for engine in ordered))
    for name, value in (
        ("kv_cache_size_tokens", _first(engine.kv_cache_size_tokens for engine in ordered)),
        ("kv_cache_max_concurrency", _first(engine.kv_cache_max_concurrency for engine in ordered)),
    ):
        if value is not None:
            labels[name] = str(value)
    effective = [size for engine in ordered if (size := engine.effective_attention_block_size) is not UNSET]
    if effective:
        labels["effective_attention_block_size"] = str(effective[0] if len(set(effective)) == 1 else None)

    reported_mamba = [size for engine in ordered if (size := engine.mamba_block_size) is not UNSET]
    given_mode = static.get("mamba_cache_mode") or (engine_info or {}).get("mamba_cache_mode")
    if given_mode is None and any(size is not None for size in reported_mamba):
        # vLLM's MambaModelConfig.verify_and_update_config: a hybrid model with prefix caching aligns.
        given_mode = "align" if labels.get("enable_prefix_caching") == "True" else "none"
    mode = given_mode or labels.get("mamba_cache_mode", "none")
    labels["mamba_cache_mode"] = mode
    configured = (
        parse_int(static["mamba_block_size"])
        if "mamba_block_size" in static
        else _first(reported_mamba) if reported_mamba else parse_int(labels.get("mamba_block_size"))
    )  # fmt: skip

    rule = FigureRule(mode, configured, parse_int(labels.get("block_size")))
    kept = previous.engines if previous is not None and previous.figure_rule == rule else {}
    figures = {
        index: kept[index] if index in unchanged and index in kept else _figures(engine, rule)
        for index, engine in zip(sorted(engines), ordered, strict=True)
    }
    if figures:
        labels["mamba_block_size"] = str(figures[min(figures)].mamba_block_size)
    _show_engine_resolved(labels, [figures[index] for index in sorted(figures)])

    # Dense data-parallel ranks run as independent engines that report size 1 (vLLM's
    # ``reconfigure_for_independent_dp_rank``): their engine indexes show the real size.
    parallel = [size for engine in ordered if (size := engine.data_parallel_size) is not None]
    if parallel:
        parallel.append(max(engines) + 1)
    synced = SyncedConfig(
        release=release.version,
        labels=labels,
        mamba_cache_mode=mode,
        max_model_len=min((engine.max_model_len for engine in ordered), default=None),
        dp_stats_address=_first(engine.dp_stats_address for engine in ordered),
        data_parallel_size=max(parallel, default=None),
        distinct_values={
            "block_size": len(set(block_sizes)) or 1,
            "mamba_block_size": len({f.mamba_block_size for f in figures.values()}) or 1,
        },
        engines=figures,
        figure_rule=rule,
    )
    # The same result is the same object: what was worked out from it (a replica's lines) stays (a frontend that
    # sends its unchanged labels again on every start changes nothing).
    return previous if previous is not None and previous == synced else synced


def _show_engine_resolved(labels: dict[str, str], figures: list[EngineFigures]) -> None:
    """The engine-resolved labels the release has, with the first engine's value that is known (vLLM's own
    value, ``None`` from its frontend, stays where no engine told it)."""
    for name in ENGINE_RESOLVED:
        value = _first([getattr(engine, name) for engine in figures])
        if name in labels and value is not None:
            labels[name] = str(value)


def check_engine_index(engine: int, response: EngineCoreReadyResponse) -> None:
    """Refuse a response whose engine index cannot exist in its own data-parallel group.

    A data-parallel size of 1 is an independent rank (a dense model's DP rank, run by
    vLLM as an engine of its own): any index. Above 1 the engines form one group, and
    vLLM gives them the indexes below the size.
    """
    rank = response.reported("data_parallel_rank")
    size = response.reported("data_parallel_size")
    if rank is not None and rank != engine:
        raise InvalidPayload(
            "$.data_parallel_rank", f"engine index {engine} from the request differs from data_parallel_rank {rank}"
        )
    if size is not None and size > 1 and engine >= size:
        raise InvalidPayload("$.data_parallel_rank", f"engine index {engine} is outside data_parallel_size {size}")
