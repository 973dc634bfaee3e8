"""File systems that fail on purpose (root only): a small tmpfs to fill, an ext4 image a test can break."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import unavailable


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def unmount(mount_point: Path) -> None:
    """Unmount, lazily when something still holds the file system."""
    if run("umount", str(mount_point)).returncode != 0:
        run("umount", "--lazy", str(mount_point))


@contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` at ``mount_point``, always unmounted afterwards."""
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    mount_point.mkdir()
    mounted = run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point))
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        unmount(mount_point)


def fill(path: Path) -> int:
    """Write ``path`` until its filesystem is full; the bytes written."""
    written = 0
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    written += os.write(descriptor, chunk)
                except OSError:
                    break
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return written


class Ext4:
    """An ext4 file system in an image file, on a loop device, mounted with ``errors=remount-ro`` as servers
    mount data volumes: after an error the kernel turns it read-only under every open file."""

    def __init__(self, image: Path, mount_point: Path) -> None:
        self.image = image
        self.mount_point = mount_point

    def mount(self) -> None:
        mounted = run("mount", "-o", "loop,errors=remount-ro", str(self.image), str(self.mount_point))
        if mounted.returncode != 0:
            unavailable(f"cannot mount an ext4 loop device: {mounted.stderr.strip()}")

    def unmount(self) -> None:
        unmount(self.mount_point)

    def fail(self) -> None:
        """Report a file-system error, as a failing disk would: the kernel makes the file system read-only."""
        device = Path(run("findmnt", "-n", "-o", "SOURCE", str(self.mount_point)).stdout.strip()).name
        trigger = Path("/sys/fs/ext4") / device / "trigger_fs_error"
        if not trigger.exists():
            unavailable(f"{trigger} does not exist (this kernel cannot inject ext4 errors)")
        trigger.write_text("reliability test: storage fault\n")

    def repair(self) -> None:
        """Unmount, check and repair, mount again read-write."""
        self.unmount()
        checked = run("e2fsck", "-f", "-y", str(self.image))
        assert checked.returncode in (0, 1), checked.stdout + checked.stderr  # 1: errors corrected
        self.mount()


@contextmanager
def ext4(image: Path, mount_point: Path, size: str = "16M") -> Iterator[Ext4]:
    """A fresh ``Ext4`` (root only), always unmounted afterwards."""
    if os.geteuid() != 0:
        unavailable("mounting a loop device needs root")
    for tool in ("mkfs.ext4", "e2fsck"):
        if not shutil.which(tool):
            unavailable(f"{tool} is not installed (package e2fsprogs)")
    mount_point.mkdir()
    run("truncate", "-s", size, str(image))
    made = run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode != 0:
        unavailable(f"mkfs.ext4 failed: {made.stderr.strip()}")
    volume = Ext4(image, mount_point)
    volume.mount()
    try:
        yield volume
    finally:
        volume.unmount()
