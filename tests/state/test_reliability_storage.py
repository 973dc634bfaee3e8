"""Storage faults under the real server: full disk, a file system turned read-only, a locked database,
and damaged or foreign files at start-up.

The mounts need root; without it (or without mount support) these tests skip, but fail in CI.
While storage fails: ingest answers 503 problem+json with Retry-After, /metrics keeps serving the last
good state with ``cache_config_exporter_storage_healthy 0``, and ``/-/ready`` answers 503 naming the
fault; once the fault is gone the exporter recovers by itself.
"""

from __future__ import annotations

import hashlib
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from exporter.config.settings import Settings
from exporter.errors import StorageUnavailable
from exporter.server.app import create_app
from exporter.state.exporter_state import ExporterState
from exporter.state.storage import SqliteStore, StoredEngine, StoredReplica
from protocol import decode_ready_response
from tests.helpers.disk import ext4, fill, tmpfs
from tests.helpers.exposition import cache_config_samples, scrape, single_value
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, Reply, request
from tests.helpers.processes import children, connection_owner
from tests.helpers.ready_responses import engine_blocks, ready_response
from tests.helpers.sqlite_file import integrity
from tests.support import ExporterProcess, fixture_bytes, wait_until

HEALTHY = "cache_config_exporter_storage_healthy"


def ingest(exporter: ExporterProcess, deployment: str, value: int) -> Reply:
    return request(
        exporter.url, "POST", f"/api/v1/deployments/{deployment}/ready", ready_response(0, value, 1), MSGPACK
    )


def good_state(exporter: ExporterProcess) -> tuple[list, bytes]:
    """Two acknowledged deployments, and what /metrics and the JSON API show of them."""
    for value, deployment in enumerate(("kept-a", "kept-b"), 101):
        assert ingest(exporter, deployment, value).status == 200
    return cache_config_samples(scrape(exporter.url)), request(exporter.url, "GET", "/api/v1/deployments").body


def check_failing(
    exporter: ExporterProcess, before: tuple[list, bytes], words: tuple[str, ...], readiness: bool = True
) -> dict[str, object]:
    """What a storage fault must look like from outside; the figures of it."""
    started = time.monotonic()
    refused = ingest(exporter, "during-fault", 999)
    seconds = time.monotonic() - started
    problem = refused.problem(503)
    assert refused.headers["retry-after"] == "1"
    assert problem["type"] == "urn:cache-config-exporter:problem:storage_unavailable"
    assert any(word in problem["detail"] for word in words), problem
    assert seconds < 5, f"a storage fault took {seconds:.1f} s to answer"
    exposition = scrape(exporter.url)
    assert cache_config_samples(exposition) == before[0], "/metrics no longer shows the last good state"
    assert request(exporter.url, "GET", "/api/v1/deployments").body == before[1]
    if readiness:
        assert single_value(exposition, HEALTHY) == 0
        ready = request(exporter.url, "GET", "/-/ready")
        assert ready.status == 503 and any(word in ready.body.decode() for word in words), ready
    return {"fault_answer": problem["detail"], "fault_answer_seconds": round(seconds, 2)}


def check_recovered(exporter: ExporterProcess, before: tuple[list, bytes]) -> float:
    """The exporter notices by itself that the fault is gone, and takes writes again; seconds it took."""
    started = time.monotonic()
    wait_until(lambda: request(exporter.url, "GET", "/-/ready").status == 200, timeout=15)
    took = time.monotonic() - started
    assert single_value(scrape(exporter.url), HEALTHY) == 1
    assert cache_config_samples(scrape(exporter.url)) == before[0], "the refused change showed up"
    assert ingest(exporter, "after-fault", 777).status == 200
    stored = engine_blocks(request(exporter.url, "GET", "/api/v1/deployments").json())
    assert stored == {("kept-a", 0): 101, ("kept-b", 0): 102, ("after-fault", 0): 777}
    return round(took, 2)


def prove_fault(
    exporter: ExporterProcess,
    inject: Callable[[], object],
    remove: Callable[[], object],
    words: tuple[str, ...],
    workers: int = 1,
) -> dict[str, object]:
    """Acknowledged state, the fault, how it shows, the fault gone, recovery, a clean stop; the figures.

    With several workers readiness is each worker's own (one that did not try to write is ready), so
    ``/-/ready`` is checked with one worker only.
    """
    try:
        before = good_state(exporter)
        if workers > 1:
            scraped_by_every_worker(exporter)
        inject()
        try:
            figures = check_failing(exporter, before, words, readiness=workers == 1)
            for _ in range(3):  # every scrape, on any worker, still shows the last good state
                assert cache_config_samples(scrape(exporter.url)) == before[0]
        finally:
            remove()
        figures["recovery_seconds"] = check_recovered(exporter, before)
        assert exporter.stop() == 0
        figures["integrity"] = integrity(exporter.storage)
    finally:
        exporter.stop()
    assert figures["integrity"] == "ok", figures
    return figures


