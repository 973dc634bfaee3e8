"""The ``cache-config-exporter`` command as a user runs it: a subprocess against real exporter processes."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.disk import fill, tmpfs
from tests.support import FIXTURES, ExporterProcess

REPOSITORY = Path(__file__).resolve().parents[2]
HYBRID = FIXTURES / "hybrid-tp1-post50809.msgpack"


def run_cli(*args: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    """The command, with no ``CACHE_CONFIG_EXPORTER_*`` variable but those in ``env``."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
    done = subprocess.run(
        [sys.executable, "-m", "exporter", *args],
        cwd=REPOSITORY, input=stdin, capture_output=True, timeout=60, env={**environ, **(env or {})},
    )  # fmt: skip
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def replica_state(exporter: ExporterProcess, deployment: str, replica: str = "default") -> dict[str, object]:
    url = f"{exporter.url}/api/v1/deployments/{deployment}?replica={replica}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def test_push_prints_the_synced_block_sizes_of_msgpack_json_and_stdin(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter()
    pushed = run_cli("push", str(HYBRID), "--url", exporter.url, "--deployment", "qwen")
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout == "deployment qwen: 1 engine(s), block_size=1056 mamba_block_size=1056 num_gpu_blocks=1997\n"

    # The second engine of a data-parallel pair, as JSON: the deployment's blocks are both engines'.
    run_cli("push", str(FIXTURES / "dp2-rank0.msgpack"), "--url", exporter.url, "--deployment", "dp")
    pushed = run_cli("push", str(FIXTURES / "dp2-rank1.json"), "--url", exporter.url, "--deployment", "dp")
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.startswith("deployment dp: 2 engine(s), ") and "num_gpu_blocks=3994" in pushed.stdout

    piped = (FIXTURES / "hybrid-tp1-post50809.json").read_bytes()
    pushed = run_cli("push", "-", "--format", "json", "--url", exporter.url, "--deployment", "qwen-json", stdin=piped)
    assert pushed.returncode == 0, pushed.stderr
    assert "block_size=1056 mamba_block_size=1056" in pushed.stdout

    old = run_cli("push", str(FIXTURES / "minimal-pre42967.msgpack"), "--url", exporter.url, "--engine", "4")
    assert old.returncode == 0, old.stderr
    assert [engine["engine"] for engine in replica_state(exporter, "default")["engines"]] == [4]


def test_push_takes_its_flags_from_the_environment_and_reaches_every_exporter_of_a_list(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """``CACHE_CONFIG_EXPORTER_URL`` may list an HA pair, as for the plugin: push sends to each."""
    pair = [start_exporter(storage=tmp_path / f"{name}.db") for name in ("a", "b")]
    env = {
        "CACHE_CONFIG_EXPORTER_URL": f"{pair[0].url}, {pair[1].url}",
        "CACHE_CONFIG_EXPORTER_DEPLOYMENT": "team/qwen",
        "CACHE_CONFIG_EXPORTER_REPLICA": "gpu-3:8000",
    }
    pushed = run_cli("push", str(HYBRID), env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert [line.split(": deployment")[0] for line in pushed.stdout.splitlines()] == [pair[0].url, pair[1].url]
    for exporter in pair:
        assert replica_state(exporter, "team/qwen", "gpu-3:8000")["labels"]["block_size"] == "1056"


def test_push_reports_a_refusal_with_its_field_and_an_unreachable_exporter(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    exporter = start_exporter()
    junk = tmp_path / "junk.json"
    junk.write_text('{"max_model_len": 0, "num_gpu_blocks": 1}')
    refused = run_cli("push", str(junk), "--url", exporter.url)
    assert refused.returncode == 1
    assert refused.stderr.startswith("cache-config-exporter push: HTTP 422: ")
    assert "(field $.max_model_len)" in refused.stderr

    exporter.stop()
    unreachable = run_cli("push", str(HYBRID), "--url", exporter.url, "--timeout", "2")
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith(f"cache-config-exporter push: cannot reach {exporter.url}: ")


@pytest.mark.parametrize("content", ["push-s3cr3t\n", "\ufeffpush-s3cr3t\r\n"], ids=["plain", "byte-order mark"])
def test_push_sends_the_ingest_token_of_its_token_file(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, content: str
) -> None:
    """The exporter and ``push`` read one file alike, a byte-order mark (as Windows editors write) included."""
    token_file = tmp_path / "ingest.token"
    token_file.write_text(content, encoding="utf-8")
    exporter = start_exporter("--web.ingest-token-file", str(token_file))

    refused = run_cli("push", str(HYBRID), "--url", exporter.url)
    assert refused.returncode == 1
    assert "HTTP 401" in refused.stderr and "(field Authorization)" in refused.stderr

    pushed = run_cli("push", str(HYBRID), "--url", exporter.url, "--token-file", str(token_file))
    assert pushed.returncode == 0, pushed.stderr
    assert "push-s3cr3t" not in pushed.stdout + pushed.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "No such file or directory"), ("", "the file is empty"), ("two words", "cannot have")],
)
def test_push_stops_before_sending_when_the_token_file_cannot_be_used(
    tmp_path: Path, content: str | None, message: str
) -> None:
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
    pushed = run_cli("push", str(HYBRID), "--url", "http://127.0.0.1:9", "--token-file", str(token_file))
    assert pushed.returncode == 2
    assert pushed.stderr.startswith(f"cache-config-exporter push: --token-file {token_file}: ")
    assert message in pushed.stderr


