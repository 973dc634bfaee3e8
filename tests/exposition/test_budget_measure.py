"""The byte budget's measure of a replica (``ReplicaLines.size``) counts its lines without writing them, unless a
scrape holds them: whichever way, it is exactly the bytes a full render of the replica sends. Checked over random
sequences of changes (engines coming and going, labels with escapes and non-ASCII text, heartbeats, scrapes in
between), each measure against a fresh render of the same replica."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.exposition import lines as line_cache
from exporter.exposition.lines import ReplicaLines
from exporter.exposition.series import LABEL_PRESETS, InfoLabels
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, build_replica, engine_report
from tests.helpers.ready_responses import ready_response

# Label values a scrape must escape (backslash, quote, newline) or send as several UTF-8 bytes a character.
TEXT = st.text(alphabet=st.sampled_from(["a", "Z", "7", "-", "\\", '"', "\n", "é", "模", "🙂"]), max_size=6)
TIMES = st.floats(min_value=0.0, max_value=4e9, allow_nan=False) | st.integers(0, 2**31).map(float)

# One change of a replica: its engines (index -> received at, GPU blocks), its static label, its interval and last
# seen. Few distinct values, so that an engine is often unchanged from one change to the next.
CHANGE = st.tuples(
    st.dictionaries(
        st.integers(0, 11),
        st.tuples(st.sampled_from([1.0, 2.5, 3e9]), st.sampled_from([1, 1056, 2_000_000])),
        max_size=6,
    ),
    TEXT,
    st.none() | st.sampled_from([5.0, 30.0, 0.25]),
    TIMES,
    st.booleans(),  # scraped after it
)


Change = tuple[dict[int, tuple[float, int]], str, float | None, float, bool]


def _replica(name: str, change: Change) -> Replica:
    engines, label, heartbeat, last_seen, _ = change
    reports = {
        engine: engine_report(engine, received, ready_response(engine, blocks, 12), "msgpack")
        for engine, (received, blocks) in engines.items()
    }
    return build_replica(("dep-" + name, name), None, {"team": label}, heartbeat, last_seen, reports, {})


@settings(max_examples=60, deadline=None)
@given(
    name=TEXT.filter(bool),
    changes=st.lists(CHANGE, min_size=1, max_size=8),
    compact=st.booleans(),
    prefix=st.sampled_from(["", "vllm:", "é_"]),
)
def test_the_budget_measures_exactly_what_a_full_render_sends(
    name: str, changes: list[Change], compact: bool, prefix: str
) -> None:
    labels = InfoLabels(frozenset(LABEL_PRESETS["compact"])) if compact else InfoLabels()
    lines = ReplicaLines(prefix, labels)
    for change in changes:
        replica = _replica(name, change)
        measured = lines.size(replica)
        whole = b"".join(ReplicaLines(prefix, labels).of(replica))
        assert measured == len(whole)
        if change[-1]:  # a scrape: from now on the measure renders and keeps the replica's lines
            fleet = lines.fleet(ReplicaMap.of([replica]))
            assert fleet.length - sum(map(len, fleet.headers)) == measured


def test_the_counts_kept_are_bounded_by_engines_the_oldest_replica_going_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget keeps each counted replica's engine counts for its next change, but at most ``COUNTS_KEPT``
    engines' of them: at the bound every replica's stay, one engine past it the replica counted first goes."""
    monkeypatch.setattr(line_cache, "COUNTS_KEPT", 16)
    lines = ReplicaLines()
    first, second = (
        _replica(name, ({engine: (1.0, 1056) for engine in range(8)}, "", None, 5.0, False)) for name in "ab"
    )
    third = _replica("c", ({0: (1.0, 1056)}, "", None, 5.0, False))
    for replica in (first, second):
        lines.size(replica)
    assert {key: len(counts) for key, counts in lines._counts.items()} == {first.key: 8, second.key: 8}
    assert lines.size(third) == len(b"".join(ReplicaLines().of(third)))
    assert {key: len(counts) for key, counts in lines._counts.items()} == {second.key: 8, third.key: 1}
    assert lines.size(first) == len(b"".join(ReplicaLines().of(first))), "counted afresh"
