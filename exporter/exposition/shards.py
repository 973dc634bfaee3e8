"""Shards of ``/metrics``, as kube-state-metrics shards its series: scrape job *i* of *n* asks for shard *i* of
*n* and gets the deployments whose name hashes to *i* modulo *n*; the *n* shards together are the whole.

The hash is FNV-1a (32 bits) of the deployment's name in UTF-8: the same in every process and release (Python's
``hash`` of a string is not), so a deployment stays in its shard across restarts and across exporters. A whole
deployment goes to one shard, so the recording rules that sum a deployment's replicas find them in one scrape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from exporter.state.replicas import ReplicaKey

# Most shards ``/metrics`` is split into: far more scrape jobs than anyone runs, a bound on the query's number.
MAX_SHARDS = 1024
# Deployment names whose hash is kept: a shard's scrape looks each up rather than hashing the fleet's names anew.
HASHES_KEPT = 1 << 16
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


@functools.lru_cache(maxsize=HASHES_KEPT)
def deployment_hash(deployment: str) -> int:
    """The hash that places a deployment in its shard."""
    return fnv1a_32(deployment.encode())


def fnv1a_32(data: bytes) -> int:
    """The 32-bit FNV-1a hash of ``data``."""
    value = _FNV_OFFSET
    for byte in data:
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return value


class Shard(NamedTuple):
    """Shard ``index`` of ``total`` (0 <= index < total <= ``MAX_SHARDS``)."""

    index: int
    total: int

    def keeps(self, key: ReplicaKey) -> bool:
        """Whether the replica of ``key`` is in this shard: its deployment's name decides."""
        return deployment_hash(key[0]) % self.total == self.index
