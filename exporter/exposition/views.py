"""What the JSON API shows of a replica: its synced config, and every key each engine sent.

The keys as sent are decoded from the kept bytes only here, to be encoded as JSON at once (a JSON payload is
embedded as it came): the status page, which does not show them, takes a view without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from exporter.state.replicas import EngineReport, Replica
from protocol import EngineFigures, shown_as_json


class EngineView(msgspec.Struct, kw_only=True):
    """One engine: its figures and every key it sent, as it sent them."""

    engine: int
    received_at: float
    wire_format: str
    figures: EngineFigures
    # Every key the engine sent, as JSON; None in a view without them.
    response: msgspec.Raw | None


class ReplicaView(msgspec.Struct, kw_only=True):
    """A replica: who it is, when it was last heard from, and its synced config."""

    deployment: str
    replica: str
    instance_id: str | None
    heartbeat_seconds: float | None
    last_seen: float
    vllm_release: str
    mamba_cache_mode: str
    labels: dict[str, str]
    max_model_len: int | None
    dp_stats_address: str | None
    data_parallel_size: int | None
    distinct_values: dict[str, int]
    static_labels: dict[str, str]
    engines: list[EngineView]


_json = msgspec.json.Encoder()
# What a view copies as it is: from the replica, and from its synced config.
_OF_REPLICA = ("deployment", "instance_id", "heartbeat_seconds", "last_seen", "static_labels")
_OF_SYNC = ("mamba_cache_mode", "labels", "max_model_len", "dp_stats_address", "data_parallel_size", "distinct_values")


def view(replica: Replica, responses: bool = True, shown: Mapping[int, bytes] = MappingProxyType({})) -> ReplicaView:
    """A replica's view; with ``responses``, every key each engine sent (which the status page does not show);
    ``shown``: engines' responses as JSON already made (by the decode of a request that sent them)."""
    synced = replica.synced
    engines = [
        EngineView(
            engine=index,
            received_at=report.received_at,
            wire_format=report.wire_format,
            figures=synced.engines[index],
            response=(_shown(report, shown.get(index)) if responses else None),
        )
        for index, report in sorted(replica.engines.items())
    ]
    return ReplicaView(
        replica=replica.name,
        vllm_release=synced.release,
        engines=engines,
        **{name: getattr(replica, name) for name in _OF_REPLICA},
        **{name: getattr(synced, name) for name in _OF_SYNC},
    )


def _shown(report: EngineReport, shown: bytes | None) -> msgspec.Raw:
    return shown_as_json(report.payload, report.wire_format) if shown is None else msgspec.Raw(shown)


def encode_view(replica: Replica, shown: Mapping[int, bytes] = MappingProxyType({})) -> bytes:
    """A replica's view as JSON (``shown``: as ``view`` takes it)."""
    return _json.encode(view(replica, shown=shown))
