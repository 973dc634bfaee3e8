"""Bearer tokens as every client of the exporter sends them (``push``, the vLLM plugin, the probe)."""

from __future__ import annotations

import re
from pathlib import Path

# RFC 7230 visible characters: anything else could break the header (and land in an error message).
_BEARER_TOKEN = re.compile(r"[!-~]+")


class TokenError(ValueError):
    """A bearer token that cannot be read or sent; the message says why and never holds the token."""


def secret_text(data: bytes) -> str:
    """A secret file's text as every reader of one takes it: UTF-8, surrounding white space stripped, and a
    leading byte-order mark dropped (editors on Windows write one; it is no part of any token, and kept it would
    make a token that never matches, refused in silence).

    Raises ``TokenError`` for bytes that are not UTF-8.
    """
    try:
        return data.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        raise TokenError("not UTF-8 text") from None


def read_token(path: str | Path) -> str:
    """The token in a file, as ``secret_text`` takes it (empty when the file is)."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TokenError(f"{path}: {error.strerror}") from None
    try:
        return secret_text(data)
    except TokenError as error:
        raise TokenError(f"{path}: {error}") from None


def bearer(token: str) -> str:
    """The ``Authorization`` header value for ``token``."""
    if not _BEARER_TOKEN.fullmatch(token):
        raise TokenError("the token has characters a bearer token cannot have (whitespace or non-ASCII)")
    return f"Bearer {token}"
