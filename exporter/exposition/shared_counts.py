"""A counter the worker processes of ``serve --probe.only --web.workers N`` share without a writable directory.

prometheus_client's multiprocess mode needs a directory its workers can write files in; a probe-only exporter
must run on a read-only file system, where there is none. So ``serve`` creates a memory file (``memfd``, no
file system behind it) before it starts the workers, and names it to them as ``/proc/PID/fd/FD``: each worker
opens it there and maps it. A counter is one float64 cell per label value; an increment is made under an
exclusive ``flock`` of the file, so that two workers never lose one another's; a scrape reads the cells
unlocked (an aligned 8-byte read is never torn). The counts outlive a worker: a worker started again adds
to them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

SHARED_COUNTS_ENVIRONMENT = "CACHE_CONFIG_EXPORTER_SHARED_COUNTS"
# Cells in the memory file: more than every shared counter's label values together.
CELLS = 512
_CELL = struct.Struct("d")


def create_shared_counts() -> str:
    """A zeroed memory file for this process's workers, held open for the process's life: the path they open."""
    descriptor = os.memfd_create("cache-config-exporter-counts")
    os.ftruncate(descriptor, CELLS * _CELL.size)
    return f"/proc/{os.getpid()}/fd/{descriptor}"


class SharedCounter(Collector):
    """A counter with one label, its values known in advance, counted in the shared memory file at ``path``."""

    def __init__(self, path: str, name: str, documentation: str, label: str, values: Sequence[str]) -> None:
        if len(values) > CELLS:
            raise ValueError(f"{len(values)} label values, more than the {CELLS} cells of the memory file")
        self._file = open(path, "r+b")  # noqa: SIM115  # mapped and locked for the process's life
        self._cells = mmap.mmap(self._file.fileno(), CELLS * _CELL.size)
        self._name, self._documentation, self._label = name, documentation, label
        self._index = {value: index for index, value in enumerate(values)}

    def inc(self, value: str, amount: float = 1.0) -> None:
        offset = self._index[value] * _CELL.size
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            _CELL.pack_into(self._cells, offset, _CELL.unpack_from(self._cells, offset)[0] + amount)
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, index in self._index.items():
            family.add_metric([value], _CELL.unpack_from(self._cells, index * _CELL.size)[0])
        yield family
