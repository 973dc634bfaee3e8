"""The long steps of a test run (the CPU vLLM's build, Docker images, the base image) shown on the terminal as they go.

pytest captures what a test prints and shows it only when the test fails, so a step of minutes looks like a run that
hangs. ``watched`` runs such a step's command and writes to the terminal, as they come, the lines the command prints,
and after every ``QUIET_SECONDS`` without one a line with the seconds so far and the bytes written (in a
folder the step fills, or on the command's output). It writes through pytest's terminal reporter with the capture
suspended, as pytest's own live logging does, so the lines show with and without ``-s``; a pytest-xdist worker has
no terminal, and there they go nowhere. The command runs in a process group of its own, ended when the test is
stopped (Ctrl-C) or the step times out, so nothing it started outlives the test.
"""

from __future__ import annotations

import contextlib
import selectors
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from scripts import process_groups
from scripts.build_vllm_venv import WrittenBytes, size_text

# Seconds without a line from the step after which a line says it still runs.
QUIET_SECONDS = 15.0
# Seconds a step has to end after SIGTERM (a stopped test, a timeout) before its process group is killed.
STOP_GRACE_SECONDS = 30.0


class Watched(NamedTuple):
    """How the step ended, and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def show(config: pytest.Config, line: str) -> None:
    """``line`` on the terminal now, whatever pytest captures."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line(line)


def watched(
    config: pytest.Config,
    what: str,
    command: list[str],
    *,
    timeout: float,
    folder: Path | None = None,
    quiet_seconds: float = QUIET_SECONDS,
    **popen: Any,
) -> Watched:
    """Run ``command`` as the step ``what``, shown on the terminal as it goes (see the module); fail the test when it
    runs longer than ``timeout`` seconds."""
    began = time.monotonic()
    written = WrittenBytes(folder) if folder is not None else None
    received = {"stdout": bytearray(), "stderr": bytearray()}
    shown_up_to = {"stdout": 0, "stderr": 0}

    def say(message: str) -> None:
        show(config, f"{what}: [{time.monotonic() - began:4.0f} s] {message}")

    say(f"started: {' '.join(command)}")
    with process_groups.group(
        command, STOP_GRACE_SECONDS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen
    ) as process, selectors.DefaultSelector() as selector:  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        selector.register(process.stdout, selectors.EVENT_READ, "stdout")
        selector.register(process.stderr, selectors.EVENT_READ, "stderr")
        last_shown = time.monotonic()
        while selector.get_map():
            if time.monotonic() - began > timeout:
                pytest.fail(f"{what} did not end within {timeout:.0f} s")
            for key, _ in selector.select(timeout=1.0):
                chunk = key.fileobj.read1(65536)  # type: ignore[union-attr]
                if not chunk:
                    selector.unregister(key.fileobj)
                stream = received[key.data]
                stream += chunk
                while (end := stream.find(b"\n", shown_up_to[key.data])) != -1:
                    say(stream[shown_up_to[key.data] : end].decode(errors="replace").rstrip())
                    shown_up_to[key.data], last_shown = end + 1, time.monotonic()
            if time.monotonic() - last_shown >= quiet_seconds:
                count = written.count() if written is not None else sum(map(len, received.values()))
                where = f"written in {folder}" if folder is not None else "of output"
                say(f"still running, {size_text(count)} {where} so far")
                last_shown = time.monotonic()
        returncode = process.wait()
    say(f"ended with exit code {returncode}")
    return Watched(returncode, received["stdout"].decode(errors="replace"), received["stderr"].decode(errors="replace"))
