"""One exporter owns a state file: an exclusive ``flock`` on the file itself, held for the process's life.

Two exporters on one file would each show only their own acknowledged writes, and a restart yet another mix;
SQLite's own locks cover a transaction, not a process's life. ``serve`` takes this lock before it opens the
store, so a second exporter stops at start-up, naming the first. ``--web.workers N`` takes it in the parent
process, which outlives its workers: the workers share the file without asking (their own store connections
never flock).

The lock is on the database file itself, so no lock file is created beside it and a symlink names the same
lock. ``flock`` and SQLite's POSIX record locks are independent on local file systems; on NFS, where they are
not, SQLite's WAL mode does not work in the first place.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from exporter.state.storage import StorageError


class Owner:
    """The lock, held until ``release`` or the process's end."""

    def __init__(self, descriptor: int | None) -> None:
        self._descriptor = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the only descriptor of the open file ends its flock
            self._descriptor = None


def own(path: Path) -> Owner:
    """Lock ``path`` for this process, creating it empty if missing (SQLite takes an empty file as new).

    Raises ``StorageError`` naming the owner's pid when another process holds it. A file that cannot be opened
    at all is not locked here: opening the store then fails with SQLite's reason, as without this lock.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: a FIFO in the file's place must not hang the start (the store then refuses it).
        descriptor = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError:
        return Owner(None)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(os.fstat(descriptor))
        os.close(descriptor)
        raise StorageError(
            f"cannot open storage {path}: another exporter ({holder}) owns it; "
            "one state file serves one exporter (use --web.workers for more processes)"
        ) from None
    return Owner(descriptor)


def _holder(status: os.stat_result) -> str:
    """Who holds the flock on the file of ``status``, as ``/proc/locks`` tells (Linux); "another process" else."""
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        with open("/proc/locks") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 22377 fe:00:2154235 0 EOF"
                fields = line.split()
                if fields[1:3] == ["FLOCK", "ADVISORY"] and fields[5] == device:
                    return f"pid {fields[4]}"
    except OSError:
        pass
    return "another process"
