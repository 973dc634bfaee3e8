"""The test harness itself (tests/support.py): a real exporter that fails to start leaves nothing running."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from tests.support import ExporterProcess


def test_an_exporter_that_never_becomes_healthy_is_stopped_by_the_failed_start(tmp_path: Path) -> None:
    """Asked for HTTPS, a plain-HTTP exporter never answers its health check: the start fails, and stops it."""
    exporter = ExporterProcess(tmp_path / "exporter.db", tls=ssl.create_default_context())
    with pytest.raises(AssertionError, match="condition not met"):
        exporter.start(timeout=2.0)
    assert exporter.process is not None and exporter.process.poll() is not None, "still running"
