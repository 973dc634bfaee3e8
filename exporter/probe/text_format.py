"""What a probe needs of a target's Prometheus text: each engine's ``vllm:cache_config_info`` labels and the
model names, read as the body arrives, in bounded steps, and a broken rule named by where it is, never by the
target's bytes.

prometheus_client's parser is pure Python, character by character: about 7 us a tiny sample (14 s for an
8 MiB body of 2 million), and quadratic in a label value's escaped quotes. Here one regular expression checks
a window of whole lines at C speed (every line a comment, blank, or ``name{label="value",...} value
[timestamp]`` as text format 0.0.4 has it); only the lines of ``vllm:`` series are looked at in Python.
``TextReader.feed`` takes the body a piece at a time and keeps only the line not yet complete; it and
``finish`` are generators that yield after each window and each such line, for the probe's turns
(``turns.py``) to run in slices. What a reader keeps is bounded whatever the body holds: one line of up to
64 KiB and the piece that came, engines by ``--limits.engines-per-replica``, a few label sets per engine
(the raw bytes of their labels), a few model names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import NoReturn, TypeVar

from exporter.probe.client import ProbeFailed
from protocol.labels import MAX_LABELS

INFO = "vllm:cache_config_info"
_INFO = INFO.encode()
# Lines checked at once (their cost: docs/RELIABILITY.md, section 10), and the longest line (vLLM's is its info
# line, about 1.3 KiB).
WINDOW_BYTES = 16 << 10
MAX_LINE_BYTES = 64 << 10
# Different label sets one engine may show (several API servers, one of them behind), and model names.
MAX_LABEL_SETS = 8
MAX_MODELS = 16
MAX_ENGINE_DIGITS = 5
T = TypeVar("T")

_AT_START = rb"[ \t]*+"
_NAME = rb"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_LABEL_NAME = rb"[a-zA-Z_][a-zA-Z0-9_]*+"
_QUOTED = rb'(?:[^"\\\n]++|\\.)*+'  # a label value between its quotes: any escaped character, no bare quote
_LABEL = _LABEL_NAME + rb'[ \t]*+=[ \t]*+"' + _QUOTED + rb'"'
_LABELS = rb"\{[ \t]*+(?:" + _LABEL + rb"[ \t]*+(?:,[ \t]*+" + _LABEL + rb"[ \t]*+)*+(?:,[ \t]*+)?+)?+\}"
_NUMBER = rb"[+-]?+(?:(?:[0-9]++(?:\.[0-9]*+)?+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+|(?i:inf(?:inity)?+|nan))"
_SERIES = _NAME + rb"(?:[ \t]*+" + _LABELS + rb"[ \t]*+|[ \t]++)"
_SAMPLE = _SERIES + _NUMBER + rb"(?:[ \t]++-?+[0-9]++)?+"
# Whole lines from the start, each a comment, a sample or blank; where the match ends, a line breaks the format.
_LINES = re.compile(rb"(?:" + _AT_START + rb"(?:#[^\n]*+|" + _SAMPLE + rb")?+[ \t\r]*+(?:\n|\Z))*+")
_VLLM_LINE = re.compile(rb"^" + _AT_START + rb"vllm:", re.MULTILINE)
_NAME_AND_LABELS = re.compile(_AT_START + rb"(" + _NAME + rb")[ \t]*+(" + _LABELS + rb")?+")
_EACH_LABEL = re.compile(rb"(" + _LABEL_NAME + rb')[ \t]*+=[ \t]*+"(' + _QUOTED + rb')"')
# A sample's labels up to its model_name label, each label before it read whole (a value may hold any text).
_MODEL_NAME = re.compile(
    rb"\{(?:[ \t]*+" + _LABEL + rb'[ \t]*+,)*?[ \t]*+model_name[ \t]*+=[ \t]*+"(' + _QUOTED + rb')"'
)
_ESCAPED = re.compile(rb"\\(.)")
_UNESCAPED = {b"\\": b"\\", b'"': b'"', b"n": b"\n"}
# How a broken line is told: the first of these it does not match (it is neither blank nor a comment).
_RULES = tuple(
    (re.compile(pattern), broken)
    for pattern, broken in (
        (_AT_START + _NAME, "it starts with neither a metric name nor #"),
        (_AT_START + _NAME + rb"(?:[ \t{\r]|$)", "its metric name runs into a character no name has"),
        (
            _AT_START + _NAME + rb"[ \t]*+(?:(?!\{)|" + _LABELS + rb")",
            'its labels are not name="value" pairs in braces, each value quoted',
        ),
        (_AT_START + _SERIES + rb"[^ \t\r]", "no value after its series"),
        (_AT_START + _SERIES + _NUMBER + rb"(?:[ \t\r]|$)", "its value is no number"),
    )
)


@dataclass
class Shown:
    """What a body shows: the lowest engine's ``vllm:cache_config_info`` labels (its most frequent set, without
    ``engine``: vLLM's frontend holds one config), whether another engine's differ, how many different sets each
    engine showed, and the ``model_name`` values of the ``vllm:`` series."""

    labels: dict[str, str] = field(default_factory=dict)
    engines: dict[int, int] = field(default_factory=dict)
    engines_differ: bool = False
    models: set[str] = field(default_factory=set)


def _broken_rule(body: bytearray, start: int, end: int) -> str:
    """The first rule of the text format that the line from ``start`` breaks."""
    for rule, broken in _RULES:
        if not rule.match(body, start, end):
            return broken
    return "its timestamp is no whole number, or more follows it"


def label_value(escaped: bytes) -> str:
    """A label value as the text format escapes it (backslash, quote and newline after a backslash), unescaped;
    a ``ValueError`` when it is not UTF-8."""
    if b"\\" in escaped:
        escaped = _ESCAPED.sub(lambda pair: _UNESCAPED.get(pair.group(1), pair.group(0)), escaped)
    try:
        return escaped.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("a label value is not UTF-8") from None


def label_values(labels: bytes) -> dict[str, str]:
    """The labels of a sample's ``{...}`` (checked by ``_LINES``), unescaped; a ``ValueError`` names the rule
    broken."""
    values: dict[str, str] = {}
    for label in _EACH_LABEL.finditer(labels):
        name = label.group(1).decode("ascii")
        if name in values:
            raise ValueError("a label name appears twice")
        values[name] = label_value(label.group(2))
    return values


class TextReader:
    """One body, read a piece at a time: the raw label sets of each engine (with how often, and where first),
    and the models; ``ProbeFailed`` names the first line that breaks a rule, and where it is."""

    def __init__(self, max_engines: int, max_engines_flag: str) -> None:
        self.max_engines = max_engines
        self.max_engines_flag = max_engines_flag  # named in the refusal of one engine more
        self.pending = bytearray()  # the body's bytes from the first line not read yet
        self.bytes_before = 0  # of the body before ``pending``
        self.lines_before = 0
        self.label_sets: dict[int, dict[bytes, list[int]]] = {}  # label bytes -> [count, line, offset, length]
        self.models: set[str] = set()

    @property
    def bytes_read(self) -> int:
        return self.bytes_before + len(self.pending)

    def feed(self, data: bytes) -> Generator[None, None, None]:
        """Read the whole lines ``data`` completes."""
        self.pending += data
        complete = self.pending.rfind(b"\n") + 1
        if complete == 0 and len(self.pending) > MAX_LINE_BYTES:
            raise ProbeFailed("not_vllm", f"{self._where(0)} is longer than {MAX_LINE_BYTES} bytes")
        yield from self._lines(complete)

    def finish(self) -> Generator[None, None, Shown]:
        """What the whole body showed, its last line read (it may lack its newline)."""
        yield from self._lines(len(self.pending))
        shown = Shown(models=self.models)
        # One engine's labels decoded at a time and compared with the lowest's: decoded, a label map takes many
        # times its bytes, and 1,024 engines of them would cost the process far more than the body did.
        for engine, sets in sorted(self.label_sets.items()):
            raw, (_, *where) = max(sets.items(), key=lambda item: item[1][0])  # the first seen of the most frequent
            labels = self._checked(partial(label_values, raw), partial(_place, *where))
            del labels["engine"]
            if not shown.engines:
                shown.labels = labels
            shown.engines_differ |= labels != shown.labels
            shown.engines[engine] = len(sets)
            yield
        return shown

    def _lines(self, end: int) -> Generator[None, None, None]:
        """Check the lines of ``pending`` up to ``end`` (a line's end) a window at a time, read those of ``vllm:``
        series, and let them go."""
        pending, start = self.pending, 0
        while start < end:
            window_end = self._window_end(start, end)
            checked = _LINES.match(pending, start, window_end)
            if checked is None or checked.end() < window_end:
                self._refuse_line(start if checked is None else checked.end(), window_end)
            yield
            for line in _VLLM_LINE.finditer(pending, start, window_end):
                self._series(line.start())
                yield
            start = window_end
        self.lines_before += pending.count(b"\n", 0, end)
        self.bytes_before += end
        del pending[:end]

    def _refuse_line(self, start: int, window_end: int) -> NoReturn:
        line_end = self.pending.find(b"\n", start, window_end)
        rule = _broken_rule(self.pending, start, window_end if line_end == -1 else line_end)
        raise ProbeFailed("not_vllm", f"the body is no Prometheus text exposition: {self._where(start)}: {rule}")

    def _window_end(self, start: int, end: int) -> int:
        """Where the lines checked at once from ``start`` end: whole lines of up to ``WINDOW_BYTES``, or one line."""
        if end - start <= WINDOW_BYTES:
            return end
        window_end = self.pending.rfind(b"\n", start, start + WINDOW_BYTES) + 1
        window_end = window_end or self.pending.find(b"\n", start, start + MAX_LINE_BYTES) + 1
        if window_end:
            return window_end
        if end - start <= MAX_LINE_BYTES:
            return end
        raise ProbeFailed("not_vllm", f"{self._where(start)} is longer than {MAX_LINE_BYTES} bytes")

    def _location(self, start: int) -> tuple[int, int, int]:
        """The line of ``pending`` that begins at ``start``: its number, byte offset in the body, and length."""
        end = self.pending.find(b"\n", start)
        length = (len(self.pending) if end == -1 else end) - start
        return self.lines_before + self.pending.count(b"\n", 0, start) + 1, self.bytes_before + start, length

    def _where(self, start: int) -> str:
        return _place(*self._location(start))

    @staticmethod
    def _checked(read: Callable[[], T], where: Callable[[], str]) -> T:
        """What ``read`` reads of a line; where the line is is worked out only when it breaks a rule."""
        try:
            return read()
        except ValueError as broken:
            raise ProbeFailed("invalid", f"{where()}: {broken}") from None

    def _series(self, start: int) -> None:
        """Note what one line of a ``vllm:`` series shows: an info sample's labels, or its ``model_name``."""
        series = _NAME_AND_LABELS.match(self.pending, start)
        assert series is not None  # the line passed _LINES
        name, labels = series.group(1), series.group(2) or b""
        if name == _INFO:
            self._info(labels, start)
        elif b"model_name" in labels and (found := _MODEL_NAME.match(labels)):
            model = self._checked(partial(label_value, found.group(1)), partial(self._where, start))
            if model not in self.models:
                self.models.add(model)
                if len(self.models) > MAX_MODELS:
                    raise ProbeFailed("invalid", f"{self._where(start)}: more than {MAX_MODELS} model_name values")

    def _info(self, labels: bytes, start: int) -> None:
        values = self._checked(partial(label_values, labels), partial(self._where, start))
        if len(values) > MAX_LABELS + 1:  # refused here, at its first line, rather than kept for ``finish``
            raise ProbeFailed("invalid", f"{self._where(start)}: {INFO} has {len(values) - 1} labels besides engine, "
                                         f"more than the {MAX_LABELS} a label map may have")  # fmt: skip
        engine = values.get("engine", "")
        if not engine.isdigit() or len(engine) > MAX_ENGINE_DIGITS:
            raise ProbeFailed("invalid", f"{self._where(start)}: {INFO} has no engine label of at most "
                                         f"{MAX_ENGINE_DIGITS} digits")  # fmt: skip
        sets = self.label_sets.setdefault(int(engine), {})
        if len(self.label_sets) > self.max_engines:
            raise ProbeFailed("invalid", f"{self._where(start)}: more than {self.max_engines} engines, the most "
                                         f"{self.max_engines_flag} allows")  # fmt: skip
        key = bytes(labels)
        if key not in sets:
            sets[key] = [0, *self._location(start)]
        sets[key][0] += 1
        if len(sets) > MAX_LABEL_SETS:
            raise ProbeFailed("invalid", f"{self._where(start)}: engine {int(engine)} shows more than "
                                         f"{MAX_LABEL_SETS} different {INFO} label sets")  # fmt: skip


def _place(line: int, offset: int, length: int) -> str:
    """Where a line is, for a message: its number, byte offset and length."""
    return f"line {line} (byte offset {offset}, {length} bytes)"
