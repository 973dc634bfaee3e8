"""Durable storage of what the exporter was told: the ``Store`` interface, and SQLite behind it.

Only inputs are stored (each replica's static labels, instance, heartbeat
interval and last-seen time, each engine's latest ready response as the bytes
received, with their wire format);
the synced config is derived from them again on load, so a fix to the sync rules
or a newer release table applies to stored data too, and no key an engine sent
is ever lost.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from exporter.errors import StorageUnavailable

# "CCEX": marks a file as ours, so a foreign SQLite file is never written to.
APPLICATION_ID = 0x43434558
SCHEMA_VERSION = 3
# How long a write waits for another process's transaction before it counts as a storage fault.
LOCK_TIMEOUT_SECONDS = 1.0
# SQLite's page cache, in KiB (its default is 2 MiB): the file is read whole only at start, then rows are written
# and updated; the pages a write needs again come from the OS's cache of the file. A fleet keeps less memory an
# engine with it (docs/PERFORMANCE.md, "Memory per engine").
PAGE_CACHE_KIB = 256

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS replicas (
        deployment TEXT NOT NULL,
        replica TEXT NOT NULL,
        static_config BLOB NOT NULL,
        instance_id TEXT,
        heartbeat_seconds REAL,
        last_seen REAL NOT NULL,
        PRIMARY KEY (deployment, replica)
    )""",
    """CREATE TABLE IF NOT EXISTS engines (
        deployment TEXT NOT NULL,
        replica TEXT NOT NULL,
        engine INTEGER NOT NULL,
        response BLOB NOT NULL,
        received_at REAL NOT NULL,
        wire_format TEXT NOT NULL,
        PRIMARY KEY (deployment, replica, engine),
        FOREIGN KEY (deployment, replica) REFERENCES replicas (deployment, replica) ON DELETE CASCADE
    )""",
    "CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY CHECK (id = 1), writes INTEGER NOT NULL)",
)
# From each older schema version to the next. Version 1 kept re-encoded msgpack only; version 2 kept
# the bytes received with their wire format, one replica per deployment; 3 has replicas, and version 2's
# rows become the replica "default", seen when last received.
_MIGRATIONS = {
    1: ("ALTER TABLE engines ADD COLUMN wire_format TEXT NOT NULL DEFAULT 'msgpack'",),
    2: (
        "ALTER TABLE engines RENAME TO engines_v2",
        "ALTER TABLE deployments RENAME TO deployments_v2",
        *_SCHEMA[:2],
        "INSERT INTO replicas SELECT name, 'default', static_config, instance_id, NULL, "
        "COALESCE((SELECT max(received_at) FROM engines_v2 WHERE deployment = name), 0) FROM deployments_v2",
        "INSERT INTO engines SELECT deployment, 'default', engine, response, received_at, wire_format FROM engines_v2",
        "DROP TABLE engines_v2",
        "DROP TABLE deployments_v2",
    ),
}


class StorageError(RuntimeError):
    """The store cannot be opened; the message says why."""


@contextmanager
def _unavailable_on_error() -> Iterator[None]:
    """SQLite's errors as the store's: the layers above never see ``sqlite3``."""
    try:
        yield
    except sqlite3.Error as error:
        raise StorageUnavailable(str(error)) from None


@dataclass
class StoredEngine:
    """One engine's ready response as received."""

    payload: bytes
    wire_format: str
    received_at: float


@dataclass
class StoredReplica:
    """One replica as stored: raw inputs, not yet decoded."""

    deployment: str
    replica: str
    static_config: bytes
    instance_id: str | None
    heartbeat_seconds: float | None
    last_seen: float
    engines: dict[int, StoredEngine] = field(default_factory=dict)


class LastSeen(NamedTuple):
    """What a heartbeat changes of a replica's row."""

    deployment: str
    replica: str
    heartbeat_seconds: float | None
    last_seen: float


class Store(Protocol):
    """What the writer needs of a store. Every failure to read or write is ``StorageUnavailable``."""

    path: Path

    def transaction(self) -> AbstractContextManager[None]: ...
    def read_transaction(self) -> AbstractContextManager[None]: ...
    def changed_elsewhere(self) -> bool: ...
    def load(self) -> list[StoredReplica]: ...
    def save_replica(self, stored: StoredReplica) -> None: ...
    def save_engine(self, deployment: str, replica: str, engine: int, stored: StoredEngine) -> None: ...
    def save_last_seen(self, rows: Iterable[LastSeen]) -> None: ...
    def delete_engines(self, deployment: str, replica: str) -> None: ...
    def delete_replica(self, deployment: str, replica: str) -> None: ...
    def delete_engine(self, deployment: str, replica: str, engine: int) -> None: ...
    def check_writable(self) -> None: ...
    def close(self) -> None: ...


