"""The cache-config lines of each replica, rendered once per change of it from the samples of ``series``
(replicas are immutable, so the lines are cached by identity; the info lines, half the bytes, are kept
deflated), and the fleet's lines gathered by family for a scrape, carried forward between changes."""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client.utils import floatToGoString

from exporter.exposition.formats import GZIP_LEVEL
from exporter.exposition.series import (
    EVERY_LABEL,
    FAMILIES,
    INFO,
    LIVENESS,
    Family,
    InfoLabels,
    Labels,
    Sample,
    engine_samples,
    liveness_values,
    replica_identity,
    replica_own_samples,
    replica_samples,
)
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, ReplicaKey
from protocol import EngineFigures

# Label pairs rendered lately: a fleet's engines repeat the same release's labels and values, line after line.
PAIRS_KEPT = 4096


@functools.lru_cache(maxsize=PAIRS_KEPT)
def _pair(label: str, value: str) -> str:
    """``label="value"``, escaped as both formats escape label values."""
    escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return f'{label}="{escaped}"'


def _labels(labels: Labels) -> str:
    return ",".join(itertools.starmap(_pair, labels))


# Values rendered lately: block sizes, counts and flags repeat across engines and families; a Go float is slow.
VALUES_KEPT = 4096
_value = functools.lru_cache(maxsize=VALUES_KEPT)(floatToGoString)


@functools.lru_cache(maxsize=PAIRS_KEPT)
def _pair_bytes(label: str, value: str) -> int:
    """The bytes of ``_pair(label, value)`` as sent (UTF-8)."""
    return len(_pair(label, value).encode())


@functools.lru_cache(maxsize=VALUES_KEPT)
def _value_bytes(value: float) -> int:
    """The bytes of ``_value(value)``: ASCII, so its length."""
    return len(_value(value))


def _line_bytes(name_bytes: int, labels: Labels, value: float) -> int:
    """The bytes of ``_line(name, labels, value)`` without writing it: the name, the braces, the pairs and their
    commas, the space, the value and the newline (every sample has its identity labels, so never none)."""
    return name_bytes + sum(itertools.starmap(_pair_bytes, labels)) + len(labels) + _value_bytes(value) + 3


def _line(name: str, labels: Labels, value: float) -> str:
    """A sample as both formats write it: who (deployment, replica, engine) first, then the labels in the
    order of the sending vLLM release; values as prometheus_client (so vLLM) writes them, like ``1056.0``."""
    return f"{name}{{{_labels(labels)}}} {_value(value)}\n"


# A large body is sent in chunks of about this size, joined as they are sent: no whole copy of it is held.
CHUNK_BYTES = 1 << 20


def _deflate(lines: bytes) -> bytes:
    return zlib.compress(lines, GZIP_LEVEL, -zlib.MAX_WBITS)


def _inflate(deflated: bytes) -> bytes:
    return zlib.decompress(deflated, -zlib.MAX_WBITS)


# Engines whose counts the byte budget keeps, of the replicas it counted last: those changing one engine at a time
# lately (a bound, so that replicas that come and go leave little behind).
COUNTS_KEPT = 8192


class _EngineCount(NamedTuple):
    """The bytes of an engine's lines but its info line's labels of the release (the replica's, counted once for
    all its engines), and what they depend on."""

    figures: EngineFigures
    received_at: float
    size: int


class ReplicaPart(NamedTuple):
    """A replica's lines: its info lines deflated, its other config families and its liveness (a bytes string per
    family), and the bytes of all its lines as sent.

    The info lines are half a replica's bytes (each engine's line repeats the release's labels) and deflate to
    a fourteenth: kept so, a fleet's lines take half the memory, for an inflate of them where a body is built
    from the lines (a text body, or the gzip one after a config changed).
    """

    info: bytes
    config: tuple[bytes, ...]
    liveness: tuple[bytes, ...]
    size: int
    # The replica's identity labels as rendered: a heartbeat's liveness lines need only their values rendered.
    identity: str

    @classmethod
    def rendered(cls, families: tuple[bytes, ...], identity: str) -> ReplicaPart:
        """From a bytes string per family, in the order of ``FAMILIES`` (info first, liveness last)."""
        kept = len(families) - len(LIVENESS)
        return cls(_deflate(families[0]), families[1:kept], families[kept:], sum(map(len, families)), identity)

    def alive(self, liveness: tuple[bytes, ...]) -> ReplicaPart:
        """The same config lines with new liveness lines (a heartbeat's)."""
        size = self.size - sum(map(len, self.liveness)) + sum(map(len, liveness))
        return self._replace(liveness=liveness, size=size)

    def families(self) -> tuple[bytes, ...]:
        """A bytes string per family, as sent."""
        return (_inflate(self.info), *self.config, *self.liveness)


