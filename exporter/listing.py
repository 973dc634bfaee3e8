"""What ``GET /api/v1/deployments`` sends: each replica's JSON encoded once per change, pages joined from it.

Like ``/metrics``, the list is cached per state version: a request costs a join
of at most one page of cached parts (the whole list is joined once per version),
never an encode of the fleet on the event loop.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exporter.replicas import Replica, ReplicaKey
from exporter.state import ExporterState, PerVersion
from exporter.writer import Replicas

# Sorts after every replica name: ``after=DEPLOYMENT`` skips all of that deployment's replicas.
_LAST_REPLICA = "\U0010ffff"


@dataclass
class _Encoded:
    """One state version's replicas: keys in order, their JSON, and the whole array once asked for."""

    keys: list[ReplicaKey]
    parts: list[bytes]
    whole: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def everything(self) -> bytes:
        with self.lock:
            if self.whole is None:
                self.whole = b"[" + b",".join(self.parts) + b"]"
            return self.whole


class DeploymentListing:
    """The replicas of the current state, whole or paged by (deployment, replica), up to ``limit`` at a time.

    ``after`` is a deployment name (continue with the next deployment) or ``"DEPLOYMENT REPLICA"``
    (continue with the next replica); the ``Link`` of a page gives the latter.
    """

    def __init__(self, state: ExporterState, encode: Callable[[Replica], bytes]) -> None:
        self._encode = encode
        # Replicas are immutable: an unchanged one keeps its encoded JSON from one version to the next.
        self._by_key: dict[ReplicaKey, tuple[Replica, bytes]] = {}
        self._encoded = PerVersion(state, self._encode_all)

    def is_fresh(self, whole: bool) -> bool:
        """True when ``page`` will neither encode nor join the whole list (cheap on the event loop)."""
        encoded = self._encoded.fresh()
        return encoded is not None and (encoded.whole is not None or not whole)

    def _encode_all(self, replicas: Replicas) -> _Encoded:
        by_key = {}
        for key in sorted(replicas):
            replica = replicas[key]
            cached = self._by_key.get(key)
            by_key[key] = cached if cached and cached[0] is replica else (replica, self._encode(replica))
        self._by_key = by_key
        return _Encoded(list(by_key), [part for _, part in by_key.values()])

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
            return (encoded.everything(),), None
        deployment, _, replica = (after or "").partition(" ")
        start = 0 if after is None else bisect.bisect_right(encoded.keys, (deployment, replica or _LAST_REPLICA))
        end = len(encoded.keys) if limit is None else min(start + limit, len(encoded.keys))
        body = b"[" + b",".join(encoded.parts[start:end]) + b"]"
        return (body,), " ".join(encoded.keys[end - 1]) if end < len(encoded.keys) else None
