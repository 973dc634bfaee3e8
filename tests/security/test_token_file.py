"""Token files as operators write them: what is a token, a reload ends on the file's final content, and open
modes are flagged."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from exporter.flags.option import SettingsError
from exporter.security.token_file import watched_tokens
from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.support import ExporterProcess, wait_until

INSECURE = "cache_config_exporter_config_file_open_to_others"
# An ingest-only route that changes nothing when its Content-Type is wrong: 415 with the token, 401 without.
CHECK = "/api/v1/deployments/rotation/cache-config"


def accepted(exporter: ExporterProcess, token: str) -> bool:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "text/plain"}
    status = request(exporter.url, "PUT", CHECK, b"x", headers).status
    assert status in (401, 415), status
    return status == 415


def token_file(directory: Path, name: str, mode: int) -> tuple[Path, str]:
    """A file holding a new token, with ``mode``; the file and the token."""
    path, token = directory / name, secrets.token_hex(32)
    path.write_text(f"{token}\n")
    path.chmod(mode)
    return path, token


def write_in_two_calls(path: Path, token: str) -> None:
    """What a shell's ``printf`` or a careless script does: truncate, then the token in two ``write()`` calls."""
    descriptor = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(descriptor, token[:8].encode())
        os.write(descriptor, f"{token[8:]}\n".encode())
    finally:
        os.close(descriptor)


def test_a_token_read_mid_write_is_not_kept(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    tokens, token = token_file(tmp_path, "ingest.token", 0o600)
    exporter = start_exporter("--web.ingest-token-file", str(tokens))
    stop = threading.Event()

    def send() -> None:  # clients whose requests make the exporter look at the file while it is written
        while not stop.is_set():
            accepted(exporter, "not-the-token")

    clients = [threading.Thread(target=send, daemon=True) for _ in range(3)]
    for client in clients:
        client.start()
    rotations, stuck, started = 0, [], time.monotonic()
    try:
        while rotations < 1000 and len(stuck) < 3 and time.monotonic() - started < 60:
            token = secrets.token_hex(32)
            write_in_two_calls(tokens, token)
            rotations += 1
            try:
                wait_until(lambda: accepted(exporter, token), timeout=2, interval=0.01)  # noqa: B023
            except AssertionError:
                stuck.append(rotations)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=15)
    record(record_property, "token_file_written_in_two_calls", rotations=rotations, stuck_on_a_prefix=len(stuck))
    assert not stuck, f"after rotations {stuck} of {rotations} the exporter kept a partly written token"
    assert not accepted(exporter, token[:8]), "the prefix of the last token is not a token"


def test_a_token_file_open_to_others_is_warned_about_until_it_is_not(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    tokens, token = token_file(tmp_path, "metrics.token", 0o644)
    exporter = start_exporter("--web.metrics-token-file", str(tokens))
    bearer = {"Authorization": f"Bearer {token}"}

    def flagged() -> float:
        reply = request(exporter.url, "GET", "/metrics", headers=bearer)
        assert reply.status == 200
        (sample,) = [sample for sample in samples(reply.text, INSECURE) if sample.labels["file"] == str(tokens)]
        return sample.value

    assert flagged() == 1.0
    log = exporter.log.read_text()
    assert f"--web.metrics-token-file {tokens}: group or others may read it (mode 0644)" in log
    assert "chmod 600" in log and token not in log
    tokens.chmod(0o600)
    wait_until(lambda: flagged() == 0.0)
    assert exporter.log.read_text().count("group or others may read it") == 1, "warned once per change"


def tokens_in(directory: Path, content: str) -> frozenset[bytes]:
    path = directory / "ingest.token"
    path.write_text(content)
    path.chmod(0o600)
    return watched_tokens("--web.ingest-token-file", path).current()


def test_comments_blank_lines_and_the_spaces_around_a_token_are_not_part_of_any_token(tmp_path: Path) -> None:
    content = "# rotated in on Monday\n\n  new-token  \n\t# old-token, kept until the senders moved\nold-token\r\n"
    assert tokens_in(tmp_path, content) == {b"new-token", b"old-token"}


def test_a_byte_order_mark_is_no_part_of_the_first_token(tmp_path: Path) -> None:
    """A file saved by an editor that writes one: the token in it is accepted, as ``push`` and the plugin send it."""
    assert tokens_in(tmp_path, "\ufeffnew-token\r\nold-token\r\n") == {b"new-token", b"old-token"}


def test_a_file_that_is_not_utf8_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(b"\xff\xfet\x00o\x00k\x00")
    path.chmod(0o600)
    with pytest.raises(SettingsError, match=f"--web.ingest-token-file {path}: not UTF-8 text"):
        watched_tokens("--web.ingest-token-file", path).current()


@pytest.mark.parametrize("content", ["# only a comment\n", "# one\n\n  # two\n"])
def test_a_file_of_comments_alone_is_refused(tmp_path: Path, content: str) -> None:
    """Like an empty file, one whose tokens were all commented out is a mistake: it does not load."""
    with pytest.raises(SettingsError, match="the file holds no token"):
        tokens_in(tmp_path, content)
