"""Full collections frozen out and thawed in time: the pacing as a pure value, the collector as processes use it."""

from __future__ import annotations

import gc
import itertools
import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import uvicorn

from exporter.cli import build_parser, serve
from exporter.server.gc_freeze import FreezePacing


def never_counted() -> int:
    raise AssertionError("the frozen objects were walked while they could not be twice as many as were alive")


def counted(value: int) -> tuple[list[int], Callable[[], int]]:
    calls: list[int] = []

    def count() -> int:
        calls.append(value)
        return value

    return calls, count


def test_the_first_full_collection_is_complete_and_its_survivors_are_frozen() -> None:
    pacing = FreezePacing()
    assert pacing.thaw_after(1000, never_counted) is False
    assert (pacing.alive, pacing.frozen) == (1000, 1000)


def test_survivors_are_frozen_without_a_count_until_they_could_double_what_was_alive() -> None:
    pacing = FreezePacing()
    pacing.thaw_after(1000, never_counted)
    for _ in range(9):
        assert pacing.thaw_after(100, never_counted) is False
    assert pacing.frozen == 1900


def test_a_heap_that_did_not_grow_is_counted_and_stays_frozen() -> None:
    pacing = FreezePacing()
    pacing.thaw_after(1000, never_counted)
    for _ in range(9):
        pacing.thaw_after(100, never_counted)
    calls, count = counted(1100)  # reference counting freed most of the survivors frozen since
    assert pacing.thaw_after(100, count) is False
    assert calls == [1100]
    assert pacing.frozen == 1200  # counted: the next count waits for survivors that could double what was alive
    assert pacing.thaw_after(700, never_counted) is False


def test_a_heap_grown_by_half_is_thawed_and_examined_whole_next_time() -> None:
    pacing = FreezePacing()
    pacing.thaw_after(1000, never_counted)
    _, count = counted(200)
    assert pacing.thaw_after(1000, count) is False  # most of it freed since: 1,200 frozen now
    _, count = counted(1000)
    assert pacing.thaw_after(800, count) is True  # 1,000 frozen and 800 survivors: more than 1.5 x 1,000
    assert pacing.alive is None
    assert pacing.thaw_after(1800, never_counted) is False  # complete: what it finds alive is the new measure
    assert (pacing.alive, pacing.frozen) == (1800, 1800)


def test_a_steady_fleet_is_counted_rarely_and_never_thawed() -> None:
    """Survivors of a tenth of the heap at each collection, freed again by reference counting: no thaw in a
    thousand collections, and at least nine collections between two counts."""
    pacing = FreezePacing()
    pacing.thaw_after(10_000, never_counted)
    calls, count = counted(10_000)
    counted_at = []
    for collection in range(1000):
        before = len(calls)
        assert pacing.thaw_after(1000, count) is False
        if len(calls) > before:
            counted_at.append(collection)
    assert counted_at
    assert min(b - a for a, b in itertools.pairwise(counted_at)) >= 9


def test_once_as_many_connections_closed_as_were_open_at_the_last_complete_collection_all_are_thawed() -> None:
    """Closed connections are where frozen objects die: a turnover of the connections gets a complete collection,
    whatever the heap's size."""
    pacing = FreezePacing()
    for _ in range(200):
        pacing.connection_opened()
    pacing.thaw_after(10_000, never_counted)  # complete, with 200 connections open
    for _ in range(199):
        pacing.connection_opened()
        assert pacing.connection_closed() is False
    assert pacing.thaw_after(10, never_counted) is False
    assert pacing.connection_closed() is True
    assert pacing.alive is None
    pacing.thaw_after(9_000, never_counted)  # complete: 199 connections open now, none closed since
    assert not any(pacing.connection_closed() for _ in range(198))


def frozen_garbage(connections: int, then: str) -> str:
    """A script: with ``connections`` open, a complete collection, then 2,000 objects in cycles frozen by the next
    one and made garbage (``freed`` counts those freed), then ``then``."""
    return textwrap.dedent(
        """
        import gc, json, weakref
        from exporter.server.gc_freeze import connection_closed, connection_opened, freeze_survivors

        class Node:
            pass

        freed = []
        undo = freeze_survivors()
        for _ in range(CONNECTIONS):
            connection_opened()
        gc.collect()  # complete: what the process holds now is the measure
        cycles = []
        for _ in range(2000):
            node = Node()
            node.me = node
            weakref.finalize(node, freed.append, 1)
            cycles.append(node)
        del node
        gc.collect()  # the cycles survive it: frozen
        frozen_with_cycles = gc.get_freeze_count()
        cycles.clear()  # garbage now, out of the collector's reach
        """
    ).replace("CONNECTIONS", str(connections)) + textwrap.dedent(then)


GARBAGE_OF_CLOSED_CONNECTIONS = frozen_garbage(
    10,
    """
    for _ in range(9):
        connection_closed()
    gc.collect()
    kept_after_nine = 2000 - len(freed)
    connection_closed()
    collections = 0
    while len(freed) < 2000 and collections < 10:
        gc.collect()
        collections += 1
    print(json.dumps({"kept_after_nine": kept_after_nine, "freed": len(freed), "collections": collections}))
    undo()
    """,
)


def test_frozen_garbage_is_freed_once_the_connections_open_at_the_last_complete_collection_closed() -> None:
    answer = subprocess.run([sys.executable, "-c", GARBAGE_OF_CLOSED_CONNECTIONS], capture_output=True, text=True,
                            check=True, timeout=60)  # fmt: skip
    result = json.loads(answer.stdout)
    assert result["kept_after_nine"] == 2000
    assert (result["freed"], result["collections"]) == (2000, 1)  # thawed as the tenth closed


GARBAGE_IN_FROZEN_CYCLES = frozen_garbage(
    0,
    """
    gc.collect()
    kept_while_frozen = 2000 - len(freed)
    heap = [[{}] for _ in range(frozen_with_cycles)]  # the heap grows by more than half
    collections = 0
    while len(freed) < 2000 and collections < 10:
        gc.collect()
        collections += 1
    print(json.dumps({"frozen_with_cycles": frozen_with_cycles, "kept_while_frozen": kept_while_frozen,
                      "freed": len(freed), "collections": collections, "frozen_after": gc.get_freeze_count()}))
    undo()
    """,
)


def test_frozen_garbage_in_cycles_is_kept_until_the_heap_grows_by_half_then_freed() -> None:
    answer = subprocess.run([sys.executable, "-c", GARBAGE_IN_FROZEN_CYCLES], capture_output=True, text=True,
                            check=True, timeout=60)  # fmt: skip
    result = json.loads(answer.stdout)
    assert result["kept_while_frozen"] == 2000  # a full collection does not reach them
    assert result["freed"] == 2000  # the growth thawed them: the next collection examined everything
    assert result["collections"] <= 2
    assert result["frozen_after"] > 0  # and froze the survivors again


def test_serve_freezes_the_survivors_while_it_serves_and_thaws_them_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}

    def run(app: object, **options: object) -> None:  # uvicorn's serving, which the test does not need
        gc.collect()
        seen["frozen"] = gc.get_freeze_count()

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve's SIGTERM handler is for its own process
    callbacks = list(gc.callbacks)
    args = build_parser().parse_args(["serve", "--storage.path", str(tmp_path / "exporter.db"),
                                      "--web.listen-address", "127.0.0.1:0"])  # fmt: skip
    assert serve(args) == 0
    assert seen["frozen"] > 0
    assert gc.callbacks == callbacks
    assert gc.get_freeze_count() == 0
