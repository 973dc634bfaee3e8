"""The byte budget's measure of a replica (``ReplicaLines.size``) counts its lines without writing them, unless a
scrape holds them: whichever way, it is exactly the bytes a full render of the replica sends. Checked over random
sequences of changes (engines coming and going, labels with escapes and non-ASCII text, heartbeats, scrapes in
between), each measure against a fresh render of the same replica."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.exposition.lines import ReplicaLines
from exporter.exposition.series import LABEL_PRESETS, InfoLabels
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, build_replica, engine_report
from tests.support import fixture_bytes

PAYLOAD = fixture_bytes("hybrid-tp1-post50809")
# Label values a scrape must escape (backslash, quote, newline) or send as several UTF-8 bytes a character.
TEXT = st.text(alphabet=st.sampled_from(["a", "Z", "7", "-", "\\", '"', "\n", "é", "模", "🙂"]), max_size=6)
TIMES = st.floats(min_value=0.0, max_value=4e9, allow_nan=False) | st.integers(0, 2**31).map(float)

# One change of a replica: its engines (index -> received at), its static label, its interval and last seen.
CHANGE = st.tuples(
    st.dictionaries(st.integers(0, 11), TIMES, max_size=6),
    TEXT,
    st.none() | st.sampled_from([5.0, 30.0, 0.25]),
    TIMES,
    st.booleans(),  # scraped after it
)


def _replica(name: str, change: tuple[dict[int, float], str, float | None, float, bool]) -> Replica:
    engines, label, heartbeat, last_seen, _ = change
    reports = {engine: engine_report(engine, received, PAYLOAD, "msgpack") for engine, received in engines.items()}
    return build_replica(("dep-" + name, name), None, {"team": label}, heartbeat, last_seen, reports, {})


@settings(max_examples=60, deadline=None)
@given(
    name=TEXT.filter(bool),
    changes=st.lists(CHANGE, min_size=1, max_size=8),
    compact=st.booleans(),
    prefix=st.sampled_from(["", "vllm:", "é_"]),
)
def test_the_budget_measures_exactly_what_a_full_render_sends(
    name: str, changes: list[tuple[dict[int, float], str, float | None, float, bool]], compact: bool, prefix: str
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
