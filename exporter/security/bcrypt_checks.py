"""bcrypt checks of basic-auth passwords, bounded so that failed guesses cannot become a CPU weapon.

A check costs what the hash's cost says (a quarter of a second at cost 12). So checks run in a small thread
pool of their own, never in the pool that renders ``/metrics``; at most a few wait for it, and past that a
guess is refused at once (``AuthenticationBusy``: 503 with ``Retry-After``); a client that has hung up while
waiting is not checked at all. Passwords that were right are remembered (``exporter/security/bcrypt_cache.py``), so an
authenticated scrape never waits behind guesses. An unknown user is checked against a stand-in hash of the
configured hashes' cost, so timing does not tell which users exist.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import bcrypt

from exporter.errors import Refused
from exporter.security.bcrypt_cache import VerifiedCache

# A quarter of the cores (at least one): the rest serve scrapes, health checks and ingest.
DEFAULT_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 4))
# Checks that may wait for a worker, per worker: at cost 12, about two seconds of waiting at most.
WAITING_PER_WORKER = 8
# What became of a basic-auth password: found among the verified ones, checked right or wrong, refused because
# too many checks waited, or not checked because its client had hung up.
OUTCOMES = ("remembered", "right", "wrong", "busy", "client_gone")


class AuthenticationBusy(Refused):
    """Too many password checks wait already: the client may try again in a second."""


@functools.cache
def _stand_in(cost: int) -> bytes:
    """A hash nothing matches, checked at ``cost`` like a real one (a salt of that cost, and any digest)."""
    return bcrypt.gensalt(rounds=cost) + b"." * 31


def _yield_the_cpu() -> None:
    """Run this pool thread at the lowest priority (Linux: niceness is per thread), so that where the cores are
    busy, scrapes, health checks and ingest go first and guesses wait."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _checkpw(password: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # longer than bcrypt's 72 bytes: never a valid password
        return False


class BcryptChecks:
    """The password checks of one process: its pool, the cap on waiting checks, and the verified cache."""

    def __init__(self, workers: int = DEFAULT_WORKERS, waiting: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="bcrypt", initializer=_yield_the_cpu)
        self._running = asyncio.Semaphore(workers)
        self._cap = waiting if waiting is not None else WAITING_PER_WORKER * workers
        self._admitted = 0
        self._verified = VerifiedCache()
        self.outcomes: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))

    async def matches(
        self, user: str, password: bytes, hashed: bytes | None, cost: int, gone: Callable[[], bool]
    ) -> bool:
        """Whether ``password`` is ``user``'s (``hashed``: ``None`` for an unknown user, checked all the same).

        ``gone`` says whether the client has hung up; raises ``AuthenticationBusy`` when too many checks wait.
        """
        if hashed is not None and (user, password, hashed) in self._verified:
            self.outcomes["remembered"] += 1
            return True
        if self._admitted >= self._cap:
            self.outcomes["busy"] += 1
            raise AuthenticationBusy("Authorization", "too many password checks are waiting; try again in a second")
        self._admitted += 1
        try:
            async with self._running:
                if gone():
                    self.outcomes["client_gone"] += 1
                    return False
                loop = asyncio.get_running_loop()
                matched = await loop.run_in_executor(self._pool, _checkpw, password, hashed or _stand_in(cost))
        finally:
            self._admitted -= 1
        if matched and hashed is not None:
            self.outcomes["right"] += 1
            self._verified.add(user, password, hashed)
            return True
        self.outcomes["wrong"] += 1
        return False
