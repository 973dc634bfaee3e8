"""The vLLM wire format, each release's labels and the cache-config sync rules.

Free of web and metrics imports, so that an engine-side sender can use it alone.
"""

from protocol.errors import InvalidPayload, MalformedPayload, SyncConflict
from protocol.labels import decode_static_labels
from protocol.ready_response import (
    EngineCoreReadyResponse,
    decode_as_sent,
    decode_ready_response,
    encode_ready_response,
    is_set,
)
from protocol.releases import Release, release_of, releases
from protocol.sync import EngineFigures, SyncedConfig, check_engine_index, sync

__all__ = [
    "EngineCoreReadyResponse",
    "EngineFigures",
    "InvalidPayload",
    "MalformedPayload",
    "Release",
    "SyncConflict",
    "SyncedConfig",
    "check_engine_index",
    "decode_as_sent",
    "decode_ready_response",
    "decode_static_labels",
    "encode_ready_response",
    "is_set",
    "release_of",
    "releases",
    "sync",
]
