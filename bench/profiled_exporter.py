"""The exporter's ``serve``, with its event loop's thread and its writer thread each under a cProfile of its own.

python -m bench.profiled_exporter DIRECTORY serve [flags of serve]

``python -m cProfile`` profiles only the thread that started it (the event loop's): a profiler is per thread. Here
the main thread runs under one, and every thread named as the state's writer under another, each written to
DIRECTORY (``loop.prof``, ``writer.prof``) as its thread ends: the writer when the state closes, the loop when
``serve`` returns. Each counts its thread's CPU time (``time.thread_time``), not the wall clock's: a thread waiting
(the writer for its queue or the disk's fsync, the loop for its sockets) spends none. Bench-only: the exporter
itself knows nothing of it. The modules ``serve`` imports are imported before the profiles start, so that imports
do not count as the requests' time.
"""

from __future__ import annotations

import cProfile
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from exporter import cli
from exporter.server import app  # noqa: F401  (imported before the profile starts: see the module's docstring)

# The writer thread's name (exporter/state/writer.py).
WRITER_THREAD = "cache-config-writer"
LOOP_PROFILE = "loop.prof"
WRITER_PROFILE = "writer.prof"


def _profile_writer(directory: Path) -> None:
    """Make every thread named ``WRITER_THREAD`` run under a profiler written to ``directory`` as it ends."""
    run = threading.Thread.run

    def profiled_run(thread: threading.Thread) -> None:
        if thread.name != WRITER_THREAD:
            run(thread)
            return
        profiler = cProfile.Profile(time.thread_time)
        try:
            profiler.runcall(run, thread)
        finally:
            profiler.dump_stats(str(directory / WRITER_PROFILE))

    threading.Thread.run = profiled_run  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    directory = Path(arguments.pop(0))
    _profile_writer(directory)
    profiler = cProfile.Profile(time.thread_time)
    try:
        return profiler.runcall(cli.main, arguments)
    finally:
        profiler.dump_stats(str(directory / LOOP_PROFILE))


if __name__ == "__main__":
    raise SystemExit(main())
