"""What a liveness probe sees: ``/-/healthy`` timed, watched during an attack, and awaited after one."""

from __future__ import annotations

import threading
import time

from tests.helpers.http import request
from tests.support import wait_until


def health_latency(url: str, timeout: float) -> float:
    """Seconds ``GET /-/healthy`` took on a new connection; ``timeout`` when it failed or was not a 200."""
    started = time.monotonic()
    try:
        ok = request(url, "GET", "/-/healthy", timeout=timeout).status == 200
    except OSError:
        ok = False
    return time.monotonic() - started if ok else timeout


class HealthWatch:
    """``/-/healthy`` timed back to back in a thread while the ``with`` block runs."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.latencies.append(health_latency(self.url, self.timeout))

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout + 5)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)


def recovery_seconds(url: str, bound: float = 30.0, fast: float = 0.5) -> float:
    """Seconds from now until ``/-/healthy`` answers 200 within ``fast`` seconds (fails after ``bound``)."""
    started = time.monotonic()
    wait_until(lambda: health_latency(url, fast) < fast, timeout=bound, interval=0.01)
    return time.monotonic() - started
