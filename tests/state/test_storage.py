"""Durability: what was acknowledged is on disk, and a file that is not ours is never touched."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from starlette.testclient import TestClient

from exporter.state.storage import PAGE_CACHE_KIB, LastSeen, SqliteStore, StorageError, StoredReplica
from tests.helpers.exposition import samples
from tests.helpers.http import MSGPACK
from tests.helpers.sqlite_file import integrity
from tests.support import fixture_bytes


def cache_config_samples(client: TestClient) -> list:
    exposition = client.get("/metrics").text
    return sorted(
        (sample.name, sorted(sample.labels.items()), sample.value)
        for name in ("cache_config_info", "cache_config_block_size", "cache_config_num_gpu_blocks",
                     "cache_config_last_update_timestamp_seconds")
        for sample in samples(exposition, name)
    )  # fmt: skip


def test_a_new_app_on_the_same_file_publishes_the_same_series(
    make_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    first = make_client()
    for name in ("dp2-rank0", "dp2-rank1"):
        assert first.post("/api/v1/deployments/dp/ready", content=fixture_bytes(name), headers=MSGPACK).is_success
    first.put("/api/v1/deployments/dp/cache-config", json={"mamba_cache_mode": "align"})
    first.post("/api/v1/deployments/old/ready?engine=1", content=fixture_bytes("minimal-pre42967"), headers=MSGPACK)
    before_series, before_state = cache_config_samples(first), first.get("/api/v1/deployments").json()
    first.__exit__(None, None, None)

    second = make_client()
    assert cache_config_samples(second) == before_series
    assert second.get("/api/v1/deployments").json() == before_state
    assert len(before_series) == 12


def test_a_restart_replaces_the_stored_engines_in_one_commit(client: TestClient, tmp_path: Path) -> None:
    for name in ("dp2-rank0", "dp2-rank1"):
        client.post("/api/v1/deployments/dp/ready", content=fixture_bytes(name), headers=MSGPACK)
    restarted = msgspec.msgpack.decode(fixture_bytes("dense-post50809"))
    restarted["instance_id"] = "second-run"
    client.post("/api/v1/deployments/dp/ready", content=msgspec.msgpack.encode(restarted), headers=MSGPACK)
    store = SqliteStore(tmp_path / "exporter.db")
    [deployment] = store.load()
    assert deployment.instance_id == "second-run"
    assert set(deployment.engines) == {0}
    store.close()
    assert integrity(tmp_path / "exporter.db") == "ok"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_foreign_sqlite_database_is_refused_and_untouched(tmp_path: Path) -> None:
    foreign = tmp_path / "other.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE invoices (id INTEGER)")
    db.close()
    digest = _digest(foreign)
    with pytest.raises(StorageError, match="another program"):
        SqliteStore(foreign)
    assert _digest(foreign) == digest


def test_a_file_that_is_not_sqlite_is_refused_and_untouched(tmp_path: Path) -> None:
    junk = tmp_path / "notes.db"
    junk.write_bytes(b"these are my notes, not a database\n" * 100)
    digest = _digest(junk)
    with pytest.raises(StorageError, match="not a database"):
        SqliteStore(junk)
    assert _digest(junk) == digest


# The tables of schema versions 1 and 2: one replica per deployment.
_OLD_TABLES = """
    CREATE TABLE deployments (name TEXT PRIMARY KEY, static_config BLOB NOT NULL, instance_id TEXT);
    CREATE TABLE engines (
        deployment TEXT NOT NULL REFERENCES deployments(name) ON DELETE CASCADE,
        engine INTEGER NOT NULL, response BLOB NOT NULL, received_at REAL NOT NULL, {wire_format}
        PRIMARY KEY (deployment, engine));
    CREATE TABLE probe (id INTEGER PRIMARY KEY CHECK (id = 1), writes INTEGER NOT NULL);
    PRAGMA application_id = 1128482136;
"""


@pytest.mark.parametrize("version", [1, 2])
def test_a_file_of_an_older_schema_is_migrated_and_keeps_its_data(
    make_client: Callable[..., TestClient], tmp_path: Path, version: int
) -> None:
    """Version 1 kept re-encoded msgpack and typed static values, version 2 the bytes and their format, both one
    replica per deployment: they load as the replica ``default``, labels rendered as vLLM renders them."""
    path = tmp_path / "exporter.db"
    wire_format = "wire_format TEXT NOT NULL DEFAULT 'msgpack'," if version == 2 else ""
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_TABLES.format(wire_format=wire_format) + f"PRAGMA user_version = {version};")
        static = msgspec.json.encode({"mamba_cache_mode": "align", "enable_prefix_caching": True})
        db.execute("INSERT INTO deployments VALUES ('old', ?, NULL)", (static,))
        db.execute(
            "INSERT INTO engines (deployment, engine, response, received_at) VALUES ('old', 0, ?, 1.5)",
            (fixture_bytes("hybrid-tp1-post50809"),),
        )
    client = make_client()
    [shown] = client.get("/api/v1/deployments").json()
    assert (shown["deployment"], shown["replica"], shown["last_seen"]) == ("old", "default", 1.5)
    assert shown["static_labels"] == {"mamba_cache_mode": "align", "enable_prefix_caching": "True"}
    assert shown["engines"][0]["wire_format"] == "msgpack"
    assert (shown["labels"]["block_size"], shown["labels"]["mamba_block_size"]) == ("1056", "1056")
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3


def test_a_checkpoint_updates_what_heartbeats_change_of_existing_replicas_only(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    try:
        with store.transaction():
            store.save_replica(StoredReplica("d", "r", b"{}", "run-1", 30.0, 1.0))
            store.save_last_seen([LastSeen("d", "r", 15.0, 2.0), LastSeen("d", "gone", 15.0, 2.0)])
        [stored] = store.load()
        assert (stored.replica, stored.heartbeat_seconds, stored.last_seen, stored.instance_id) == (
            "r",
            15.0,
            2.0,
            "run-1",
        )
    finally:
        store.close()


def test_the_store_keeps_a_small_page_cache_and_still_loads_everything(tmp_path: Path) -> None:
    """SQLite's page cache is fixed memory of the exporter's own; its rows must all come back through a small one."""
    store = SqliteStore(tmp_path / "small.db")
    rows = [StoredReplica(f"d{i}", "r", b"{}", None, None, 1.0) for i in range(3000)]
    with store.transaction():
        for row in rows:
            store.save_replica(row)
    assert store._db.execute("PRAGMA cache_size").fetchone()[0] == -PAGE_CACHE_KIB
    store.close()
    reopened = SqliteStore(tmp_path / "small.db")
    assert sorted(replica.deployment for replica in reopened.load()) == sorted(row.deployment for row in rows)
    reopened.close()
