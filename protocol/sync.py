"""The sync: from a deployment's static base config and its engines' ready responses to the true config.

It follows vLLM's ``_apply_ready_response`` (smallest ``max_model_len``, summed
``num_gpu_blocks``, block sizes from the engines, per-engine ``kv_cache_*``
figures never summed, one ``dp_stats_address``) but is a pure function of the
*current* response of each engine rather than a fold over arrival order, which
removes vLLM's weaknesses: a re-sent response changes nothing, an engine that
re-reports replaces its own contribution, the result is the same in any order,
and a payload without ``mamba_block_size`` leaves the base value alone.
Where engines disagree, the lowest engine index wins and the number of
distinct values is reported so that the disagreement is visible.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from protocol.cache_config import CacheConfig
from protocol.errors import InvalidPayload, SyncConflict
from protocol.ready_response import EngineCoreReadyResponse, is_set


class SyncedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The config a deployment really runs with, and what the sync learned on the way."""

    config: CacheConfig
    max_model_len: int | None
    dp_stats_address: str | None
    distinct_values: dict[str, int]


def check_engine_index(engine: int, response: EngineCoreReadyResponse) -> None:
    """Refuse a response whose engine index cannot exist in its own data-parallel group."""
    if is_set(response.data_parallel_rank) and response.data_parallel_rank != engine:
        raise InvalidPayload(
            "$.data_parallel_rank",
            f"engine index {engine} from the request differs from data_parallel_rank {response.data_parallel_rank}",
        )
    if is_set(response.data_parallel_size) and engine >= response.data_parallel_size:
        raise InvalidPayload(
            "$.data_parallel_rank",
            f"engine index {engine} is outside data_parallel_size {response.data_parallel_size}",
        )


def sync(base: CacheConfig, engines: Mapping[int, EngineCoreReadyResponse]) -> SyncedConfig:
    """The synced config of ``base`` given each engine's current ready response.

    Raises ``SyncConflict`` when engines report different ``dp_stats_address``
    values, which vLLM treats as fatal.
    """
    ordered = [engines[index] for index in sorted(engines)]
    if not ordered:
        return SyncedConfig(config=base, max_model_len=None, dp_stats_address=None, distinct_values={})

    addresses = sorted({r.dp_stats_address for r in ordered if r.dp_stats_address is not None})
    if len(addresses) > 1:
        raise SyncConflict(
            "$.dp_stats_address",
            f"engines of one deployment must share one dp_stats_address, got {', '.join(addresses)}",
        )

    block_sizes = [r.block_size for r in ordered if is_set(r.block_size)]
    # An explicit None is a report ("no Mamba layers"); an absent key is not.
    mamba_block_sizes = [r.mamba_block_size for r in ordered if r.mamba_block_size is not msgspec.UNSET]
    size_tokens = [r.kv_cache_size_tokens for r in ordered if is_set(r.kv_cache_size_tokens)]
    concurrency = [r.kv_cache_max_concurrency for r in ordered if is_set(r.kv_cache_max_concurrency)]

    changes: dict[str, object] = {"num_gpu_blocks": sum(r.num_gpu_blocks for r in ordered)}
    if block_sizes:
        changes["block_size"] = block_sizes[0]
        changes["block_size_resolved"] = True
    if mamba_block_sizes:
        changes["mamba_block_size"] = mamba_block_sizes[0]
    if size_tokens:
        changes["kv_cache_size_tokens"] = size_tokens[0]
    if concurrency:
        changes["kv_cache_max_concurrency"] = concurrency[0]

    return SyncedConfig(
        config=msgspec.structs.replace(base, **changes),
        max_model_len=min(r.max_model_len for r in ordered),
        dp_stats_address=addresses[0] if addresses else None,
        distinct_values={
            "block_size": len(set(block_sizes)) or 1,
            "mamba_block_size": len(set(mamba_block_sizes)) or 1,
        },
    )
