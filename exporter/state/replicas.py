"""The exporter's state as data: replicas (vLLM servers) and their engines' latest ready responses.

A replica is one vLLM server (a frontend and its data-parallel engines) of a
deployment. Replicas are immutable: a change builds a new one, synced from its
inputs, so readers can hold one without locks and caches can key on identity.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from exporter.state.storage import StoredEngine, StoredReplica
from protocol import (
    EngineCoreReadyResponse,
    EngineInput,
    InvalidPayload,
    SyncedConfig,
    decode_accepted_ready_response,
    decode_shown_ready_response,
    decode_static_labels,
    engine_input,
    shown_as_json,
    sync_inputs,
)

ReplicaKey = tuple[str, str]

_static_encoder = msgspec.json.Encoder()


class EngineReport(msgspec.Struct, frozen=True, gc=False):
    """One engine's latest ready response: the bytes as received (checked then), and when (Unix seconds).

    Only the bytes are kept: decoded, a response takes about one and a half times their memory again, and only a
    sync needs its fields (``response``). ``gc=False`` (as for ``Replica``): these hold no cycles, so the
    collector need not track one per engine.
    """

    engine: int
    received_at: float
    payload: bytes
    wire_format: str
    # Bytes of the payload shown as JSON (the listing's view keeps them): counted by ``--limits.bytes``.
    shown_bytes: int

    def response(self) -> EngineCoreReadyResponse:
        """The ready response, decoded anew from its bytes."""
        return decode_accepted_ready_response(self.payload, self.wire_format)


def engine_report(
    engine: int, received_at: float, payload: bytes, wire_format: str, shown: bytes | None = None
) -> EngineReport:
    """An engine's report of an accepted ready response, with what its JSON view will take measured once
    (``shown``: that view, when the caller has it)."""
    shown_bytes = len(shown_as_json(payload, wire_format) if shown is None else shown)
    return EngineReport(engine, received_at, payload, wire_format, shown_bytes)


class Replica(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A replica's inputs and the config synced from them; never changed, only replaced."""

    deployment: str
    name: str
    instance_id: str | None
    static_labels: dict[str, str]
    # Seconds between the heartbeats its sender promised; None for one-off pushes, which never expire.
    heartbeat_seconds: float | None
    last_seen: float
    # When last heard from on this process's monotonic clock: what expiry counts from, so that a step of
    # the wall clock neither expires live replicas nor keeps silent ones.
    seen: float
    engines: Mapping[int, EngineReport]
    synced: SyncedConfig

    @property
    def key(self) -> ReplicaKey:
        return (self.deployment, self.name)


def build_replica(
    key: ReplicaKey,
    instance_id: str | None,
    static_labels: dict[str, str],
    heartbeat_seconds: float | None,
    last_seen: float,
    engines: Mapping[int, EngineReport],
    base_labels: Mapping[str, str],
    *,
    seen: float | None = None,
    responses: Mapping[int, EngineCoreReadyResponse] | None = None,
    inputs: Mapping[int, EngineInput] | None = None,
    previous: Replica | None = None,
) -> Replica:
    """A replica with its config synced from ``engines`` over ``base_labels`` and its own static labels.

    ``seen`` (expiry's clock, see ``Replica.seen``) is now unless given. The engines' sync inputs are ``inputs``
    where the caller has them, else read from ``responses`` (decoded), else from each report's bytes. ``previous``:
    the replica this one replaces; its engines whose report this one holds keep their figures from it (see
    ``protocol.sync_inputs``). Raises the protocol's ``SyncConflict`` when the engines contradict each other.
    """
    if inputs is None:
        if responses is None:
            responses = {index: report.response() for index, report in engines.items()}
        inputs = {index: engine_input(response) for index, response in responses.items()}
    unchanged, before, kept = [], None, None
    if previous is not None:
        unchanged = [index for index, report in engines.items() if previous.engines.get(index) is report]
        before = previous.synced
        if len(unchanged) == len(engines) == len(previous.engines):  # the same reports: the same mapping object
            kept = previous.engines
    return Replica(
        deployment=key[0],
        name=key[1],
        instance_id=instance_id,
        static_labels=static_labels,
        heartbeat_seconds=heartbeat_seconds,
        last_seen=last_seen,
        seen=time.monotonic() if seen is None else seen,
        engines=MappingProxyType(dict(engines)) if kept is None else kept,
        synced=sync_inputs({**base_labels, **static_labels}, inputs, before, unchanged),
    )


def restored(stored: StoredReplica, base_labels: Mapping[str, str], seen: float) -> Replica:
    """A replica from its stored inputs, decoded and synced again (so newer sync rules apply to old data).

    ``seen``: its stored ``last_seen`` on the monotonic clock of the process that loads it.
    """
    # Checked again as they are decoded: the store may be older code's, which took inputs today's checks refuse
    # (a label name ending in a newline): those stop the start, naming the replica, rather than break /metrics.
    responses, engines = {}, {}
    try:
        for engine, row in stored.engines.items():
            responses[engine], shown = decode_shown_ready_response(row.payload, row.wire_format)
            engines[engine] = engine_report(engine, row.received_at, row.payload, row.wire_format, shown)
        # Version 1 stored typed JSON values; rendering them gives the strings vLLM shows.
        static_labels = decode_static_labels(stored.static_config)
    except InvalidPayload as error:
        raise InvalidPayload(
            error.field, f"deployment {stored.deployment!r} replica {stored.replica!r}: {error.reason}"
        ) from None
    key = (stored.deployment, stored.replica)
    return build_replica(
        key,
        stored.instance_id,
        static_labels,
        stored.heartbeat_seconds,
        stored.last_seen,
        engines,
        base_labels,
        seen=seen,
        responses=responses,
    )


def stored_replica(replica: Replica) -> StoredReplica:
    """A replica's own row: its inputs but its engines (saved one by one)."""
    return StoredReplica(
        replica.deployment,
        replica.name,
        _static_encoder.encode(replica.static_labels),
        replica.instance_id,
        replica.heartbeat_seconds,
        replica.last_seen,
    )


def stored_engine(report: EngineReport) -> StoredEngine:
    return StoredEngine(report.payload, report.wire_format, report.received_at)
