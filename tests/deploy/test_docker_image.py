"""The container image, built and run for real by docker/test-image.sh (Docker, debootstrap, a volume)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers.progress import watched
from tests.helpers.prometheus import DOCKER
from tests.support import IN_CI

SKIPPED = 77


@pytest.mark.slow
def test_the_image_builds_runs_and_keeps_its_state_on_the_volume(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    """Build, run, push the hybrid fixture, scrape, restart, re-create: see docker/test-image.sh. Its steps show on
    the terminal as they go: a first run debootstraps the base image, minutes on a small machine."""
    environment = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    finished = watched(
        pytestconfig,
        "docker/test-image.sh",
        ["bash", str(DOCKER / "test-image.sh")],
        timeout=45 * 60,
        folder=tmp_path,
        env=environment,
    )
    report = finished.stdout + finished.stderr
    if finished.returncode == SKIPPED and not IN_CI:
        pytest.skip(report.strip().splitlines()[-1])
    assert finished.returncode == 0, report
    assert "test-image: PASSED" in report