def test_a_full_disk_is_a_503_and_recovers_by_itself(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with tmpfs(tmp_path / "small", "2m") as mount:
        exporter = start_exporter(storage=mount / "exporter.db")
        filler = mount / "filler"
        figures = prove_fault(exporter, lambda: fill(filler), filler.unlink, ("full",))
    record(record_property, "storage_full_disk", **figures)


def test_a_file_system_turned_read_only_is_a_503_and_nothing_acknowledged_is_lost(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Linux refuses ``mount -o remount,ro`` while SQLite holds its files open for writing (EBUSY), so a
    running exporter's storage turns read-only only the way a failing disk makes it: an ext4 error with
    ``errors=remount-ro``. The kernel keeps such a file system read-only until it is unmounted, so recovery
    here is the operator's: stop (exit 0), repair, mount, start; every acknowledged response is still there."""
    with ext4(tmp_path / "volume.img", tmp_path / "volume") as volume:
        exporter = start_exporter(storage=volume.mount_point / "exporter.db")

        def repair() -> None:
            assert exporter.stop() == 0
            volume.repair()
            exporter.start()

        figures = prove_fault(exporter, volume.fail, repair, ("I/O", "readonly", "read-only"))
    record(record_property, "storage_read_only", **figures)


def scraped_by_every_worker(exporter: ExporterProcess) -> None:
    """Scrape until each worker process has answered once, so each has loaded the current state."""
    assert exporter.process is not None
    workers = children(exporter.process.pid)
    seen: set[object] = set()

    def scrape_once() -> bool:
        reply = request(
            exporter.url, "GET", "/metrics", peer=lambda port: connection_owner(exporter.port, port, workers)
        )
        assert reply.status == 200
        seen.add(reply.peer)
        return len(seen - {None}) >= 2

    wait_until(scrape_once, timeout=30, interval=0)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_locked_database_is_a_503_and_recovers_by_itself(
    start_exporter: Callable[..., ExporterProcess], workers: int, record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.workers", str(workers))
    holder = sqlite3.connect(exporter.storage, isolation_level=None, timeout=0)
    try:
        figures = prove_fault(
            exporter,
            lambda: holder.execute("BEGIN EXCLUSIVE"),
            lambda: holder.execute("ROLLBACK"),
            ("locked",),
            workers,
        )
    finally:
        holder.close()
    record(record_property, f"storage_locked_workers_{workers}", workers=workers, **figures)


# Damaged and foreign files at start-up -------------------------------------------------------------------


def exporter_database(path: Path) -> None:
    """A real exporter database with a few deployments, closed cleanly."""
    with TestClient(create_app(Settings(storage_path=path), registry=CollectorRegistry())) as client:
        for index in range(40):
            body = ready_response(0, index + 1, 1)
            assert client.post(f"/api/v1/deployments/d{index}/ready", content=body, headers=MSGPACK).is_success


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def pages_overwritten(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for page in range(4096, len(data), 4096):
        data[page : page + 64] = b"\xa5" * 64
    path.write_bytes(bytes(data))


def with_sql(*statements: str) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        db = sqlite3.connect(path, isolation_level=None)
        for statement in statements:
            db.execute(statement)
        db.close()

    return change


def foreign(path: Path) -> None:
    path.unlink()
    with_sql("CREATE TABLE invoices (id INTEGER, amount REAL)", "INSERT INTO invoices VALUES (1, 9.5)")(path)


def sqlite_header_then_garbage(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\0" + bytes(range(256)) * 64)


DAMAGED = {
    "truncated exporter database": (truncated, "malformed"),
    "exporter database with overwritten pages": (pages_overwritten, "damaged"),
    "exporter database with an undecodable response": (
        with_sql("UPDATE engines SET response = x'c1' WHERE deployment = 'd7'"),
        "MessagePack",
    ),
    "exporter database of a newer schema": (with_sql("PRAGMA user_version = 99"), "newer"),
    "another program's database": (foreign, "another program"),
    "another program's empty database": (with_sql("DELETE FROM engines", "PRAGMA application_id = 7"), "another"),
    "SQLite header, then garbage": (sqlite_header_then_garbage, "not a database"),
    "an exporter log file": (lambda path: path.write_bytes(fixture_bytes("dp2-rank0", "json") * 50), "not a database"),
}


def label_name_an_older_version_took(path: Path) -> None:
    """A label name ending in a newline, as versions whose name pattern ended in ``$`` stored it."""
    db = sqlite3.connect(path, isolation_level=None)
    [[response]] = db.execute("SELECT response FROM engines WHERE deployment = 'd3'").fetchall()
    document = msgspec.msgpack.decode(response)
    document["cache_config_info"] = {**(document.get("cache_config_info") or {}), "evil\n": "x"}
    db.execute("UPDATE engines SET response = ? WHERE deployment = 'd3'", (msgspec.msgpack.encode(document),))
    db.close()


DAMAGED["a response label name an older version took"] = (label_name_an_older_version_took, "'d3'")
EVIL_STATIC = msgspec.json.encode({"evil\n": "x"}).decode()
DAMAGED["a static label name an older version took"] = (
    with_sql(f"UPDATE replicas SET static_config = '{EVIL_STATIC}' WHERE deployment = 'd5'"),
    "'d5'",
)


def digest(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_or_foreign_file_stops_start_up_and_is_left_as_it_was(tmp_path: Path, damage: str) -> None:
    storage = tmp_path / "store" / "exporter.db"
    storage.parent.mkdir()
    exporter_database(storage)
    change, reason = DAMAGED[damage]
    change(storage)
    before = digest(storage.parent)
    result = serve_once(storage)
    assert result.returncode == 2, result.stderr
    [message] = result.stderr.strip().splitlines()
    assert message.startswith("cache-config-exporter: ") and str(storage) in message and reason in message, message
    assert "Uvicorn running" not in result.stderr + result.stdout
    assert digest(storage.parent) == before, "the file (or its directory) was changed"


def serve_once(storage: Path) -> subprocess.CompletedProcess[str]:
    """``serve`` on ``storage``, expected to stop at start-up."""
    command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(storage)]
    return subprocess.run(
        [*command, "--web.listen-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_read_only_store_at_start_up_stops_it_with_a_message(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """Unwritable from the start (a volume mounted read-only): refuse with the reason, change nothing;
    the same file starts normally once it is writable."""
    with tmpfs(tmp_path / "volume", "4m") as mount:
        storage = mount / "exporter.db"
        exporter_database(storage)
        before = digest(mount)
        assert run_mount("remount,ro", mount).returncode == 0
        try:
            result = serve_once(storage)
        finally:
            assert run_mount("remount,rw", mount).returncode == 0
        assert result.returncode == 2, result.stderr
        assert str(storage) in result.stderr and "read-only" in result.stderr, result.stderr
        assert digest(mount) == before
        exporter = start_exporter(storage=storage)
        assert len(request(exporter.url, "GET", "/api/v1/deployments").json()) == 40
        assert exporter.stop() == 0


def run_mount(options: str, mount_point: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", "-o", options, str(mount_point)], capture_output=True, text=True, check=False)


def test_sigkill_during_a_fault_leaves_a_sound_store(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    """A crash while writes are being refused loses nothing that was acknowledged before."""
    exporter = start_exporter()
    before = good_state(exporter)
    holder = sqlite3.connect(exporter.storage, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        assert ingest(exporter, "during-fault", 999).status == 503
        exporter.stop(signal.SIGKILL)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    exporter.start()
    assert cache_config_samples(scrape(exporter.url)) == before[0]
    assert exporter.stop() == 0
    assert integrity(exporter.storage) == "ok"
    record(record_property, "storage_sigkill_during_fault", acknowledged_but_lost=0, integrity="ok")


class FullDisk(SqliteStore):
    """A store on a full disk: transactions begin and commit, but no row can be written."""

    full = False

    def _refuse(self) -> None:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")

    def save_replica(self, stored: StoredReplica) -> None:
        self._refuse()
        super().save_replica(stored)

    def save_engine(self, deployment: str, replica: str, engine: int, stored: StoredEngine) -> None:
        self._refuse()
        super().save_engine(deployment, replica, engine, stored)

    def check_writable(self) -> None:
        self._refuse()
        super().check_writable()


def test_reads_between_failed_writes_do_not_report_the_store_healthy(tmp_path: Path) -> None:
    """With several workers every read first commits an empty transaction to see the others' commits; on a
    full disk that succeeds, and must not count as recovery (``/-/ready`` would flap)."""
    store = FullDisk(tmp_path / "full.db")
    state = ExporterState(store, {}, time.time)
    payload = ready_response(0, 1, 1)
    response = decode_ready_response(payload)
    try:
        store.full = True
        with pytest.raises(StorageUnavailable):
            state.apply_ready(("refused", "default"), 0, response, payload, "msgpack").result(timeout=10)
        for _ in range(3):
            state.refresh().result(timeout=10)
            assert state.storage_error == "database or disk is full"
        store.full = False
        wait_until(lambda: state.storage_error is None, timeout=10)
        assert state.apply_ready(("accepted", "default"), 0, response, payload, "msgpack").result(timeout=10)
    finally:
        state.close()
        store.close()
