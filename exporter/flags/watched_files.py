"""Values loaded from files and loaded again when a file changes, ending on what the files finally hold.

A file is looked at (``os.stat``) on every use and loaded again when it changed. A reload takes the files'
signature *before* reading them, so a write that lands during the read shows as a change at the next look; and a
file changed within the file system's timestamp resolution of the read is read again at the next look too (git's
"racily clean" rule), so a rewrite that keeps size and timestamp is not missed. A file that no longer loads keeps
the last good value, logs why once per change and shows in ``last_reload_successful``.

Secret files are also checked the way ssh checks a private key: readable by others, or by the group while the
exporter's own user owns it, is warned about once per change and shows in ``open_to_others``.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, NamedTuple, TypeVar

from exporter.flags.option import SettingsError

_log = logging.getLogger("cache_config_exporter")
T = TypeVar("T")
# Coarser than any local file system's timestamps (jiffies), and than the 1 s of ext3 and many network mounts.
_RACY_NANOSECONDS = 1_000_000_000
_READS_UNTIL_STABLE = 3


class FileState(NamedTuple):
    """What changes when a file is rewritten, replaced, re-linked (a Kubernetes secret update) or chmod-ed."""

    device: int
    inode: int
    size: int
    modified_ns: int
    changed_ns: int
    mode: int
    owner: int


Signature = tuple[FileState | None, ...]


def signature(paths: tuple[Path, ...]) -> Signature:
    def one(path: Path) -> FileState | None:
        try:
            status = os.stat(path)
        except OSError:
            return None
        return FileState(
            status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_mode,
            status.st_uid,
        )  # fmt: skip

    return tuple(one(path) for path in paths)


def open_to_others(state: FileState) -> bool:
    """ssh's rule for a private key: others may read it, or its group may while the exporter's user owns it."""
    others = state.mode & stat.S_IROTH
    group = state.mode & stat.S_IRGRP and state.owner == os.geteuid()
    return bool(others or group)


def _is_racy(files: Signature, read_at_ns: int) -> bool:
    """Whether a file changed so close to the read that a later change could keep its timestamp and size."""
    return any(state is not None and abs(state.modified_ns - read_at_ns) < _RACY_NANOSECONDS for state in files)


class Watched(Generic[T]):
    """A value loaded from files; loaded again when one of them changes, keeping the last good value on failure.

    ``load`` returns the value and every file it read. At start its ``SettingsError`` stops start-up. With
    ``secret`` the files are checked for modes that let others read them.
    """

    def __init__(self, name: str, load: Callable[[], tuple[T, tuple[Path, ...]]], secret: bool = False) -> None:
        self.name = name
        self._load = load
        self._secret = secret
        self._lock = threading.Lock()
        self._files: tuple[Path, ...] = ()
        self._signature: Signature = ()
        self._racy = False
        self.open_to_others = False
        self.value, self._files, self._signature, self._racy = self._read()
        self._check_modes()
        self.last_reload_successful = True
        self.last_success_time = time.time()

    def current(self) -> T:
        """The value, loaded again first if one of its files changed since the last look."""
        if self._racy or signature(self._files) != self._signature:
            with self._lock:
                if self._racy or signature(self._files) != self._signature:
                    self._reload()
        return self.value

    def _read(self) -> tuple[T, tuple[Path, ...], Signature, bool]:
        """Load; the files' signature from before the read, and whether they must be read again at the next look."""
        files = self._files
        for _ in range(_READS_UNTIL_STABLE):
            started = time.time_ns()
            before = signature(files)
            value, loaded = self._load()
            if loaded == files:
                break
            files = loaded  # the first load, or one that names other files (a new certificate path)
        return value, loaded, before, loaded != files or _is_racy(before, started)

    def _reload(self) -> None:
        previous = self._signature
        started, before = time.time_ns(), signature(self._files)
        try:
            value, files, now, racy = self._read()
        except SettingsError as error:
            # A failed load is remembered by the signature too: it is logged once, not on every request. A file
            # that fails because it is being written is read again once the writer has changed it again.
            self._signature, self._racy = before, _is_racy(before, started)
            if before != previous or self.last_reload_successful:
                _log.error("%s: reload failed, keeping the last good content: %s", self.name, error)
            self.last_reload_successful = False
            return
        self.value, self._files, self._signature, self._racy = value, files, now, racy
        if now != previous or not self.last_reload_successful:
            self.last_reload_successful = True
            self.last_success_time = time.time()
            _log.info("%s: reloaded", self.name)
            self._check_modes()

    def _check_modes(self) -> None:
        if not self._secret:
            return
        open_files = [
            (path, state)
            for path, state in zip(self._files, self._signature, strict=True)
            if state and open_to_others(state)
        ]
        self.open_to_others = bool(open_files)
        for path, state in open_files:
            _log.warning(
                "%s: group or others may read it (mode %04o); chmod 600 %s, as ssh requires of a private key",
                self.name,
                stat.S_IMODE(state.mode),
                path,
            )
