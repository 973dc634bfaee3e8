"""The test harness itself (tests/support.py): a real exporter that fails to start leaves nothing running, and the
README lists the long tests as they are marked."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from tests.support import SLOW_FILES, ExporterProcess, is_slow_file

ROOT = Path(__file__).resolve().parents[1]


def test_an_exporter_that_never_becomes_healthy_is_stopped_by_the_failed_start(tmp_path: Path) -> None:
    """Asked for HTTPS, a plain-HTTP exporter never answers its health check: the start fails, and stops it."""
    exporter = ExporterProcess(tmp_path / "exporter.db", tls=ssl.create_default_context())
    with pytest.raises(AssertionError, match="condition not met"):
        exporter.start(timeout=2.0)
    assert exporter.process is not None and exporter.process.poll() is not None, "still running"


def development_section() -> str:
    return (ROOT / "README.md").read_text().split("## Development\n")[1].split("\n## ")[0]


def test_the_readme_lists_every_file_whose_tests_are_all_slow() -> None:
    section = development_section()
    assert [pattern for pattern in SLOW_FILES if f"`{pattern}`" not in section] == []


def test_the_readme_names_the_folder_of_every_test_marked_slow_in_its_own_file() -> None:
    marked = {
        path.parent.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if "@pytest.mark.slow" in path.read_text() and not is_slow_file(path)
    }
    assert marked and [folder for folder in sorted(marked) if f"`{folder}/`" not in development_section()] == []
