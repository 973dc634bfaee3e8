"""A state file has one owner: a second exporter on it refuses to start, naming the first; the workers of one
exporter (``--web.workers``) share it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.state.owner import own
from exporter.state.storage import StorageError
from tests.helpers.http import MSGPACK, request
from tests.helpers.ready_responses import ready_response
from tests.support import ExporterProcess


def test_a_second_owner_is_refused_naming_the_first_until_the_first_lets_go(tmp_path: Path) -> None:
    storage = tmp_path / "exporter.db"
    first = own(storage)
    with pytest.raises(StorageError) as refused:
        own(storage)
    assert str(refused.value) == (
        f"cannot open storage {storage}: another exporter (pid {os.getpid()}) owns it; "
        "one state file serves one exporter (use --web.workers for more processes)"
    )
    first.release()
    own(storage).release()


def test_a_link_to_the_file_is_the_same_file(tmp_path: Path) -> None:
    storage = tmp_path / "exporter.db"
    first = own(storage)
    (tmp_path / "link.db").symlink_to(storage)
    with pytest.raises(StorageError, match="owns it"):
        own(tmp_path / "link.db")
    first.release()


def serve(storage: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(storage), *args]
    return subprocess.run(
        [*command, "--web.listen-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_exporter_on_the_file_stops_in_one_line_while_the_workers_of_the_first_share_it(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, workers: str
) -> None:
    storage = tmp_path / "exporter.db"
    exporter = start_exporter("--web.workers", workers, storage=storage)
    for index in range(4):  # on new connections: with two workers, both write and read the file
        sent = request(exporter.url, "POST", f"/api/v1/deployments/d{index}/ready", ready_response(0, 9, 1), MSGPACK)
        assert sent.status == 200, sent.body
    second = serve(storage)
    assert second.returncode == 2, second.stderr
    [line] = second.stderr.strip().splitlines()
    assert line.startswith(f"cache-config-exporter: cannot open storage {storage}: another exporter (pid ")
    assert f"(pid {exporter.process.pid})" in line
    assert len(request(exporter.url, "GET", "/api/v1/deployments").json()) == 4
    assert exporter.stop() == 0
    assert len(request(start_exporter(storage=storage).url, "GET", "/api/v1/deployments").json()) == 4


def test_a_file_in_a_folder_yet_to_be_made_is_owned_from_its_first_start(tmp_path: Path) -> None:
    storage = tmp_path / "new" / "folder" / "exporter.db"
    first = own(storage)
    with pytest.raises(StorageError, match="owns it"):
        own(storage)
    first.release()
