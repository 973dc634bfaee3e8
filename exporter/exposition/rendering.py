"""What ``/metrics`` sends, in every format it advertises, and the caches that make a scrape cost little.

Two formats, negotiated here alone: Prometheus text 0.0.4 and OpenMetrics
1.0.0. Any other ``Accept`` (other versions, broken parameters) gets text
0.0.4, never an error and never a body labelled with a version it is not.

The cache-config families (nearly all the bytes) are rendered here from the
samples of ``exporter/exposition/series.py``, one replica at a time and once per change of it (replicas
are immutable, so the lines are cached by identity; the info lines, half the bytes, are
kept deflated). A scrape of a large fleet
sends them in chunks joined as they go, so no whole copy of it is ever held (a
small body is joined once per state version);
for gzip the config families (everything but last-seen, which is last) are
compressed in parts of a few replicas' lines each, and after a change of some
replicas' config only the parts holding their lines are compressed again (the
CRC-32 of the stream combined from the parts', ``exporter/exposition/crc32.py``:
a restart storm's scrape compresses what restarted since the last one, not the
fleet); the liveness lines go
stored (deflate's blocks without compression): they change with every heartbeat,
so each new state version would compress them anew for each scrape. The families are
gauges, whose lines are the same in both formats, so text and OpenMetrics
share that part.
The exporter's own metrics follow, rendered by prometheus_client's encoder of
the format from their registry (reused until a count changes, and at most a
second: the process metrics read /proc). For gzip each cached part ends on a byte
boundary and keeps the CRC-32 of what it holds, and the tail is a deflate part of its
own, so each scrape compresses only the small tail yet sends one valid gzip stream.
A shard's lines (``exporter/exposition/shards.py``) are selected from a version's once per shard, and
compressed on their own: the whole fleet's compressed part stays cached for unsharded scrapes.
"""

from __future__ import annotations

import itertools
import operator
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry

from exporter.exposition import crc32
from exporter.exposition.formats import GZIP_HEADER, GZIP_LEVEL, SELF_METRICS_SECONDS, Format, negotiate
from exporter.exposition.lines import FleetLines, ReplicaLines, Segment
from exporter.exposition.shards import Shard
from exporter.exposition.telemetry import Telemetry
from exporter.state.exporter_state import ExporterState, PerVersion

# A fleet whose lines were up to this size is rendered on the event loop (``Exposition.is_small``): at the bound
# (24 one-engine replicas, in process, after a heartbeat) a render took 133 us as gzip, as Prometheus asks, and
# 376 us as plain text (p50), while a worker thread waiting for the interpreter's lock behind a busy loop waits
# for tens of milliseconds each time it takes it back (every zlib call gives it up).
# tests/exposition/test_inline_render.py holds the bound.
INLINE_RENDER_BYTES = 64 << 10
# A body up to this size is kept joined for its state version: a small fleet's scrapes send it as it is.
JOINED_BYTES = 4 << 20
# Shards whose lines are kept for the current state version: more than the scrape jobs of any sharded setup.
SHARDS_KEPT = 64
# Bytes strings of the config families (a replica's lines of one, or a header) compressed together: a change
# compresses again the parts that hold its replica's lines. A small fleet's config is one part.
SEGMENT_PIECES = 128


class _Compressed(NamedTuple):
    """The start of every gzip stream while ``generation`` stays: the gzip header and the config families
    raw-deflated up to a byte boundary, with their CRC-32 and length for the trailer."""

    generation: int
    prefix: bytes
    crc: int
    size: int


