"""Bearer tokens as every client of the exporter sends them (``push``, the vLLM plugin, the probe)."""

from __future__ import annotations

import re
from pathlib import Path

# RFC 7230 visible characters: anything else could break the header (and land in an error message).
_BEARER_TOKEN = re.compile(r"[!-~]+")


class TokenError(ValueError):
    """A bearer token that cannot be read or sent; the message says why and never holds the token."""


def read_token(path: str | Path) -> str:
    """The token in a file, surrounding white space stripped (empty when the file is)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as error:
        raise TokenError(f"{path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise TokenError(f"{path}: not UTF-8 text") from None


def bearer(token: str) -> str:
    """The ``Authorization`` header value for ``token``."""
    if not _BEARER_TOKEN.fullmatch(token):
        raise TokenError("the token has characters a bearer token cannot have (whitespace or non-ASCII)")
    return f"Bearer {token}"
