"""What ``GET /api/v1/deployments`` sends: each replica's JSON encoded once per change, pages joined from it.

Like ``/metrics``, the list is cached per state version: a request costs a join
of at most one page of cached parts (the whole list is joined once per version),
never an encode of the fleet on the event loop. Each replica's part is a slice of
the whole list, so the JSON of the fleet is held once.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from exporter.state.exporter_state import ExporterState, PerVersion
from exporter.state.replicas import Replica, ReplicaKey

# Sorts after every replica name: ``after=DEPLOYMENT`` skips all of that deployment's replicas.
_LAST_REPLICA = "\U0010ffff"


@dataclass(frozen=True)
class _Encoded:
    """One state version's replicas: keys in order, the whole JSON array, and each one's JSON (a slice of it)."""

    keys: list[ReplicaKey]
    whole: bytes
    parts: list[memoryview]


def _joined(keys: list[ReplicaKey], parts: list[bytes | memoryview]) -> _Encoded:
    whole = b"[" + b",".join(parts) + b"]"
    view = memoryview(whole)
    slices, start = [], 1
    for part in parts:
        slices.append(view[start : start + len(part)])
        start += len(part) + 1
    return _Encoded(keys, whole, slices)


class DeploymentListing:
    """The replicas of the current state, whole or paged by (deployment, replica), up to ``limit`` at a time.

    ``after`` is a deployment name (continue with the next deployment) or ``"DEPLOYMENT REPLICA"``
    (continue with the next replica); the ``Link`` of a page gives the latter.
    """

    def __init__(self, state: ExporterState, encode: Callable[[Replica], bytes]) -> None:
        self._encode = encode
        # Replicas are immutable: an unchanged one keeps its encoded JSON from one version to the next.
        self._by_key: dict[ReplicaKey, tuple[Replica, memoryview]] = {}
        self._encoded = PerVersion(state, self._encode_all)

    def is_fresh(self) -> bool:
        """True when ``page`` will neither encode nor join the whole list (cheap on the event loop)."""
        return self._encoded.fresh() is not None

    def _encode_all(self, replicas: Mapping[ReplicaKey, Replica]) -> _Encoded:
        keys = sorted(replicas)
        parts: list[bytes | memoryview] = []
        for key in keys:
            cached = self._by_key.get(key)
            parts.append(cached[1] if cached and cached[0] is replicas[key] else self._encode(replicas[key]))
        encoded = _joined(keys, parts)
        self._by_key = {key: (replicas[key], part) for key, part in zip(keys, encoded.parts, strict=True)}
        return encoded

    def replica(self, key: ReplicaKey) -> memoryview | None:
        """The JSON of one replica, ``None`` when the current state has none of that key."""
        encoded = self._encoded.current()
        index = bisect.bisect_left(encoded.keys, key)
        return encoded.parts[index] if index < len(encoded.keys) and encoded.keys[index] == key else None

    def replicas_of(self, deployment: str) -> bytes:
        """The JSON array of one deployment's replicas."""
        encoded = self._encoded.current()
        start = bisect.bisect_left(encoded.keys, (deployment, ""))
        end = bisect.bisect_right(encoded.keys, (deployment, _LAST_REPLICA))
        return b"[" + b",".join(encoded.parts[start:end]) + b"]"

    def page(self, after: str | None, limit: int | None) -> tuple[Sequence[bytes], str | None]:
        """The JSON array (as chunks), and the cursor to continue ``after`` when more replicas follow."""
        encoded = self._encoded.current()
        if after is None and limit is None:
            return (encoded.whole,), None
        deployment, _, replica = (after or "").partition(" ")
        start = 0 if after is None else bisect.bisect_right(encoded.keys, (deployment, replica or _LAST_REPLICA))
        end = len(encoded.keys) if limit is None else min(start + limit, len(encoded.keys))
        body = b"[" + b",".join(encoded.parts[start:end]) + b"]"
        return (body,), " ".join(encoded.keys[end - 1]) if end < len(encoded.keys) else None
