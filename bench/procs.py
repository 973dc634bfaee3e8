"""The servers under test as subprocesses: each on a free loopback port, in its own process group, always stopped."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
# The floor: a bare asyncio HTTP/1.1 server that only answers, or commits each POST first (see the module).
FLOOR_SERVER = Path(__file__).with_name("floor_server.py")


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _status_mb(pid: int, field: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def peak_rss_mb(pid: int) -> float | None:
    """The process' peak resident set size (``VmHWM``) in MiB, or ``None`` if it cannot be read."""
    return _status_mb(pid, "VmHWM:")


def rss_mb(pid: int) -> float | None:
    """The process' resident set size now (``VmRSS``) in MiB, or ``None`` if it cannot be read."""
    return _status_mb(pid, "VmRSS:")


def _clock_ticks(values: list[str]) -> float:
    return sum(int(value) for value in values) / os.sysconf("SC_CLK_TCK")


def machine_seconds() -> tuple[float, float]:
    """CPU seconds the machine spent busy (all but idle, iowait and steal) and stolen by its hypervisor, since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    return _clock_ticks(fields[:3] + fields[5:7]), _clock_ticks(fields[7:8])


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of one running process; 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    return _clock_ticks(stat.rsplit(")", 1)[1].split()[11:13])


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (wrk runs, stopped servers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class CpuMeter:
    """How much CPU other processes take during a measurement: the machine's busy time less this run's own."""

    def __init__(self, running: list[Server]) -> None:
        self.running = running  # the servers of this run that are up (they are not waited-for children yet)

    def _now(self) -> tuple[float, float, float, float]:
        own = own_cpu_seconds() + sum(process_cpu_seconds(server.pid) for server in self.running)
        return time.monotonic(), *machine_seconds(), own

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, float]]:
        """Yields a dict that, once the block is done, holds the wall time, the CPU seconds other processes
        took (``other_seconds``, ``other_share`` of one core) and those the hypervisor stole (``steal_share``)."""
        record: dict[str, float] = {}
        before = self._now()
        yield record
        wall, busy, steal, own = (after - start for after, start in zip(self._now(), before, strict=True))
        wall = wall or 1e-9
        record.update(
            wall_seconds=wall, other_seconds=busy - own, other_share=(busy - own) / wall, steal_share=steal / wall
        )


class Server:
    """A server subprocess; ``with Server(...) as server`` starts it, waits until it answers, and kills its group."""

    def __init__(
        self, name: str, command: Callable[[int], list[str]], ready_path: str, log_dir: Path, timeout: float = 30.0
    ) -> None:
        self.name = name
        self.port = free_port()
        self.command = command(self.port)
        self.ready_path = ready_path
        self.log = log_dir / f"{name}-{self.port}.log"
        self.timeout = timeout
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> Server:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self._log_tail()}")
            connection = http.client.HTTPConnection(HOST, self.port, timeout=1)
            try:
                connection.request("GET", self.ready_path)
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                connection.close()
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} within {self.timeout}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after 10 s."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def floor_server(body: Path, workdir: Path, *options: str, name: str = "floor") -> Server:
    """The floor on a free loopback port, answering every GET with ``body``; ``options`` go to it as they are
    (``--commit-per-post PATH``). Every benchmark and test starts it this way, so they measure the same server."""
    command = [sys.executable, str(FLOOR_SERVER), "--host", HOST, "--body", str(body), *options, "--port"]
    return Server(name, lambda port: [*command, str(port)], "/", workdir)
