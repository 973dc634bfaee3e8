"""What /proc says about the exporter's processes: its workers, which one holds a connection, its memory."""

from __future__ import annotations

import os
from pathlib import Path


def children(parent: int) -> set[int]:
    """Process ids whose parent is ``parent`` (uvicorn's worker processes, among others)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.add(int(stat.parent.name))
    return found


def connection_owner(server_port: int, client_port: int, pids: set[int]) -> int | None:
    """The process among ``pids`` holding the server end of the loopback connection from ``client_port``."""
    inodes = [
        fields[9]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if (fields := line.split())
        and int(fields[1].split(":")[1], 16) == server_port
        and int(fields[2].split(":")[1], 16) == client_port
    ]
    targets = {f"socket:[{inode}]" for inode in inodes}
    for pid in pids:
        try:
            descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) in targets:
                    return pid
            except OSError:
                continue
    return None


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` (now) and ``VmHWM`` (the peak so far) of a process, in KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}
