"""An exporter's ``Retry-After`` (RFC 9110, 10.2.3), as the plugin honours it: how long to wait before asking again.

An exporter that answers 429 or 503 with ``Retry-After`` sheds the load of a fleet: every vLLM server waits that
long before its next request, heartbeats included. A wait longer than ``MAX_WAIT_SECONDS`` is cut to it, so that a
stray header (another service at the configured URL, a mistyped date) silences no vLLM server for long: the
exporter's own waits are seconds.

Pure: the caller passes the wall-clock time an HTTP date is measured against.
"""

from __future__ import annotations

import datetime
import email.utils

# The longest wait honoured, in seconds.
MAX_WAIT_SECONDS = 600.0


def seconds_of(value: str | None, now: float) -> float | None:
    """The wait a ``Retry-After`` value asks for at wall-clock time ``now`` (Unix seconds), at least 0 and at most
    ``MAX_WAIT_SECONDS``; ``None`` when there is no value or it is neither delta-seconds nor an HTTP date."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        seconds = float(value)
    else:
        try:
            date = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if date.tzinfo is None:  # ``-0000``: RFC 9110 dates are in GMT all the same
            date = date.replace(tzinfo=datetime.UTC)
        seconds = date.timestamp() - now
    return min(max(seconds, 0.0), MAX_WAIT_SECONDS)
