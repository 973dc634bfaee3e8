"""The replicas of one state version: an immutable map that the next version shares all but its changed shards with.

A commit must cost what it changed, not what the exporter holds: copying a
dict of 10,000 replicas for every commit made one change at 10,000 engines
cost more than at 100. So the keys are spread by hash over a fixed number of
shards (plain dicts, never changed once published); a new version copies the
tuple of shards (``SHARDS`` pointers) and only the shards its changes fall in.
A fixed count rather than one shard per deployment: a deployment may hold
1,024 replicas and there may be 10,000 deployments, and either would make one
shard or the outer map as large as the fleet. Hashes are this process's own
(``PYTHONHASHSEED``): the layout is never stored.

Readers get a ``Mapping``: lookups cost one hash, iterating walks the shards
(in no particular order: callers that show replicas sort them). ``key_set`` stays
the same object while no key comes or goes, so a reader can keep what it worked
out from the keys alone (their sorted order) across versions that only replaced
replicas, as heartbeats do. ``serial`` orders the maps by when they were built: the writer
builds each version from the last, so of two maps the one with the larger serial is the
later state.
"""

from __future__ import annotations

import itertools
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView

from exporter.state.replicas import Replica, ReplicaKey

# Shards of every map; at 10,000 replicas a changed shard holds about ten of them.
SHARDS = 1024

_EMPTY: dict[ReplicaKey, Replica] = {}
# Every map's serial, in the order built, in this process.
_SERIALS = itertools.count()


class ReplicaMap(Mapping[ReplicaKey, Replica]):
    """Every replica by (deployment, replica name); never changed, ``with_changes`` builds the next one."""

    __slots__ = ("_len", "_shards", "key_set", "serial")

    def __init__(
        self,
        shards: tuple[dict[ReplicaKey, Replica], ...] = (_EMPTY,) * SHARDS,
        length: int = 0,
        key_set: object | None = None,
    ) -> None:
        self._shards = shards
        self._len = length
        # Identifies the set of keys: shared with the map this one was built from when no key came or went.
        self.key_set = object() if key_set is None else key_set
        self.serial = next(_SERIALS)

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> ReplicaMap:
        return cls().with_changes({replica.key: replica for replica in replicas})

    def with_changes(self, changed: Mapping[ReplicaKey, Replica | None]) -> ReplicaMap:
        """The map with ``changed`` applied (``None`` removes a key); copies only the shards they fall in."""
        if not changed:
            return self
        shards = list(self._shards)
        copied: set[int] = set()
        length = self._len
        same_keys = True
        for key, replica in changed.items():
            index = hash(key) % SHARDS
            if index not in copied:
                shards[index] = dict(shards[index])
                copied.add(index)
            shard = shards[index]
            had = key in shard
            same_keys = same_keys and had == (replica is not None)
            if replica is None:
                if had:
                    del shard[key]
                    length -= 1
            else:
                shard[key] = replica
                length += not had
        return ReplicaMap(tuple(shards), length, self.key_set if same_keys else None)

    def __getitem__(self, key: ReplicaKey) -> Replica:
        return self._shards[hash(key) % SHARDS][key]

    def get(self, key: ReplicaKey, default: Replica | None = None) -> Replica | None:  # type: ignore[override]
        return self._shards[hash(key) % SHARDS].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) % SHARDS]

    def __iter__(self) -> Iterator[ReplicaKey]:
        for shard in self._shards:
            yield from shard

    def __len__(self) -> int:
        return self._len

    def items(self) -> ItemsView[ReplicaKey, Replica]:
        return _Items(self)

    def values(self) -> ValuesView[Replica]:
        return _Values(self)

    def __repr__(self) -> str:
        return f"ReplicaMap({len(self)} replicas)"


class _Items(ItemsView[ReplicaKey, Replica]):
    """Each shard's items at C speed, rather than a lookup per key."""

    _mapping: ReplicaMap

    def __iter__(self) -> Iterator[tuple[ReplicaKey, Replica]]:
        for shard in self._mapping._shards:
            yield from shard.items()


class _Values(ValuesView[Replica]):
    _mapping: ReplicaMap

    def __iter__(self) -> Iterator[Replica]:
        for shard in self._mapping._shards:
            yield from shard.values()
