"""Errors the protocol raises, each naming the field at fault so the HTTP layer can say which."""

from __future__ import annotations

import re

import msgspec

# Messages that name the field in the reason, not in the path: the path is then the object holding it.
_NAMED_FIELD = re.compile(r"Object (?:contains unknown|missing required) field `(.*)`")


class InvalidPayload(ValueError):
    """Data that does not fit the schema; ``field`` is a path such as ``$.block_size``."""

    # Not even well-formed msgpack/JSON/TOML, as opposed to well-formed data of the wrong shape.
    malformed = False

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{reason} (at {field})")
        self.field = field
        self.reason = reason

    @classmethod
    def from_msgspec(cls, error: msgspec.DecodeError) -> InvalidPayload:
        """Split msgspec's ``"reason - at `$.path`"`` message into path and reason."""
        reason, marker, path = str(error).rpartition(" - at `")
        path = path.rstrip("`") if marker else "$"
        # A map key that fails: msgspec says "at `key` in `$.path`".
        path = path.rpartition("key` in `")[2]
        reason = reason if marker else str(error)
        named = _NAMED_FIELD.fullmatch(reason)
        if named:
            path = f"{path}.{named.group(1)}"
        kind = cls if isinstance(error, msgspec.ValidationError) else MalformedPayload
        return kind(path, reason)


class MalformedPayload(InvalidPayload):
    """Bytes that are not well-formed msgpack, JSON, TOML or YAML at all."""

    malformed = True


class SyncConflict(InvalidPayload):
    """Engines of one deployment contradict each other where vLLM requires them to agree."""