def test_push_refuses_a_file_it_cannot_read_or_that_is_empty(tmp_path: Path) -> None:
    missing = run_cli("push", str(tmp_path / "missing.msgpack"), "--url", "http://127.0.0.1:9")
    assert missing.returncode == 2
    assert f"{tmp_path / 'missing.msgpack'}: No such file or directory" in missing.stderr
    (tmp_path / "empty.msgpack").write_bytes(b"")
    empty = run_cli("push", str(tmp_path / "empty.msgpack"), "--url", "http://127.0.0.1:9")
    assert empty.returncode == 2
    assert "is empty: there is no ready response to send" in empty.stderr


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (("--web.workers", "many"), {}, "--web.workers: invalid int value: 'many'"),
        (("--log.level", "loud"), {}, "--log.level: invalid choice: 'loud'"),
        (("--limits.bytes", "0"), {}, "--limits.bytes must be positive, got 0"),
        ((), {"CACHE_CONFIG_EXPORTER_LIMITS_DEPLOYMENTS": "-1"}, "--limits.deployments must be positive, got -1"),
        (("--metric.prefix", "bad prefix"), {}, "--metric.prefix 'bad prefix' is not a valid metric name prefix"),
        (("--web.listen-address", "nowhere"), {}, "--web.listen-address 'nowhere': expected HOST:PORT"),
        (("--cache-config.file", "/nonexistent/cache.toml"), {}, "--cache-config.file /nonexistent/cache.toml: "),
        (("--web.ingest-token-file", "/nonexistent/token"), {}, "--web.ingest-token-file /nonexistent/token: "),
        # Each worker would build its prober: checked once before they start.
        (("--web.workers", "2", "--probe.bearer-token-file", "/missing"), {}, "--probe.bearer-token-file /missing: "),
    ],
)
def test_serve_exits_2_naming_the_flag_of_a_bad_setting(
    tmp_path: Path, flags: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    served = run_cli("serve", "--storage.path", str(tmp_path / "x.db"), *flags, env=env)
    assert served.returncode == 2
    assert message in served.stderr


def test_serve_exits_2_on_a_storage_file_that_is_not_its_own_and_leaves_it_as_it_is(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.db"
    foreign.write_bytes(b"not sqlite at all" * 200)
    served = run_cli("serve", "--storage.path", str(foreign), "--web.listen-address", "127.0.0.1:0")
    assert served.returncode == 2
    assert "not a database" in served.stderr
    assert foreign.read_bytes() == b"not sqlite at all" * 200


_SCHEMA_1 = """
    CREATE TABLE deployments (name TEXT PRIMARY KEY, static_config BLOB NOT NULL, instance_id TEXT);
    CREATE TABLE engines (
        deployment TEXT NOT NULL REFERENCES deployments(name) ON DELETE CASCADE,
        engine INTEGER NOT NULL, response BLOB NOT NULL, received_at REAL NOT NULL,
        PRIMARY KEY (deployment, engine));
    CREATE TABLE probe (id INTEGER PRIMARY KEY CHECK (id = 1), writes INTEGER NOT NULL);
    PRAGMA application_id = 1128482136;
    PRAGMA user_version = 1;
"""


def _one_line_exit_2(served: subprocess.CompletedProcess[str], words: str) -> None:
    assert served.returncode == 2, served.stderr
    assert "Traceback" not in served.stderr
    [line] = served.stderr.splitlines()
    assert line.startswith("cache-config-exporter: ") and words in line, line


def test_serve_exits_2_with_one_line_when_a_migration_meets_a_full_disk(tmp_path: Path) -> None:
    """A 3.5 MiB store of schema 1 with 512 KiB free: the migration's copy cannot be written; the old file stays."""
    with tmpfs(tmp_path / "disk", "8M") as disk:
        store = disk / "exporter.db"
        with sqlite3.connect(store) as db:
            db.executescript(_SCHEMA_1)
            db.execute("INSERT INTO deployments VALUES ('old', '{}', NULL)")
            payload = HYBRID.read_bytes()
            rows = [
                ("old", engine, payload + os.urandom(4096), 1.5) for engine in range(3_500_000 // (len(payload) + 4096))
            ]
            db.executemany("INSERT INTO engines VALUES (?, ?, ?, ?)", rows)
        assert store.stat().st_size > 3 << 20
        filler = disk / "filler"
        written = fill(filler)
        os.truncate(filler, written - (512 << 10))
        served = run_cli("serve", "--storage.path", str(store), "--web.listen-address", "127.0.0.1:0")
        _one_line_exit_2(served, "full")
        with sqlite3.connect(store) as db:  # rolled back: still schema 1, every row there
            assert db.execute("PRAGMA user_version").fetchone()[0] == 1
            assert db.execute("SELECT count(*) FROM engines").fetchone()[0] == len(rows)


def test_serve_exits_2_with_one_line_on_a_character_device(tmp_path: Path) -> None:
    served = run_cli("serve", "--storage.path", "/dev/null", "--web.listen-address", "127.0.0.1:0")
    _one_line_exit_2(served, "/dev/null: it is not a regular file")
