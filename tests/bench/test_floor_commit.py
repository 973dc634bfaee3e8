"""The durable ingest's floor (``bench/floor_server.py --commit-per-post``): each POST or PUT is a row committed
before its 200, with the exporter's own pragmas, kept through a SIGKILL; and the bench report holds the exporter's
ingest rate against it beside the bare floor's ratio."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

from bench import report
from bench.floor_server import DURABLE_PRAGMAS
from bench.procs import HOST, floor_server
from exporter.state import storage

POSTS = 24


def _rows(database: Path) -> list[tuple[bytes, bytes]]:
    """The floor's rows, read on a connection of their own (so only what it committed)."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        return db.execute("SELECT path, body FROM posts ORDER BY id").fetchall()


def _answer(connection: http.client.HTTPConnection, method: str, path: str, body: bytes = b"") -> bytes:
    connection.request(method, path, body=body)
    response = connection.getresponse()
    content = response.read()
    assert response.status == 200
    return content


def test_each_post_and_put_is_committed_before_its_200_and_survives_a_sigkill(tmp_path: Path) -> None:
    scrape, database = tmp_path / "scrape.txt", tmp_path / "floor.db"
    scrape.write_bytes(b"up 1\n")
    sent = [(f"/api/v1/deployments/d{k:02d}/ready".encode(), f"ready {k}".encode() * (k + 1)) for k in range(POSTS)]
    with floor_server(scrape, tmp_path, "--commit-per-post", str(database), name="floor-commit") as floor:
        connection = http.client.HTTPConnection(HOST, floor.port, timeout=10)
        try:
            for k, (path, body) in enumerate(sent):
                _answer(connection, "PUT" if k % 3 == 0 else "POST", path.decode(), body)
                # The 200 came after the commit: another connection already sees the row.
                assert len(_rows(database)) == k + 1
            assert _answer(connection, "GET", "/metrics") == b"up 1\n"
        finally:
            connection.close()
        os.killpg(floor.pid, signal.SIGKILL)
        assert floor.process is not None and floor.process.wait(timeout=30) == -signal.SIGKILL
    # A GET is not stored; every acknowledged POST and PUT is, as sent, after the floor died without closing.
    assert _rows(database) == sent
    with contextlib.closing(sqlite3.connect(database)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_the_floor_commits_with_the_exporters_journal_mode_and_synchronous_setting() -> None:
    source = Path(storage.__file__).read_text()
    assert [pragma for pragma in DURABLE_PRAGMAS if f'"{pragma}"' not in source] == []
    assert {pragma.split("=")[0] for pragma in DURABLE_PRAGMAS} == {"PRAGMA journal_mode", "PRAGMA synchronous"}


def _wrk_run(rate: float) -> dict[str, Any]:
    return {"rate": rate, "requests": int(2 * rate), "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0,
            "exporter_cpu_seconds": 0.5, "other_cpu_share": 0.0, "steal_share": 0.0}  # fmt: skip


def _results(ingest: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A run's JSON at 1,000 engines with only the ingest figures given, as ``report.render`` reads it."""
    meta = {
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"nproc": 2, "cpu": "test", "memory_gib": 1.0, "kernel": "test"},
        "versions": {"python": "3.11", "exporter": "0", "exporter_commit": "test", "pushgateway": "-",
                     "wrk": "wrk", "prometheus_client": "0"},
        "settings": {"pushgateway": "-", "wrk": "1 thread, 2 s per run"},
    }  # fmt: skip
    results = {"meta": meta, "engines": {"1000": {"scrape_body_bytes": 1000, "ingest": ingest}}}
    results["targets"] = [target.as_dict() for target in report.targets(results)]
    return results


def _ingest_row(printed: str) -> dict[str, str]:
    """The ingest table's row at 1,000 engines, cell by column name."""
    lines = printed.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("| engines | exporter 1 conn /s |"))
    header, row = (line.strip("|").split("|") for line in (lines[start], lines[start + 2]))
    return {name.strip(): cell.strip() for name, cell in zip(header, row, strict=True)}


def test_the_report_shows_the_ingest_rate_against_the_commit_floor_beside_the_bare_floor() -> None:
    rates = {"exporter_1": 900.0, "exporter_8": 2000.0, "floor_1": 9000.0, "floor_8": 12000.0,
             "floor_commit_1": 300.0, "floor_commit_8": 400.0}  # fmt: skip
    ingest = {name: _wrk_run(rate) for name, rate in rates.items()}
    row = _ingest_row(report.render(_results(ingest)))
    assert row["engines"] == "1,000"
    assert (row["floor POST+commit 1 conn /s"], row["floor POST+commit 8 conns /s"]) == ("300", "400")
    assert (row["1 conn / floor"], row["1 conn / commit floor"]) == ("0.10", "3.00")
    assert row["8 conns / commit floor 8 conns"] == "5.00"
    names = list(row)
    assert names.index("1 conn / commit floor") == names.index("1 conn / floor") + 1
    # A run from before the commit floor still prints, with its cells empty.
    older = _ingest_row(report.render(_results({k: v for k, v in ingest.items() if "commit" not in k})))
    assert (older["1 conn / floor"], older["1 conn / commit floor"]) == ("0.10", "-")
