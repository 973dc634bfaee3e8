"""What the exporter refuses, below the HTTP layer: each error names the field at fault.

``exporter/problems.py`` holds the one table that turns these (and the
protocol's ``InvalidPayload``) into HTTP statuses.
"""

from __future__ import annotations


class Refused(Exception):
    """A request the exporter will not carry out; nothing was changed. ``field`` names what is at fault."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


class LimitExceeded(Refused):
    """A change would pass a cardinality limit; existing series stay as they are."""


class NotFound(Refused):
    """No such deployment, replica or engine."""


class UnknownReplica(NotFound):
    """A heartbeat for a replica the exporter does not hold: its sender must send its state again."""


class InvalidRequest(Refused):
    """A query parameter or path segment out of its range or pattern."""


class UnsupportedMediaType(Refused):
    """A body in a media type the route does not take."""


class StorageUnavailable(RuntimeError):
    """A write could not be committed (or the store could not be read); nothing was changed."""
