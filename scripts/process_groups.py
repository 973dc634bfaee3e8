"""Children in process groups of their own, ended with everything they started, and SIGTERM turned into an exception.

A script that starts servers or pip must end them however it is stopped, short of SIGKILL: with SIGTERM, with
Ctrl-C or with an error. Python's default SIGTERM ends the interpreter without running ``finally`` blocks, so
``stop_on_sigterm`` makes it raise ``SystemExit`` instead. Each child runs in a session of its own, so that killing
its process group also ends what it started (vLLM's engine cores, pip's build subprocesses), and so that a Ctrl-C
reaches the script alone, which then ends each group itself, in order, instead of every process at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any


def stop_on_sigterm() -> None:
    """SIGTERM raises ``SystemExit(143)``, as Ctrl-C raises ``KeyboardInterrupt``: the ``finally`` blocks run."""

    def stop(signal_number: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signal_number)

    signal.signal(signal.SIGTERM, stop)


def end_group(process: subprocess.Popen[Any], grace_seconds: float) -> None:
    """SIGTERM to the child's process group, SIGKILL after ``grace_seconds``, then SIGKILL to whatever of the
    group outlived the child."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def group(command: Sequence[str], grace_seconds: float, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``command`` in a session of its own, its whole process group ended on the way out (see ``end_group``)."""
    process = subprocess.Popen(list(command), start_new_session=True, **popen)
    try:
        yield process
    finally:
        end_group(process, grace_seconds)
