"""Bearer token files (``--web.ingest-token-file``, ``--web.metrics-token-file``), read again when they change."""

from __future__ import annotations

from pathlib import Path

from exporter.flags.option import SettingsError
from exporter.flags.watched_files import Watched
from exporter.secret_files import read_secret


def watched_tokens(flag: str, path: Path) -> Watched[frozenset[bytes]]:
    """One token per line (blank lines and ``#`` comments ignored): several tokens overlap during a rotation.

    A token file is a secret: a mode that lets others read it is warned about (log and metric).
    """

    def load() -> tuple[frozenset[bytes], tuple[Path, ...]]:
        lines = read_secret(flag, path).splitlines()
        tokens = frozenset(
            line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#")
        )
        if not tokens:
            raise SettingsError(f"{flag} {path}: the file holds no token")
        return tokens, (path,)

    return Watched(f"{flag} {path}", load, secret=True)
