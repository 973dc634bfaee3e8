"""The figures tests measure, printed at the end of the run.

A test passes them to ``record``, which attaches them to its report (``record_property``); at the end of the
run ``pytest_terminal_summary`` (a hook ``tests/conftest.py`` imports) prints them under "reliability figures"
and, when the environment variable ``RELIABILITY_REPORT`` names a file, writes them there as JSON lines. This
works with and without ``-s`` and with pytest-xdist.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIGURES = "reliability"


def record(record_property: Callable[[str, object], None], test: str, **figures: object) -> None:
    """Attach a test's measured figures to its report (printed and written at the end of the run)."""
    record_property(FIGURES, json.dumps({"test": test, **figures}, sort_keys=True))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print every test's figures; write them to ``$RELIABILITY_REPORT`` (JSON lines) when set."""
    lines = [
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == FIGURES
    ]
    if not lines:
        return
    terminalreporter.section("reliability figures")
    for line in lines:
        terminalreporter.write_line(line)
    target = os.environ.get("RELIABILITY_REPORT")
    if target:
        Path(target).write_text("".join(f"{line}\n" for line in lines))