class _Part(NamedTuple):
    """A segment's lines raw-deflated on their own up to a byte boundary (a sync flush: they refer to nothing
    before them, and a part may follow), with what it holds: the CRC-32 and ``crc32.shift`` of its length."""

    segment: Segment
    deflated: bytes
    crc: int
    size: int
    shift: int

    @classmethod
    def of(cls, segment: Segment) -> _Part:
        text = segment.text()
        compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
        deflated = compressor.compress(text) + compressor.flush(zlib.Z_SYNC_FLUSH)
        return cls(segment, deflated, zlib.crc32(text), len(text), crc32.shift(len(text)))

    def holds(self, segment: Segment) -> bool:
        """Whether this part is of ``segment``'s lines: the same objects in the same places."""
        kept = self.segment
        same_place = kept.start == segment.start and kept.per_family == segment.per_family
        return (
            same_place
            and len(kept.pieces) == len(segment.pieces)
            and all(map(operator.is_, kept.pieces, segment.pieces))
        )


class _Parts:
    """The config families compressed in parts of ``SEGMENT_PIECES`` replicas' lines each: a part whose replicas'
    lines are the same objects as at the last call is taken as it was, so a change of some replicas compresses
    only their parts again, and the stream's CRC-32 is combined from the parts'. The parts of the last call are
    kept, no others."""

    def __init__(self) -> None:
        self._kept: dict[int, _Part] = {}

    def compressed(self, lines: FleetLines) -> _Compressed:
        kept, fresh = self._kept, {}
        deflated, crc, size = [GZIP_HEADER], 0, 0
        for segment in lines.config_segments(SEGMENT_PIECES):
            part = kept.get(segment.number)
            if part is None or not part.holds(segment):
                part = _Part.of(segment)
            fresh[segment.number] = part
            deflated.append(part.deflated)
            crc, size = crc32.combine(crc, part.crc, part.shift), size + part.size
        self._kept = fresh
        return _Compressed(lines.generation, b"".join(deflated), crc, size)


class _Rendered:
    """One state version's lines, and (on first demand) the gzip stream of them up to the exporter's metrics."""

    def __init__(self, lines: FleetLines) -> None:
        self.lines = lines
        self._joined: bytes | None = None
        self._gzip: _Gzip | None = None
        self._lock = threading.Lock()

    def text(self) -> Iterable[bytes]:
        """The plain body's chunks: joined once when small, else joined anew as each scrape sends them."""
        lines = self.lines
        if lines.length > JOINED_BYTES:
            return itertools.chain(lines.config_chunks(), lines.liveness_chunks())
        with self._lock:
            if self._joined is None:
                self._joined = b"".join([*lines.config_chunks(), *lines.liveness_chunks()])
            return (self._joined,)

    @property
    def has_gzip(self) -> bool:
        return self._gzip is not None

    def gzip(self, config: Callable[[FleetLines], _Compressed]) -> _Gzip:
        """The gzip stream up to the exporter's metrics: the config part (shared across versions) and this
        version's liveness part, stored (deflate's blocks without compression)."""
        with self._lock:
            if self._gzip is None:
                compressed = config(self.lines)
                stored = zlib.compressobj(0, zlib.DEFLATED, -zlib.MAX_WBITS)
                liveness, crc, size = _deflated(stored, self.lines.liveness_chunks(), compressed.crc)
                self._gzip = _Gzip(compressed.prefix, liveness, crc, compressed.size + size)
            return self._gzip


class _Gzip(NamedTuple):
    """A gzip stream without its end: the compressed parts, and the CRC-32 and length of what they hold."""

    prefix: bytes
    liveness: bytes
    crc: int
    size: int

    def finished(self, tail: bytes) -> tuple[bytes, ...]:
        """The whole stream, ``tail`` compressed last (a new deflate part: it refers to nothing before it)."""
        compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
        end = compressor.compress(tail) + compressor.flush()
        trailer = struct.pack("<II", zlib.crc32(tail, self.crc), (self.size + len(tail)) & 0xFFFFFFFF)
        return (self.prefix, self.liveness, end + trailer)


def _deflated(compressor: zlib._Compress, chunks: Iterable[bytes], crc: int = 0) -> tuple[bytes, int, int]:
    """``chunks`` raw-deflated by ``compressor`` up to a byte boundary, so that another deflate part may follow;
    the CRC-32 of the chunks continued from ``crc``, and their length."""
    compressed = []
    size = 0
    for chunk in chunks:
        compressed.append(compressor.compress(chunk))
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    compressed.append(compressor.flush(zlib.Z_SYNC_FLUSH))
    return b"".join(compressed), crc, size