class ReplicaLines:
    """Each replica's lines, rendered once per change of it; the byte budget measures what scrapes then send.

    A replica's lines are a ``ReplicaPart``: its config (all but the ``LIVENESS`` families, the info lines
    deflated) and its liveness. ``generation`` counts the changes of the config lines of the fleet (a replica's config
    rendered again, one gone): a cache of what they compress to is good while it stays.

    Called from the writer thread (the budget) and from the scrape's thread; a render lost to a race is only
    done again. The cache holds the replicas of the last scrape, and no others: each scrape drops those that
    went, and a replica the budget measures is kept only when it replaces one of them, so replicas that come
    and go between scrapes leave nothing behind.
    """

    def __init__(self, prefix: str = "", info_labels: InfoLabels = EVERY_LABEL) -> None:
        self.info_labels = info_labels
        self.names = tuple(f"{prefix}cache_config_{family.suffix}" for family in FAMILIES)
        self._name_bytes = {family: len(name.encode()) for family, name in zip(FAMILIES, self.names, strict=True)}
        # Per replica the budget counted last (``COUNTS_KEPT`` engines at most): each engine's lines but its info
        # line; ``_engines_counted``, how many engines that holds.
        self._counts: dict[ReplicaKey, dict[int, _EngineCount]] = {}
        self._engines_counted = 0
        self.headers = tuple(
            f"# HELP {name} {family.help}\n# TYPE {name} gauge\n".encode()
            for name, family in zip(self.names, FAMILIES, strict=True)
        )
        self.generation = 0
        self._generation_lock = threading.Lock()
        self._rendered: dict[ReplicaKey, tuple[Replica, ReplicaPart]] = {}
        # The lines of the last map a scrape or the writer put in order. Their lists are patched in place by the
        # writer until a scrape is lent them (``_lent``); then the next patch copies them first (copy on write).
        self._ordered: _Ordered | None = None
        self._lent = True
        self._ordered_lock = threading.Lock()

    def of(self, replica: Replica) -> tuple[bytes, ...]:
        """One replica's lines, a bytes string per family."""
        return self.part(replica).families()

    def part(self, replica: Replica) -> ReplicaPart:
        """One replica's (config, liveness) lines.

        A heartbeat replaces the replica but keeps its synced config and engines (the same objects) and its
        interval: then only the liveness lines are rendered again, so a fleet's heartbeats cost a scrape little.
        """
        return self._part(replica)[0]

    def _part(self, replica: Replica) -> tuple[ReplicaPart, bool]:
        """``part``, and whether its config lines were rendered (the generation moved)."""
        cached = self._rendered.get(replica.key)
        if cached is not None and cached[0] is replica:
            return cached[1], False
        rendered = (
            cached is None
            or cached[0].synced is not replica.synced
            or cached[0].engines is not replica.engines
            or cached[0].heartbeat_seconds != replica.heartbeat_seconds
        )
        if rendered:
            part = self._render(replica)
            self._next_generation()  # before the part is cached: whoever finds it sees the new generation
        else:
            part = cached[1].alive(self._liveness(cached[1].identity, replica))
        self._rendered[replica.key] = (replica, part)
        return part, rendered

    def render_ahead(self, before: ReplicaMap, after: ReplicaMap, changed: Iterable[Replica]) -> None:
        """On the writer's thread, after it replaced ``before`` by ``after`` (``changed`` the replicas it put in):
        render the changed replicas the cache holds, so that the next scrape finds them.

        When the lines last put in order are of ``before`` and no key came or went (heartbeats, restarts), they
        are carried forward to ``after``, the changed replicas' parts put in their places: the next scrape of
        ``after`` then sends them as they are, without a look at each replica. The carried lines keep their
        generation while every config part is the same object, else take a new one (a name no other lines have).
        """
        ordered = self._ordered
        if ordered is None or ordered.replicas is not before or after.key_set is not before.key_set:
            for replica in changed:
                if replica.key in self._rendered:
                    self._part(replica)
            return
        moved = [(ordered.position[replica.key], self._part(replica)[0]) for replica in changed]
        with self._ordered_lock:
            if self._ordered is not ordered:  # a scrape put another map in order meanwhile: it renders what it needs
                return
            if self._lent:
                parts, liveness = list(ordered.parts), [list(lines) for lines in ordered.liveness]
            else:
                parts, liveness = ordered.parts, ordered.liveness
            length, same_config = ordered.length, ordered.generation >= 0
            for index, part in moved:
                previous = parts[index]
                same_config = same_config and part.info is previous.info and part.config is previous.config
                parts[index] = part
                length += part.size - previous.size
                for lines, replica_lines in zip(liveness, part.liveness, strict=True):
                    lines[index] = replica_lines
            generation = ordered.generation if same_config else self._next_generation()
            self._ordered = _Ordered(after, ordered.order, ordered.position, parts, liveness, length, generation)
            self._lent = False

    def _next_generation(self) -> int:
        with self._generation_lock:  # from the writer and the scrape's threads: no increment is lost
            self.generation += 1
            return self.generation

    def _render(self, replica: Replica) -> ReplicaPart:
        families = self._encode(self.names, replica_samples(replica, self.info_labels))
        return ReplicaPart.rendered(families, _labels(replica_identity(replica)))

    def _liveness(self, identity: str, replica: Replica) -> tuple[bytes, ...]:
        """The liveness lines, as ``_encode`` writes them, with the identity labels already rendered."""
        return tuple(
            f"{name}{{{identity}}} {floatToGoString(value)}\n".encode() if value is not None else b""
            for name, value in zip(self.names[-len(LIVENESS) :], liveness_values(replica), strict=True)
        )

    @staticmethod
    def _encode(names: Sequence[str], samples_by_family: Sequence[list[Sample]]) -> tuple[bytes, ...]:
        return tuple(
            "".join(_line(name, labels, value) for labels, value in samples).encode()
            for name, samples in zip(names, samples_by_family, strict=True)
        )

    def size(self, replica: Replica) -> int:
        """The bytes of a replica's lines (for the budget; called from the writer's thread only).

        A replica the last scrape had is rendered and cached: the writer renders it ahead anyway, so the budget's
        measure and the next scrape share one render. Any other is counted without writing a line (no strings
        built, nothing deflated), an engine at a time: an engine whose figures and time of response are those of
        the replica's last count keeps its count, so a change of one engine counts that engine's lines, the info
        line of each (their labels are the replica's) and the replica's own lines.
        """
        if replica.key in self._rendered:  # its counts go: they would keep replaced engines' figures alive
            self._engines_counted -= len(self._counts.pop(replica.key, {}))
            return self.part(replica).size
        total = self._counted(replica_own_samples(replica))
        if not replica.engines:
            self._engines_counted -= len(self._counts.pop(replica.key, {}))
            return total
        synced = replica.synced
        info = self.info_labels.select(synced.labels)
        info_bytes = sum(itertools.starmap(_pair_bytes, info)) + len(info)  # each pair with the comma before it
        identity = replica_identity(replica)
        last = self._counts.pop(replica.key, {})
        self._engines_counted -= len(last)
        counts: dict[int, _EngineCount] = {}
        for engine, report in replica.engines.items():
            figures = synced.engines[engine]
            count = last.get(engine)
            if (
                count is None
                or count.received_at != report.received_at
                or (count.figures is not figures and count.figures != figures)
            ):
                engine_identity = (*identity, ("engine", str(engine)))
                samples: dict[Family, list[Sample]] = {family: [] for family in FAMILIES}
                engine_samples(samples, engine_identity, figures, report.received_at)
                info_line = _line_bytes(self._name_bytes[INFO], engine_identity, 1.0)
                count = _EngineCount(figures, report.received_at, self._counted(samples) + info_line)
            counts[engine] = count
            total += count.size + info_bytes
        self._counts[replica.key] = counts
        self._engines_counted += len(counts)
        while self._engines_counted > COUNTS_KEPT:  # the replicas counted longest ago go first, this one last
            self._engines_counted -= len(self._counts.pop(next(iter(self._counts))))
        return total

    def _counted(self, samples: dict[Family, list[Sample]]) -> int:
        """The bytes of the lines of ``samples`` (a list per family), counted as ``_line`` would write them."""
        return sum(
            _line_bytes(self._name_bytes[family], labels, value)
            for family, family_samples in samples.items()
            for labels, value in family_samples
        )

    def fleet(self, replicas: ReplicaMap) -> FleetLines:
        """The lines of all ``replicas`` in order; only called from one thread at a time.

        Lines the writer carried forward to this very map, or to a later one, are sent as they are: a scrape may
        show a state newer than the one it read, never an older one; rendering the older one would put back the
        replicas the writer rendered ahead, and the writer could no longer carry its lines forward (a storm's
        scrapes did both, each time). Else, while no key came or went
        (heartbeats only replace replicas), the sorted keys of the last call are kept and no replica can have
        gone: the call then costs a look per replica and renders only what the writer did not render ahead.
        """
        with self._ordered_lock:
            ordered = self._ordered
            if ordered is not None and ordered.replicas.serial >= replicas.serial:
                self._lent = True
                return FleetLines.of(self.headers, ordered)
        before = self.generation
        own = 0  # the generation's moves made here
        if ordered is None or ordered.replicas.key_set is not replicas.key_set:
            gone = [key for key in list(self._rendered) if key not in replicas]
            for key in gone:
                self._rendered.pop(key, None)
            if gone:
                self._next_generation()
                own += 1
            order = sorted(replicas)
            position = dict(zip(order, itertools.count()))
        else:
            order, position = ordered.order, ordered.position
        # At C speed while every replica's lines are cached (the writer renders a heartbeat's ahead): a scrape of a
        # large fleet between heartbeats does little else.
        current = list(map(dict(replicas.items()).__getitem__, order))
        cached = list(map(self._rendered.get, order))
        if None not in cached and all(map(operator.is_, current, map(_REPLICA, cached))):
            parts = list(map(_PART, cached))
        else:
            parts = []
            for replica in current:
                part, moved = self._part(replica)
                parts.append(part)
                own += moved
        # A config rendered by another thread while the parts were taken (of a replica newer than these): no
        # generation names these parts. Moves made here only are these parts' own: the generation names them.
        after = self.generation
        generation = after if after == before + own else -1
        liveness = list(map(list, _by_family(list(map(_LIVENESS, parts)), len(LIVENESS))))
        length = sum(map(_SIZE, parts))
        ordered = _Ordered(replicas, order, position, parts, liveness, length, generation)
        with self._ordered_lock:
            self._ordered, self._lent = ordered, True
        return FleetLines.of(self.headers, ordered)


