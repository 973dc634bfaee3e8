"""The exporter's state: every deployment's inputs and synced config, kept in memory and in the store.

A mutation decodes nothing and renders nothing: it runs the sync on the new
inputs (which may refuse them), commits them to the store, and only then
swaps the in-memory deployment, so memory never shows what was not committed.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType

import msgspec

from exporter.storage import Store, StoredDeployment
from protocol import (
    CacheConfig,
    CacheConfigUpdate,
    EngineCoreReadyResponse,
    SyncedConfig,
    apply_update,
    decode_ready_response,
    encode_ready_response,
    is_set,
    render_labels,
    sync,
)

_static_encoder = msgspec.json.Encoder()
_static_decoder = msgspec.json.Decoder(CacheConfigUpdate)


class StorageUnavailable(RuntimeError):
    """A write could not be committed; nothing was changed."""


class EngineReport(msgspec.Struct, frozen=True):
    """One engine's latest ready response and when it arrived (Unix seconds)."""

    engine: int
    received_at: float
    response: EngineCoreReadyResponse


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment's inputs and the config synced from them."""

    name: str
    instance_id: str | None
    static_config: CacheConfigUpdate
    base: CacheConfig
    engines: Mapping[int, EngineReport]
    synced: SyncedConfig


class DeploymentView(msgspec.Struct, kw_only=True):
    """What the JSON API shows of a deployment."""

    deployment: str
    instance_id: str | None
    engines: list[EngineReport]
    config: CacheConfig
    labels: dict[str, str]
    max_model_len: int | None
    dp_stats_address: str | None
    distinct_values: dict[str, int]
    static_config: CacheConfigUpdate


def view(deployment: Deployment) -> DeploymentView:
    synced = deployment.synced
    return DeploymentView(
        deployment=deployment.name,
        instance_id=deployment.instance_id,
        engines=[deployment.engines[index] for index in sorted(deployment.engines)],
        config=synced.config,
        labels=render_labels(synced.config),
        max_model_len=synced.max_model_len,
        dp_stats_address=synced.dp_stats_address,
        distinct_values=synced.distinct_values,
        static_config=deployment.static_config,
    )


class ExporterState:
    """All deployments; thread-safe, one writer at a time, readers take immutable snapshots."""

    def __init__(self, store: Store, base: CacheConfig, clock: Callable[[], float]) -> None:
        self._store = store
        self._base = base
        self._clock = clock
        self._lock = threading.Lock()
        self._deployments: dict[str, Deployment] = {}
        for stored in store.load():
            deployment = self._restore(stored)
            self._deployments[deployment.name] = deployment

    def _restore(self, stored: StoredDeployment) -> Deployment:
        engines = {
            engine: EngineReport(engine, received_at, decode_ready_response(response))
            for engine, (response, received_at) in stored.engines.items()
        }
        return self._build(stored.name, stored.instance_id, _static_decoder.decode(stored.static_config), engines)

    def _build(
        self,
        name: str,
        instance_id: str | None,
        static_config: CacheConfigUpdate,
        engines: Mapping[int, EngineReport],
    ) -> Deployment:
        base = apply_update(self._base, static_config)
        synced = sync(base, {index: report.response for index, report in engines.items()})
        return Deployment(
            name=name,
            instance_id=instance_id,
            static_config=static_config,
            base=base,
            engines=MappingProxyType(dict(engines)),
            synced=synced,
        )

    def snapshot(self) -> list[Deployment]:
        """Every deployment, sorted by name; safe to read while writers go on."""
        deployments = self._deployments
        return [deployments[name] for name in sorted(deployments)]

    def get(self, name: str) -> Deployment | None:
        return self._deployments.get(name)

    def apply_ready(self, name: str, engine: int, response: EngineCoreReadyResponse) -> Deployment:
        """Take one engine's ready response; a new ``instance_id`` drops the previous run's engines.

        Raises ``SyncConflict`` (nothing changed) when the engines would contradict each other.
        """
        with self._lock:
            current = self._deployments.get(name)
            static_config = current.static_config if current else CacheConfigUpdate()
            engines = dict(current.engines) if current else {}
            instance_id = current.instance_id if current else None
            restarted = is_set(response.instance_id) and response.instance_id != instance_id
            if restarted:
                engines.clear()
                instance_id = response.instance_id
            report = EngineReport(engine, self._clock(), response)
            engines[engine] = report
            updated = self._build(name, instance_id, static_config, engines)
            self._commit(
                lambda: self._store.save_ready(
                    name,
                    _static_encoder.encode(static_config),
                    instance_id,
                    engine,
                    encode_ready_response(response),
                    report.received_at,
                    restarted,
                ),
            )
            return self._swap(updated)

    def set_static_config(self, name: str, static_config: CacheConfigUpdate) -> Deployment:
        """Replace a deployment's static config (creating the deployment if needed)."""
        with self._lock:
            current = self._deployments.get(name)
            instance_id = current.instance_id if current else None
            updated = self._build(name, instance_id, static_config, current.engines if current else {})
            self._commit(
                lambda: self._store.save_static_config(name, _static_encoder.encode(static_config), instance_id)
            )
            return self._swap(updated)

    def delete_deployment(self, name: str) -> bool:
        with self._lock:
            if name not in self._deployments:
                return False
            self._commit(lambda: self._store.delete_deployment(name))
            deployments = dict(self._deployments)
            del deployments[name]
            self._deployments = deployments
            return True

    def delete_engine(self, name: str, engine: int) -> Deployment | None:
        """Forget one engine; ``None`` when there was no such engine."""
        with self._lock:
            current = self._deployments.get(name)
            if current is None or engine not in current.engines:
                return None
            engines = {index: report for index, report in current.engines.items() if index != engine}
            updated = self._build(name, current.instance_id, current.static_config, engines)
            self._commit(lambda: self._store.delete_engine(name, engine))
            return self._swap(updated)

    def _commit(self, write: Callable[[], None]) -> None:
        try:
            write()
        except sqlite3.Error as error:
            raise StorageUnavailable(str(error)) from None

    def _swap(self, deployment: Deployment) -> Deployment:
        # Copy-on-write: a scrape iterating the previous dict never sees a half-applied change.
        self._deployments = {**self._deployments, deployment.name: deployment}
        return deployment
