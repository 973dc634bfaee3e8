"""Watched files (exporter/flags/watched_files.py): a write during a read is seen, and ssh's rule for open modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.flags.option import SettingsError
from exporter.flags.watched_files import FileState, Watched, open_to_others


def test_a_write_that_lands_during_the_read_is_seen_at_the_next_look(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first-token\n")
    writes_during_the_read = ["0123456789abcdef\n"]  # the writer's second write() lands right after the read

    def load() -> tuple[str, tuple[Path, ...]]:
        content = token.read_text()
        if writes_during_the_read and content.startswith("0123"):
            with token.open("a") as file:
                file.write(writes_during_the_read.pop())
        return content.strip(), (token,)

    watched = Watched("--token", load)
    assert watched.current() == "first-token"
    token.write_text("0123")  # the first write() of a new token
    assert watched.current() == "0123", "what the file held when read"
    assert watched.current() == "01230123456789abcdef", "the write during that read shows at the next look"


def test_a_file_broken_while_written_is_read_again_once_it_is_whole(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("good\n")

    def load() -> tuple[str, tuple[Path, ...]]:
        content = token.read_text().strip()
        if not content:
            token.write_text("rotated\n")  # the writer finishes right after the truncated file was read
            raise SettingsError("empty")
        return content, (token,)

    watched = Watched("--token", load)
    token.write_text("")
    assert watched.current() == "good" and not watched.last_reload_successful
    assert watched.current() == "rotated" and watched.last_reload_successful


@pytest.mark.parametrize(
    ("mode", "own", "flagged"),
    [
        (0o600, True, False),
        (0o400, True, False),
        (0o644, True, True),
        (0o604, False, True),  # others may read it, whoever owns it
        (0o640, True, True),  # the exporter's own file, readable by its group
        (0o640, False, False),  # root's file, readable through the exporter's group: the systemd unit's set-up
        (0o440, False, False),  # Kubernetes' defaultMode 0440 with fsGroup
        (0o620, True, False),  # group may write, not read: ssh would object, but no secret shows
    ],
)
def test_open_modes_follow_sshs_rule(mode: int, own: bool, flagged: bool) -> None:
    owner = os.geteuid() if own else os.geteuid() + 1
    assert open_to_others(FileState(0, 0, 0, 0, 0, 0o100000 | mode, owner)) is flagged