_REPLICA = operator.itemgetter(0)
_PART = operator.itemgetter(1)
_LIVENESS = operator.attrgetter("liveness")
_SIZE = operator.attrgetter("size")


class _Ordered(NamedTuple):
    """A replica map's lines in the order sent: its sorted keys, where each key is in them, each replica's part,
    each liveness family's lines (a list per family, in the same order), the bytes of all parts, and the
    generation naming their config lines (-1: none does).

    The liveness lines and the length are kept apart from the parts so that a body of lines carried forward
    costs what changed: a scrape then joins the liveness lines as they are and sums nothing.
    """

    replicas: ReplicaMap
    order: list[ReplicaKey]
    position: dict[ReplicaKey, int]
    parts: list[ReplicaPart]
    liveness: list[list[bytes]]
    length: int
    generation: int


class Segment(NamedTuple):
    """Consecutive bytes strings of the config families as sent (each family's header, then each replica's lines
    of it): the segment's number, its strings (a replica's is the same object while its lines are unchanged), and
    the place of its first string in the families; the info family's replica strings are deflated."""

    number: int
    pieces: tuple[bytes, ...]
    start: int
    # Strings per family: its header and one a replica.
    per_family: int

    def text(self) -> bytes:
        """The segment as sent."""
        return b"".join(
            _inflate(piece) if place < self.per_family and place % self.per_family else piece
            for place, piece in enumerate(self.pieces, self.start)
        )


