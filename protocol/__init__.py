"""The vLLM wire format and the cache-config sync rules.

Free of web and metrics imports, so that an engine-side sender can use it alone.
"""

from protocol.cache_config import (
    CacheConfig,
    CacheConfigUpdate,
    apply_update,
    decode_cache_config_update,
    render_labels,
)
from protocol.errors import InvalidPayload, SyncConflict
from protocol.ready_response import (
    EngineCoreReadyResponse,
    decode_ready_response,
    encode_ready_response,
    is_set,
)
from protocol.sync import SyncedConfig, check_engine_index, sync

__all__ = [
    "CacheConfig",
    "CacheConfigUpdate",
    "EngineCoreReadyResponse",
    "InvalidPayload",
    "SyncConflict",
    "SyncedConfig",
    "apply_update",
    "check_engine_index",
    "decode_cache_config_update",
    "decode_ready_response",
    "encode_ready_response",
    "is_set",
    "render_labels",
    "sync",
]
