"""What ``GET /api/v1/deployments`` sends: each deployment's JSON encoded once per change, pages joined from it.

Like ``/metrics``, the list is cached per state version: a request costs a join
of at most one page of cached parts (the whole list is joined once per version),
never an encode of the fleet on the event loop.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exporter.state import Deployment, ExporterState


@dataclass
class _Encoded:
    """One state version's deployments: names in order, their JSON, and the whole array once asked for."""

    version: int
    names: list[str]
    parts: list[bytes]
    whole: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def everything(self) -> bytes:
        with self.lock:
            if self.whole is None:
                self.whole = b"[" + b",".join(self.parts) + b"]"
            return self.whole


class DeploymentListing:
    """The deployments list of the current state, whole or paged by name (``after`` a name, up to ``limit``)."""

    def __init__(self, state: ExporterState, encode: Callable[[Deployment], bytes]) -> None:
        self._state = state
        self._encode = encode
        # Deployments are immutable: an unchanged one keeps its encoded JSON from one version to the next.
        self._by_name: dict[str, tuple[Deployment, bytes]] = {}
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
                deployments = self._state.snapshot()
                by_name = {}
                for name in sorted(deployments):
                    deployment = deployments[name]
                    cached = self._by_name.get(name)
                    by_name[name] = cached if cached and cached[0] is deployment else (
                        deployment, self._encode(deployment)
                    )  # fmt: skip
                self._by_name = by_name
                self._encoded = _Encoded(version, list(by_name), [part for _, part in by_name.values()])
            return self._encoded

    def page(self, after: str | None, limit: int | None) -> tuple[Sequence[bytes], str | None]:
        """The JSON array (as chunks), and the name to continue ``after`` when more deployments follow."""
        encoded = self._current()
        if after is None and limit is None:
            return (encoded.everything(),), None
        start = 0 if after is None else bisect.bisect_right(encoded.names, after)
        end = len(encoded.names) if limit is None else min(start + limit, len(encoded.names))
        body = b"[" + b",".join(encoded.parts[start:end]) + b"]"
        return (body,), encoded.names[end - 1] if end < len(encoded.names) else None
