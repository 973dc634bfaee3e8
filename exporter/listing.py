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

from exporter.state import ExporterState, Replica, ReplicaKey

# Sorts after every replica name: ``after=DEPLOYMENT`` skips all of that deployment's replicas.
_LAST_REPLICA = "\U0010ffff"


@dataclass
class _Encoded:
    """One state version's replicas: keys in order, their JSON, and the whole array once asked for."""

    version: int
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
        self._state = state
        self._encode = encode
        # Replicas are immutable: an unchanged one keeps its encoded JSON from one version to the next.
        self._by_key: dict[ReplicaKey, tuple[Replica, bytes]] = {}
        self._encoded = _Encoded(-1, [], [])
        self._lock = threading.Lock()

    def is_fresh(self, whole: bool) -> bool:
        """True when ``page`` will neither encode nor join the whole list (cheap on the event loop)."""
        encoded = self._encoded
        return encoded.version == self._state.version and (encoded.whole is not None or not whole)

    def _current(self) -> _Encoded:
        encoded = self._encoded
        if encoded.version == self._state.version:
            return encoded
        with self._lock:
            # Read the version before the snapshot: the snapshot is then at least that new.
            version = self._state.version
            if self._encoded.version != version:
                replicas = self._state.snapshot()
                by_key = {}
                for key in sorted(replicas):
                    replica = replicas[key]
                    cached = self._by_key.get(key)
                    by_key[key] = cached if cached and cached[0] is replica else (replica, self._encode(replica))
                self._by_key = by_key
                self._encoded = _Encoded(version, list(by_key), [part for _, part in by_key.values()])
            return self._encoded

    def replicas_of(self, deployment: str) -> bytes:
        """The JSON array of one deployment's replicas."""
        encoded = self._current()
        start = bisect.bisect_left(encoded.keys, (deployment, ""))
        end = bisect.bisect_right(encoded.keys, (deployment, _LAST_REPLICA))
        return b"[" + b",".join(encoded.parts[start:end]) + b"]"

    def page(self, after: str | None, limit: int | None) -> tuple[Sequence[bytes], str | None]:
        """The JSON array (as chunks), and the cursor to continue ``after`` when more replicas follow."""
        encoded = self._current()
        if after is None and limit is None:
            return (encoded.everything(),), None
        deployment, _, replica = (after or "").partition(" ")
        start = 0 if after is None else bisect.bisect_right(encoded.keys, (deployment, replica or _LAST_REPLICA))
        end = len(encoded.keys) if limit is None else min(start + limit, len(encoded.keys))
        body = b"[" + b",".join(encoded.parts[start:end]) + b"]"
        return (body,), " ".join(encoded.keys[end - 1]) if end < len(encoded.keys) else None
