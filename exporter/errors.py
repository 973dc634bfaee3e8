"""What the exporter refuses, below the HTTP layer and at its door (the request guard's limits): each error
names the field at fault.

``exporter/server/problems.py`` holds the one table that turns these (and the
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


class Forbidden(Refused):
    """A target the probe's allowlist does not let the exporter fetch."""


class HostNotServed(Refused):
    """A ``Host`` name this exporter does not serve (``--web.allowed-hosts``, against DNS rebinding)."""


class BodyTooLarge(Refused):
    """A request body over ``--web.max-request-bytes``."""


class BodyTimeout(Refused):
    """A request body that did not arrive within ``--web.read-timeout``."""


class ClientDisconnected(Refused):
    """The client left before sending the whole body."""


class HeadersTooLarge(Refused):
    """A request line and headers over ``--web.max-header-bytes``."""


class HeaderTimeout(Refused):
    """A request line and headers that did not arrive within ``--web.header-timeout``."""


class TooManyConnections(Refused):
    """A connection past ``--web.max-connections`` (or what the open-file limit allows)."""


class StorageUnavailable(RuntimeError):
    """A write could not be committed (or the store could not be read); nothing was changed."""
