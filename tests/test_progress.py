"""A long step of the test run shows on the terminal as it goes, whether pytest captures the output or not."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
# A step that says one line, is silent for a while (as pip is while it fetches a large wheel), and prints its result.
INNER_TEST = """
import sys

from tests.helpers.progress import watched

STEP = "import sys, time; print('fetching torch', file=sys.stderr, flush=True); time.sleep(1.5); print('/the/venv')"


def test_a_long_step(pytestconfig, tmp_path):
    done = watched(pytestconfig, "building", [sys.executable, "-c", STEP], timeout=60, quiet_seconds=0.4)
    assert (done.returncode, done.stdout) == (0, "/the/venv\\n")
"""


# A test that runs longer than the heartbeat's interval (shortened for this run by the inner run's conftest).
INNER_CONFTEST = """
from tests.helpers import progress
from tests.helpers.progress import pytest_configure, pytest_runtest_protocol, pytest_unconfigure

progress.HEARTBEAT_SECONDS = 0.5
"""
SLOW_INNER_TEST = """
import time


def test_a_slow_one():
    time.sleep(1.6)  # a test that takes its time, as one serving a model does
"""


@pytest.mark.parametrize("capture", [[], ["-s"]], ids=["captured", "not-captured"])
def test_a_passing_tests_long_step_shows_its_lines_and_that_it_still_runs(tmp_path: Path, capture: list[str]) -> None:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *capture, "test_inner.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inner.returncode == 0, inner.stdout + inner.stderr
    shown = inner.stdout
    assert re.search(r"^building: \[   0 s\] fetching torch$", shown, re.M), shown
    assert re.search(r"^building: \[   \d s\] still running, \d+\.\d MB of output so far$", shown, re.M), shown
    assert re.search(r"^building: \[   \d s\] ended with exit code 0$", shown, re.M), shown


def test_a_test_running_longer_than_the_interval_says_so_on_the_terminal(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_slow.py").write_text(SLOW_INNER_TEST)
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_slow.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inner.returncode == 0, inner.stdout + inner.stderr
    beats = re.findall(r"^test_slow\.py::test_a_slow_one: still running after (\d+) s$", inner.stdout, re.M)
    assert len(beats) >= 2 and beats == sorted(beats, key=int), inner.stdout


def test_a_pytest_xdist_workers_long_test_and_step_show_on_the_runs_stderr(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_slow.py").write_text(SLOW_INNER_TEST)
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", "test_slow.py", "test_inner.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPOSITORY)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert inner.returncode == 0, inner.stdout + inner.stderr
    shown = inner.stderr
    beats = re.findall(r"^\[gw0\] test_slow\.py::test_a_slow_one: still running after (\d+) s$", shown, re.M)
    assert len(beats) >= 2 and beats == sorted(beats, key=int), shown
    assert re.search(r"^\[gw0\] building: \[   0 s\] fetching torch$", shown, re.M), shown
    assert re.search(r"^\[gw0\] building: \[   \d s\] ended with exit code 0$", shown, re.M), shown
