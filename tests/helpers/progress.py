"""The test run shown on the terminal as it goes: a line for every test still running after ``HEARTBEAT_SECONDS``,
and the long steps (the CPU vLLM's build, Docker images, the base image) line by line.

pytest captures what a test prints and shows it only when the test fails, so a test of minutes looks like a run that
hangs. The hooks here (``tests/conftest.py`` imports them) keep a copy of the terminal's file descriptor, taken at
start-up while nothing is captured, and ``show`` writes there: past pytest's capture, with and without ``-s``, and
from any thread, so a test's heartbeat comes from a thread beside it. A pytest-xdist worker has no terminal: its
stdout is /dev/null, its stderr the run's own, so a worker writes to a copy of its stderr, each line headed by the
worker's name (``[gw0]``). ``watched`` runs a long step's command and shows the lines it prints as they come, and
after every ``QUIET_SECONDS`` without one the seconds so far and the bytes written (in a folder the step fills, or
on the command's output). The command runs in a process group of its own, ended when the test is stopped (Ctrl-C)
or the step times out, so nothing it started outlives the test.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, TextIO

import pytest

from scripts import process_groups
from scripts.build_vllm_venv import WrittenBytes, every, size_text

# Seconds without a line from the step after which a line says it still runs.
QUIET_SECONDS = 15.0
# Seconds between the lines that say which test still runs.
HEARTBEAT_SECONDS = 25.0
TERMINAL = pytest.StashKey[TextIO]()
# Seconds a step has to end after SIGTERM (a stopped test, a timeout) before its process group is killed.
STOP_GRACE_SECONDS = 30.0


class Watched(NamedTuple):
    """How the step ended, and what it printed."""

    returncode: int
    stdout: str
    stderr: str


@pytest.hookimpl(trylast=True)  # after pytest's own, which registers the terminal reporter
def pytest_configure(config: pytest.Config) -> None:
    """Keep a copy of the terminal's descriptor (nothing is captured while pytest configures itself); in a
    pytest-xdist worker, of its stderr."""
    if hasattr(config, "workerinput"):
        config.stash[TERMINAL] = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
        return
    if config.pluginmanager.get_plugin("terminalreporter") is None:
        return
    config.stash[TERMINAL] = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    terminal = config.stash.get(TERMINAL, None)
    if terminal is not None:
        terminal.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """While a test runs, every ``HEARTBEAT_SECONDS`` a line with its name and how long it has run."""
    began = time.monotonic()

    def beat() -> None:
        show(item.config, f"{item.nodeid}: still running after {time.monotonic() - began:.0f} s")

    with every(HEARTBEAT_SECONDS, beat):
        yield


def show(config: pytest.Config, line: str) -> None:
    """``line`` on its own line of the terminal now, whatever pytest captures. The reporter's line of results in
    progress (its ``currentfspath``) is ended first, and the reporter starts a new one after; a worker's line is
    headed by the worker's name (the reporter's line is the controller's, out of the worker's reach)."""
    terminal = config.stash.get(TERMINAL, None)
    if terminal is None:
        return
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        terminal.write(f"[{worker['workerid']}] {line}\n")
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    terminal.write(("" if reporter.currentfspath is None else "\n") + f"{line}\n")
    reporter.currentfspath = None


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

    started = " ".join(command).splitlines()[0]
    say(f"started: {started if len(started) <= 160 else started[:157] + '...'}")
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
        try:
            returncode = process.wait(timeout=max(0.0, timeout - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} did not end within {timeout:.0f} s")
    say(f"ended with exit code {returncode}")
    return Watched(returncode, received["stdout"].decode(errors="replace"), received["stderr"].decode(errors="replace"))