class Exposition:
    """Renders ``/metrics`` bodies: the replicas of ``state``, then the exporter's own metrics in ``registry``."""

    def __init__(
        self, state: ExporterState, lines: ReplicaLines, registry: CollectorRegistry, telemetry: Telemetry
    ) -> None:
        self._state = state
        self._registry = registry
        self._telemetry = telemetry
        self._rendered = PerVersion(state, lambda replicas: _Rendered(lines.fleet(replicas)))
        self._compressed: _Compressed | None = None
        self._parts = _Parts()
        # Each shard asked for: the whole version's lines it was selected from, and its own.
        self._selected: dict[Shard, tuple[_Rendered, _Rendered]] = {}
        self._self_metrics: dict[Format, tuple[tuple[object, ...], bytes]] = {}

    def is_fresh(self, gzip: bool, shard: Shard | None = None) -> bool:
        """True when ``render`` will neither render nor compress the large part (cheap on the event loop)."""
        rendered = self._rendered.fresh()
        if rendered is not None and shard is not None:
            selected = self._selected.get(shard)
            rendered = selected[1] if selected is not None and selected[0] is rendered else None
        return rendered is not None and (rendered.has_gzip or not gzip)

    def is_small(self) -> bool:
        """True when the last version rendered was at most ``INLINE_RENDER_BYTES``: the next one (of the same
        fleet, give or take what changed since) renders on the event loop for less than a hand-off to a thread
        costs while the loop is busy."""
        rendered = self._rendered.last()
        return rendered is not None and rendered.lines.length <= INLINE_RENDER_BYTES

    def _shard(self, rendered: _Rendered, shard: Shard | None) -> _Rendered:
        """The lines of ``shard`` of ``rendered`` (all of them for none), selected once per state version; of the
        shards asked for, the last ``SHARDS_KEPT`` are kept."""
        if shard is None:
            return rendered
        selected = self._selected.get(shard)
        if selected is not None and selected[0] is rendered:
            return selected[1]
        lines = _Rendered(rendered.lines.select(shard.keeps))
        self._selected.pop(shard, None)
        self._selected[shard] = (rendered, lines)
        while len(self._selected) > SHARDS_KEPT:
            self._selected.pop(next(iter(self._selected)), None)
        return lines

    def _config_gzip(self, lines: FleetLines) -> _Compressed:
        """The compressed config part, again only when the fleet's config lines changed (under a version's lock),
        and then only the parts of the replicas that changed."""
        compressed = self._compressed
        if compressed is None or compressed.generation != lines.generation or lines.generation < 0:
            compressed = self._compressed = self._parts.compressed(lines)
        return compressed

    def _own_metrics(self, served: Format) -> bytes:
        """The registry in ``served``'s format, without its end marker."""
        healthy = self._state.storage_error is None
        key = (self._telemetry.generation, healthy, int(time.monotonic() / SELF_METRICS_SECONDS))
        cached = self._self_metrics.get(served)
        if cached is None or cached[0] != key:
            cached = (key, served.render(self._registry).removesuffix(served.end))
            self._self_metrics[served] = cached
        return cached[1]

    def render(self, accept: str, gzip: bool, shard: Shard | None = None) -> tuple[Iterable[bytes], int, str]:
        """The body (chunks to send in order, joined as they are sent), its length and its content type; with a
        ``shard``, its deployments' lines only (the exporter's own metrics come with every shard)."""
        served = negotiate(accept)
        rendered = self._shard(self._rendered.current(), shard)
        tail = self._own_metrics(served) + served.end
        if not gzip:
            return itertools.chain(rendered.text(), (tail,)), rendered.lines.length + len(tail), served.content_type
        body = rendered.gzip(self._config_gzip if shard is None else _Parts().compressed).finished(tail)
        return body, sum(map(len, body)), served.content_type
