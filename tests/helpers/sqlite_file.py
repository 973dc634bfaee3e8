"""Read-only looks into the exporter's SQLite file, as a test checks what was (not) stored."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path


def read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot change the file."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def integrity(path: Path) -> str:
    """``PRAGMA integrity_check`` of the file, opened read-only: ``"ok"`` when sound."""
    with closing(read_only(path)) as db:
        return "; ".join(row[0] for row in db.execute("PRAGMA integrity_check"))


def rows(db: sqlite3.Connection) -> tuple[list[tuple], list[tuple]]:
    """What the store holds, every column of every row in a fixed order (a logical dump, not the bytes)."""
    replicas = db.execute(
        "SELECT deployment, replica, static_config, instance_id, heartbeat_seconds, last_seen FROM replicas "
        "ORDER BY deployment, replica"
    ).fetchall()
    engines = db.execute(
        "SELECT deployment, replica, engine, response, wire_format, received_at FROM engines "
        "ORDER BY deployment, replica, engine"
    ).fetchall()
    return replicas, engines