class FleetLines:
    """The cache-config families of a fleet, sent as chunks joined on demand (never one whole copy).

    The config families come first and the liveness ones last, so the config part is a prefix of the body:
    cached gzip-compressed while ``generation`` stays, whatever heartbeats change after it.
    """

    def __init__(
        self,
        headers: Sequence[bytes],
        order: Sequence[ReplicaKey],
        parts: Sequence[ReplicaPart],
        liveness: Sequence[Sequence[bytes]],
        length: int,
        generation: int,
    ) -> None:
        self.headers = headers
        self.order = order
        self.parts = parts
        self.liveness = liveness
        self.generation = generation
        self.length = sum(map(len, headers)) + length

    @classmethod
    def of(cls, headers: Sequence[bytes], ordered: _Ordered) -> FleetLines:
        return cls(headers, ordered.order, ordered.parts, ordered.liveness, ordered.length, ordered.generation)

    def select(self, keeps: Callable[[ReplicaKey], bool]) -> FleetLines:
        """The lines of the replicas ``keeps`` keeps (a shard's), in the same order; named by no generation (-1),
        so that the cache of the whole fleet's compressed lines never takes them for its own."""
        chosen = [place for place, key in enumerate(self.order) if keeps(key)]
        parts = [self.parts[place] for place in chosen]
        liveness = [[lines[place] for place in chosen] for lines in self.liveness]
        order = [self.order[place] for place in chosen]
        return FleetLines(self.headers, order, parts, liveness, sum(map(_SIZE, parts)), -1)

    def config_segments(self, size: int) -> Iterator[Segment]:
        """The config families as sent, cut every ``size`` bytes strings (a family's header, a replica's lines of
        it): where the replicas stay the same, a segment holds the same replicas' lines of the same families."""
        headers = self.headers[: -len(LIVENESS)]
        pieces = [headers[0], *(part.info for part in self.parts)]
        for family, header in enumerate(headers[1:]):
            pieces.append(header)
            pieces.extend(part.config[family] for part in self.parts)
        per_family = len(self.parts) + 1
        for number, start in enumerate(range(0, len(pieces), size)):
            yield Segment(number, tuple(pieces[start : start + size]), start, per_family)

    def config_chunks(self) -> Iterator[bytes]:
        """The config families; each replica's info lines are inflated as they are joined, none kept."""
        headers = self.headers[: -len(LIVENESS)]
        info = (_inflate(part.info) for part in self.parts)
        others = _by_family([part.config for part in self.parts], len(headers) - 1)
        return _chunks(zip(headers, (info, *others), strict=True))

    def liveness_chunks(self) -> Iterator[bytes]:
        """The liveness families, a chunk each: a line a replica, a small part of the body joined at C speed."""
        for header, lines in zip(self.headers[-len(LIVENESS) :], self.liveness, strict=True):
            yield header + b"".join(lines)


def _by_family(lines: Sequence[tuple[bytes, ...]], families: int) -> list[Iterable[bytes]]:
    """Per family, every replica's bytes string of it (``lines``: a tuple per replica)."""
    return [map(operator.itemgetter(family), lines) for family in range(families)]


def _chunks(families: Iterable[tuple[bytes, Iterable[bytes]]]) -> Iterator[bytes]:
    """Each family's header, then every replica's lines of it, joined into chunks of about ``CHUNK_BYTES``."""
    group: list[bytes] = []
    size = 0
    for header, pieces in families:
        group.append(header)
        size += len(header)
        for piece in pieces:
            group.append(piece)
            size += len(piece)
            if size >= CHUNK_BYTES:
                yield b"".join(group)
                group, size = [], 0
    if group:
        yield b"".join(group)
