"""The vLLM wire format, each release's labels and the cache-config sync rules.

Free of web and metrics imports, so that an engine-side sender can use it alone.
"""

from protocol.errors import InvalidPayload, MalformedPayload, SyncConflict
from protocol.labels import decode_static_labels
from protocol.ready_response import (
    KV_CACHE_GROUPS_KEY,
    EngineCoreReadyResponse,
    KVCacheGroup,
    KVCacheGroups,
    decode_accepted_ready_response,
    decode_ready_response,
    decode_shown_ready_response,
    encode_ready_response,
    is_set,
    shown_as_json,
    spec_kind,
)
from protocol.releases import Release, release_of, releases
from protocol.sync import (
    FROM_GROUPS,
    FROM_RULE,
    EngineFigures,
    EngineInput,
    SyncedConfig,
    check_agreement,
    check_engine_index,
    engine_input,
    sync,
    sync_inputs,
)

__all__ = [
    "FROM_GROUPS",
    "FROM_RULE",
    "KV_CACHE_GROUPS_KEY",
    "EngineCoreReadyResponse",
    "EngineFigures",
    "EngineInput",
    "InvalidPayload",
    "KVCacheGroup",
    "KVCacheGroups",
    "MalformedPayload",
    "Release",
    "SyncConflict",
    "SyncedConfig",
    "check_agreement",
    "check_engine_index",
    "decode_accepted_ready_response",
    "decode_ready_response",
    "decode_shown_ready_response",
    "decode_static_labels",
    "encode_ready_response",
    "engine_input",
    "is_set",
    "release_of",
    "releases",
    "shown_as_json",
    "spec_kind",
    "sync",
    "sync_inputs",
]
