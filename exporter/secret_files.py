"""Secrets read from the files flags name (bearer tokens, passwords), as every client of the exporter reads a
token file: one reader, ``protocol.tokens.secret_text``, for the exporter, the probe, ``push`` and the plugin.

Its own module, beside ``exporter/errors.py``: security and the probe both read secrets, and the part that declares
flags (``exporter/flags/``) stays free of the protocol, so that the state can declare its options with it.
"""

from __future__ import annotations

from pathlib import Path

from exporter.flags.option import SettingsError, read_file
from protocol.tokens import TokenError, secret_text


def read_secret(flag: str, path: Path) -> str:
    """A secret from a file, read as every client reads a token file (``protocol.tokens.secret_text``: a
    byte-order mark and the white space around dropped); never echoed in messages."""
    try:
        secret = secret_text(read_file(flag, path))
    except TokenError as error:
        raise SettingsError(f"{flag} {path}: {error}") from None
    if not secret:
        raise SettingsError(f"{flag} {path}: the file is empty")
    return secret
