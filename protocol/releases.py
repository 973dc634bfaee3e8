"""What each vLLM release sends and shows, from the generated table ``vllm_releases.json``.

The table is read from the released wheels by ``scripts/generate_vllm_releases.py``
(never edited by hand): per release, the ready-response fields in wire order
and the ``CacheConfig.metrics_info()`` labels with the values a default
``CacheConfig`` renders. A ready response names its release in
``vllm_version`` (0.23+); older ones are recognised by the keys they carry.
"""

from __future__ import annotations

import ast
import re
from functools import cache, lru_cache
from importlib import resources

import msgspec


class ReadyField(msgspec.Struct, frozen=True):
    """One field of a release's ``EngineCoreReadyResponse``; ``default`` is its Python source."""

    name: str
    annotation: str
    required: bool
    default: str | None

    def default_value(self) -> object:
        """The value vLLM's dataclass takes when the field is not given (``None``, ``False``, ``0``)."""
        return ast.literal_eval(self.default) if self.default is not None else None


class Label(msgspec.Struct, frozen=True):
    """One ``metrics_info()`` key and the value it has on a default ``CacheConfig``."""

    name: str
    default: str


class ReadyResponseTable(msgspec.Struct, frozen=True):
    source: str
    fields: tuple[ReadyField, ...]


class CacheConfigTable(msgspec.Struct, frozen=True):
    source: str
    default_block_size: int
    labels: tuple[Label, ...]


class Release(msgspec.Struct, frozen=True):
    """One vLLM release as the exporter needs to know it."""

    version: str
    wheel: str
    wheel_sha256: str
    ready_response: ReadyResponseTable
    applied_fields: tuple[str, ...]
    cache_config: CacheConfigTable

    @property
    def key(self) -> tuple[int, ...]:
        return version_key(self.version)

    @property
    def field_names(self) -> frozenset[str]:
        return frozenset(field.name for field in self.ready_response.fields)

    def default_labels(self) -> dict[str, str]:
        """The labels of a default ``CacheConfig`` of this release, in ``metrics_info()`` order."""
        return {label.name: label.default for label in self.cache_config.labels}


class ReleaseTable(msgspec.Struct, frozen=True):
    generated_by: str
    command: str
    generated_at: str
    releases: tuple[Release, ...]


_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def version_key(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0, 0)``; ``()`` for text that is no version."""
    match = _VERSION.match(version.strip())
    return tuple(int(part or 0) for part in match.groups()) if match else ()


@cache
def releases() -> tuple[Release, ...]:
    """Every known release, oldest first."""
    data = resources.files("protocol").joinpath("vllm_releases.json").read_bytes()
    return tuple(sorted(msgspec.json.decode(data, type=ReleaseTable).releases, key=lambda r: r.key))


# Versions (and sets of keys) looked up lately: a fleet's engines send a handful.
VERSIONS_KEPT = 256


def newest() -> Release:
    return releases()[-1]


@lru_cache(maxsize=VERSIONS_KEPT)
def release_of(vllm_version: str | None, keys: frozenset[str]) -> Release:
    """The release a ready response with these ``keys`` comes from (looked up once for each version and keys: a
    fleet's engines send a handful).

    By ``vllm_version`` when it names one: that release, or for a version the
    table does not know the newest known release not newer than it (a patch or a
    future release keeps its predecessor's label table). Without one (0.20-0.22),
    the newest release that sends exactly these keys, else the oldest that sends
    all of them.
    """
    named = release_named(vllm_version) if vllm_version else None
    if named is not None:
        return named
    known = _versions_and_fields()
    keys = keys & known[-1][1]
    exact = [release for _, fields, release in known if fields == keys]
    if exact:
        return exact[-1]
    covering = [release for _, fields, release in known if keys <= fields]
    return covering[0] if covering else known[-1][2]


@lru_cache(maxsize=VERSIONS_KEPT)
def release_named(vllm_version: str) -> Release | None:
    """The release ``vllm_version`` names: that release, or for a version the table does not know the newest known
    release not newer than it; ``None`` for text that is no version or one older than every known release."""
    key = version_key(vllm_version)
    older = [release for version, _, release in _versions_and_fields() if version <= key] if key else []
    return older[-1] if older else None


@cache
def _versions_and_fields() -> tuple[tuple[tuple[int, ...], frozenset[str], Release], ...]:
    """Each release's version key and field names, worked out once: every sync of a replica looks its release up."""
    return tuple((release.key, release.field_names, release) for release in releases())
