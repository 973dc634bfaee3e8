"""The test harness itself (tests/support.py): a real exporter that fails to start leaves nothing running, the
README lists the long tests as they are marked, and with pytest-xdist the long tests run one after another."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
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


# An inner run with this repository's hooks: a file of slow tests by its name, a test marked slow among short ones.
INNER_CONFTEST = """
from tests.conftest import pytest_collection_modifyitems, pytest_configure_node, pytest_xdist_make_scheduler
"""
INNER_TEST = """
import os
from pathlib import Path

import pytest


def ran(name):
    with Path("ran.txt").open("a") as ran:
        ran.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")


@pytest.mark.parametrize("index", range(6))
def test_short(index):
    ran(f"short-{index}")


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3))
def test_long(index):
    ran(f"long-{index}")
"""
INNER_SLOW_FILE = """
from test_inner import ran


def test_attack_a():
    ran("attack-a")


def test_attack_b():
    ran("attack-b")
"""


def test_with_two_workers_every_slow_test_runs_on_one_worker_in_order(tmp_path: Path) -> None:
    """The options of pyproject.toml (``-n 2 --dist loadgroup``) with tests/conftest.py's hooks: the long tests run one
    after another on one worker, as in a run without workers, the short ones on the other (tests/helpers/slow_group.py:
    with the pytest this runs under, whichever release)."""
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "test_attack_inner.py").write_text(INNER_SLOW_FILE)
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "test_inner.py", "test_attack_inner.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inner.returncode == 0, inner.stdout + inner.stderr
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    long_ones = [(name, worker) for name, worker in ran if not name.startswith("short-")]
    assert [name for name, _ in long_ones] == ["long-0", "long-1", "long-2", "attack-a", "attack-b"], ran
    assert len({worker for _, worker in long_ones}) == 1, ran
    assert sorted(name for name, _ in ran if name.startswith("short-")) == [f"short-{index}" for index in range(6)]
