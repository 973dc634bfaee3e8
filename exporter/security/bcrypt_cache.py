"""Passwords already verified against a bcrypt hash, so that a scrape costs one bcrypt check per password change.

As exporter-toolkit's cache: keyed by a digest of user, password and hash together (a new hash or password
misses), bounded, least recently used out first. Only successful checks are kept, so failed guesses cannot
push the scrapers' entries out. Only keyed digests are kept, never a password.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict

DEFAULT_SIZE = 1024


class VerifiedCache:
    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self._key = secrets.token_bytes(32)
        self._size = size
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def _digest(self, user: str, password: bytes, hashed: bytes) -> bytes:
        return hmac.new(self._key, b"\0".join((user.encode(), password, hashed)), hashlib.sha256).digest()

    def __contains__(self, check: tuple[str, bytes, bytes]) -> bool:
        digest = self._digest(*check)
        with self._lock:
            if digest not in self._verified:
                return False
            self._verified.move_to_end(digest)
            return True

    def add(self, user: str, password: bytes, hashed: bytes) -> None:
        digest = self._digest(user, password, hashed)
        with self._lock:
            self._verified[digest] = None
            self._verified.move_to_end(digest)
            while len(self._verified) > self._size:
                self._verified.popitem(last=False)