class SqliteStore:
    """A single SQLite file in WAL mode with ``synchronous=FULL``: a commit survives power loss.

    Writes happen inside ``transaction()``; several processes may share one file,
    and ``changed_elsewhere()`` tells when another one has committed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not path.is_file():  # a device, FIFO or directory: SQLite's error names none
                raise StorageError(f"cannot open storage {path}: it is not a regular file")
            self._db = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=LOCK_TIMEOUT_SECONDS
            )
            version = self._check_foreign()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
            if version != SCHEMA_VERSION:  # a file with the whole schema is not written before its contents are loaded
                with self.transaction():
                    if version == 0:
                        for statement in _SCHEMA:
                            self._db.execute(statement)
                        self._db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                    else:
                        for older in range(version, SCHEMA_VERSION):
                            for statement in _MIGRATIONS[older]:
                                self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._data_version = self._read_data_version()
        except (sqlite3.Error, OSError, StorageUnavailable) as error:  # a migration's commit on a full disk too
            hint = "" if os.access(path.parent, os.W_OK) else " (its directory is read-only)"
            raise StorageError(f"cannot open storage {path}: {error}{hint}") from None

    def _check_foreign(self) -> int:
        """Refuse a file that is not SQLite, is damaged, or is another program's SQLite database.

        The schema version of the file: 0 for a new one, ``SCHEMA_VERSION`` when it is current.
        """
        application_id = self._db.execute("PRAGMA application_id").fetchone()[0]
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master")}
        if application_id == APPLICATION_ID:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StorageError(f"{self.path} has schema version {version}, newer than this exporter's")
            # Checked before the first write: a damaged file of ours is refused as it is, never rewritten.
            problems = " ".join(" ".join(row[0] for row in self._db.execute("PRAGMA quick_check(3)")).split())
            if problems != "ok":
                raise StorageError(f"{self.path} is damaged ({problems}); refusing to touch it")
            return version if {"engines", "probe"} <= tables else 0
        if application_id != 0 or tables:
            raise StorageError(f"{self.path} is a database of another program; refusing to touch it")
        return 0

    def _read_data_version(self) -> int:
        with _unavailable_on_error():
            return self._db.execute("PRAGMA data_version").fetchone()[0]

    def changed_elsewhere(self) -> bool:
        """True when another connection (another worker process) committed since the last ``load()``."""
        return self._read_data_version() != self._data_version

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One immediate transaction: committed on success, rolled back on any error."""
        with self._transaction("BEGIN IMMEDIATE"):
            yield

    @contextmanager
    def read_transaction(self) -> Iterator[None]:
        """A transaction that only reads: it never waits for another process's write lock (WAL)."""
        with self._transaction("BEGIN DEFERRED"):
            yield

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[None]:
        with _unavailable_on_error():
            self._db.execute(begin)
            try:
                yield
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def load(self) -> list[StoredReplica]:
        """Every stored replica with its engines."""
        with _unavailable_on_error():
            return self._load()

    def _load(self) -> list[StoredReplica]:
        replicas = {
            (row[0], row[1]): StoredReplica(*row)
            for row in self._db.execute(
                "SELECT deployment, replica, static_config, instance_id, heartbeat_seconds, last_seen FROM replicas "
                "ORDER BY deployment, replica"
            )
        }
        for deployment, replica, engine, payload, wire_format, received_at in self._db.execute(
            "SELECT deployment, replica, engine, response, wire_format, received_at FROM engines"
        ):
            replicas[deployment, replica].engines[engine] = StoredEngine(payload, wire_format, received_at)
        self._data_version = self._read_data_version()
        return list(replicas.values())

    def save_replica(self, stored: StoredReplica) -> None:
        """Insert or update a replica's own row (its engines are saved one by one)."""
        self._db.execute(
            "INSERT INTO replicas (deployment, replica, static_config, instance_id, heartbeat_seconds, last_seen) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(deployment, replica) DO UPDATE SET "
            "static_config = excluded.static_config, instance_id = excluded.instance_id, "
            "heartbeat_seconds = excluded.heartbeat_seconds, last_seen = excluded.last_seen",
            (stored.deployment, stored.replica, stored.static_config, stored.instance_id,
             stored.heartbeat_seconds, stored.last_seen),
        )  # fmt: skip

    def save_engine(self, deployment: str, replica: str, engine: int, stored: StoredEngine) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO engines (deployment, replica, engine, response, wire_format, received_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (deployment, replica, engine, stored.payload, stored.wire_format, stored.received_at),
        )

    def save_last_seen(self, rows: Iterable[LastSeen]) -> None:
        """Update what heartbeats change of existing replicas, many at once (a checkpoint); absent ones stay absent."""
        self._db.executemany(
            "UPDATE replicas SET heartbeat_seconds = ?, last_seen = ? WHERE deployment = ? AND replica = ?",
            ((row.heartbeat_seconds, row.last_seen, row.deployment, row.replica) for row in rows),
        )

    def delete_engines(self, deployment: str, replica: str) -> None:
        self._db.execute("DELETE FROM engines WHERE deployment = ? AND replica = ?", (deployment, replica))

    def delete_replica(self, deployment: str, replica: str) -> None:
        self._db.execute("DELETE FROM replicas WHERE deployment = ? AND replica = ?", (deployment, replica))

    def delete_engine(self, deployment: str, replica: str, engine: int) -> None:
        self._db.execute(
            "DELETE FROM engines WHERE deployment = ? AND replica = ? AND engine = ?", (deployment, replica, engine)
        )

    def check_writable(self) -> None:
        """Write one row: proves the disk takes writes again after a fault."""
        self._db.execute(
            "INSERT INTO probe (id, writes) VALUES (1, 1) ON CONFLICT(id) DO UPDATE SET writes = writes + 1"
        )

    def close(self) -> None:
        self._db.close()
