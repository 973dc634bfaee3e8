"""What a probe costs and shows, whatever the target sends: the target's bytes never in an answer, a broken line
named by its place and rule, the body cap counted on the wire, the allowlist matched label by label and DNS
asked only when a name pattern permits the name, and probe work in slices that stop at the deadline.

The targets are raw servers on loopback (``hostile.py``); the app is the real one (ASGI).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Generator, Iterator

import pytest
from starlette.testclient import TestClient

from exporter.probe.turns import LIGHT_SECONDS, SLICE_SECONDS, Turns
from tests.helpers.exposition import info_labels, single_value
from tests.helpers.http import Reply
from tests.probe import hostile
from tests.probe.test_probe import LOOPBACK, MODEL, recorded_line, vllm_metrics

SECRET = hostile.SECRET


@pytest.fixture
def target() -> Iterator[Callable[[hostile.Answer], str]]:
    """Start hostile targets: each answer's ``HOST:PORT``."""
    started: list[hostile.HostileTarget] = []

    def start(answer: hostile.Answer) -> str:
        started.append(hostile.HostileTarget(answer))
        return started[-1].target

    yield start
    for server in started:
        server.stop()


def probe(client: TestClient, target: str, debug: bool = False) -> Reply:
    return Reply.of(client.get("/probe", params={"target": target, "debug": str(debug).lower()}))


def probe_log(client: TestClient, target: str) -> list[str]:
    """The lines of a probe's log (``?debug=true``), without their times."""
    text = probe(client, target, debug=True).text.split("\n\n\n")[0]
    return [line.partition(" ")[2] for line in text.splitlines()[1:]]


def head(*headers: str, status: str = "200 OK") -> bytes:
    return (f"HTTP/1.1 {status}\r\n" + "".join(f"{header}\r\n" for header in headers) + "\r\n").encode()


def body_of(text: str) -> bytes:
    data = text.encode()
    return head(f"Content-Length: {len(data)}") + data


INFO_LINE = recorded_line("qwen3-next")
# The secret wherever a target can put it; every answer must leave it out.
SECRET_PLACES = {
    "another service's first line": body_of(f"root:x:0:0:root:/root:/bin/bash {SECRET}\n"),
    "a broken line further down": body_of(f"# HELP a b\na 1\n{SECRET}\n"),
    "a line too long": body_of(f"{SECRET} " + "x" * 70_000 + "\n"),
    "the reason phrase": head("Content-Length: 0", status=f"500 {SECRET}"),
    "a header that breaks HTTP": head(f"X {SECRET}", "Content-Length: 0"),
    "the status line": f"HTTP/1.1 2{SECRET}\r\n\r\n".encode(),
    "the content encoding": head(f"Content-Encoding: {SECRET}", "Content-Length: 2") + b"a\n",
    "a chunk header": head("Transfer-Encoding: chunked") + f"{SECRET}\r\na\r\n".encode(),
    "the engine label": body_of(vllm_metrics(INFO_LINE.replace('engine="0"', f'engine="{SECRET}"')).decode()),
    "an impossible label value": body_of(vllm_metrics(INFO_LINE.replace('block_size="640"',
                                                                        f'block_size="{SECRET}"')).decode()),
    "another model's name": body_of(vllm_metrics(INFO_LINE).decode()
                                    + f'vllm:num_requests_waiting{{engine="0",model_name="{SECRET}"}} 0\n'),
    "a label value of another series": body_of(vllm_metrics(INFO_LINE).decode() + f'other{{key="{SECRET}\n'),
}  # fmt: skip


@pytest.mark.parametrize("place", SECRET_PLACES)
def test_no_probe_answer_shows_the_targets_bytes(
    place: str, make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """A service inside the allowlist may hold secrets: the probe names what failed and where, never its bytes."""
    client = make_client(probe_allowed_targets=(LOOPBACK,))
    served = target(hostile.answering(SECRET_PLACES[place]))
    for debug in (False, True):
        reply = probe(client, served, debug)
        assert reply.status == 200, reply.text[-600:]
        assert not [part for part in SECRET.split("=") if part.encode() in reply.body], reply.text[-600:]


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("root:x:0:0:root:/root:/bin/bash", "its metric name runs into a character no name has"),
        ("<html><body>", "it starts with neither a metric name nor #"),
        ('a{b="c} 1', 'its labels are not name="value" pairs in braces, each value quoted'),
        ("a{b=c} 1", 'its labels are not name="value" pairs in braces, each value quoted'),
        ("a", "no value after its series"),
        ("a one", "its value is no number"),
        ("a 1 2 3", "its timestamp is no whole number, or more follows it"),
    ],
)
def test_a_broken_line_is_named_by_its_place_and_the_rule_it_breaks(
    line: str, rule: str, make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    client = make_client(probe_allowed_targets=(LOOPBACK,))
    served = target(hostile.serving(f"# HELP a b\na 1\n{line}\nb 2\n".encode()))
    expected = f"the body is no Prometheus text exposition: line 3 (byte offset 15, {len(line)} bytes): {rule}"
    assert probe_log(client, served)[-1] == expected


def test_valid_lines_of_every_shape_pass(
    make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """What text format 0.0.4 allows reads as it should: escapes, spaces, special values, timestamps."""
    lines = [
        "# a comment", "", "  ", "a 1", "a +Inf", "a -inf", "a NaN", "a 1.5e-3 1700000000000", 'a{b="c",} 1',
        'a { b = "c" , d="\\"\\\\\\n" } 1', "a{} 1", "a\t1", "a 1 \r", ":a_b:c 0",
    ]  # fmt: skip
    client = make_client(probe_allowed_targets=(LOOPBACK,))
    served = target(hostile.serving(vllm_metrics(INFO_LINE, *(f"{line}\n" for line in lines))))
    assert single_value(probe(client, served).text, "cache_config_probe_success") == 1.0


def test_the_model_name_is_the_label_not_text_inside_another_value(
    make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    running = 'vllm:num_requests_running{note="a,model_name=\\"other\\"",model_name="served-model",engine="0"} 0\n'
    client = make_client(probe_allowed_targets=(LOOPBACK,))
    served = target(hostile.serving(vllm_metrics(INFO_LINE, model_name=None) + running.encode()))
    assert set(info_labels(probe(client, served).text, "served-model")) == {"0"}


def test_chunk_framing_counts_against_the_body_cap(
    make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """10 KiB of samples is under a 16 KiB cap as one body, and over it in 1-byte chunks (6 bytes each)."""
    client = make_client(probe_allowed_targets=(LOOPBACK,), probe_max_body_bytes=16 << 10)
    body = b"a 1\n" * 2560
    assert probe_log(client, target(hostile.serving(body)))[-1].startswith("no vllm:cache_config_info series")
    log = probe_log(client, target(hostile.chunked(body)))
    assert log[-1] == "the body passed --probe.max-body-bytes (16384 bytes on the wire, chunk framing included)"


def test_a_compressed_body_is_refused_unread(
    make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """The probe asks for identity and never inflates: a gzip bomb costs its first bytes only."""
    client = make_client(probe_allowed_targets=(LOOPBACK,))
    bomb = target(hostile.serving(hostile.gzip_bomb(), "Content-Encoding: gzip"))
    started = time.monotonic()
    log = probe_log(client, bomb)
    assert time.monotonic() - started < 1.0
    assert (
        log[-1]
        == "the body is encoded (Content-Encoding is not identity) though identity was asked for: it is not read"
    )


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every DNS lookup the event loop makes (the probe's, through ``getaddrinfo``); each name is loopback."""
    asked: list[str] = []

    async def getaddrinfo(loop: object, host: str, port: int, **hints: object) -> list[tuple[object, ...]]:
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    return asked


@pytest.mark.parametrize(
    ("pattern", "asked", "permitted"),
    [
        ("10.0.0.*:{port}", "10.0.0.7.attacker.example:{port}", False),  # * never crosses a dot
        ("127.0.0.*:{port}", "127.0.0.1:{port}", True),
        ("127.0.0.*:{port}", "127.0.0.evil:{port}", False),  # digits and wildcards alone mean addresses
        ("vllm-*:{port}", "vllm-1.attacker.example:{port}", False),
        ("vllm-*:{port}", "vllm-1:{port}", True),
        ("*.models.svc:{port}", "a.b.models.svc:{port}", False),  # one label, not two
        ("*.models.svc:{port}", "vllm-0.models.svc:{port}", True),
        ("gpu-node-?:*", "gpu-node-10:{port}", False),  # ? is one character
        ("gpu-node-?:*", "GPU-node-7:{port}", True),  # names match whatever their case
        ("vllm:80??", "vllm:{port}", False),
        ("*:{port}", "localhost:{port}", True),
        ("*:{port}", "vllm.attacker.example:{port}", False),
    ],
)
def test_name_patterns_match_label_by_label(
    pattern: str, asked: str, permitted: bool, lookups: list[str],
    make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str],
) -> None:  # fmt: skip
    port = target(hostile.serving(vllm_metrics(INFO_LINE))).rpartition(":")[2]
    client = make_client(probe_allowed_targets=(pattern.format(port=port),))
    reply = probe(client, asked.format(port=port))
    if permitted:
        assert single_value(reply.text, "cache_config_probe_success") == 1.0
    else:
        assert reply.problem(403)["field"] == "query.target" and lookups == []


def test_a_name_is_looked_up_only_when_a_name_pattern_permits_it(
    lookups: list[str], make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """A CIDR permits addresses: a name is refused at once, with no DNS lookup for any name a client sends."""
    served = target(hostile.serving(vllm_metrics(INFO_LINE)))
    port = served.rpartition(":")[2]
    cidr_only = make_client(probe_allowed_targets=(LOOPBACK,))
    problem = probe(cidr_only, f"vllm.attacker.example:{port}").problem(403)
    assert "a CIDR permits addresses, not names" in problem["detail"] and lookups == []
    assert single_value(probe(cidr_only, served).text, "cache_config_probe_success") == 1.0 and lookups == []
    with_names = make_client(probe_allowed_targets=(LOOPBACK, f"*.models.svc:{port}"))
    assert single_value(probe(with_names, f"vllm.models.svc:{port}").text, "cache_config_probe_success") == 1.0
    assert lookups == ["vllm.models.svc"]


def busy_steps(step_seconds: float, done: list[int], steps: int | None = None) -> Generator[None, None, None]:
    """Work in ``steps`` steps (endless: ``None``) of ``step_seconds``; ``done`` counts them, and ends with -1
    once the work is closed."""
    try:
        while steps is None or done[0] < steps:
            until = time.perf_counter() + step_seconds
            while time.perf_counter() < until:
                pass
            done[0] += 1
            yield
    finally:
        done.append(-1)


def test_probe_work_leaves_the_loop_turning_and_stops_at_its_deadline() -> None:
    """Four probes' endless work: between two turns of the loop it runs for a few milliseconds at most (the
    loop thread's CPU time, which the machine's other load does not inflate), it takes at most about half of
    the loop's time, and each stops at its deadline (its generator closed, no step after)."""

    async def run() -> tuple[float, float, list[list[int]], list[int]]:
        turns, works = Turns(), [[0] for _ in range(4)]
        worst, ended = 0.0, asyncio.Event()

        async def tick() -> None:
            nonlocal worst
            last = time.thread_time()
            while not ended.is_set():
                await asyncio.sleep(0)
                worst, last = max(worst, time.thread_time() - last), time.thread_time()

        async def bounded(done: list[int]) -> None:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await turns.of_probe().run(busy_steps(0.0002, done))

        ticking = asyncio.create_task(tick())
        started = time.perf_counter()
        await asyncio.gather(*(bounded(done) for done in works))
        took = time.perf_counter() - started
        ended.set()
        await ticking
        at_the_deadline = [done[0] for done in works]
        await asyncio.sleep(0.05)
        return worst, took, works, at_the_deadline

    worst, took, works, at_the_deadline = asyncio.run(run())
    assert worst < 0.005, worst
    assert all(done[-1] == -1 for done in works), works  # closed
    assert [done[0] for done in works] == at_the_deadline
    busy = sum(done[0] for done in works) * 0.0002
    assert busy < 0.6 * took, (busy, took)


def test_a_light_probe_works_before_heavy_ones() -> None:
    """Four probes that have parsed for a while, and one that asks for a few steps: it gets the next turn, so
    at most the slice in progress runs before it is done, not one slice of each heavy probe."""

    async def run() -> tuple[int, int]:
        turns, heavy = Turns(), [[0] for _ in range(4)]
        running = [asyncio.create_task(turns.of_probe().run(busy_steps(0.0002, done))) for done in heavy]
        async with asyncio.timeout(10):  # until each has worked past LIGHT_SECONDS
            while min(done[0] for done in heavy) * 0.0002 <= LIGHT_SECONDS:
                await asyncio.sleep(0.01)
        before = sum(done[0] for done in heavy)
        await turns.of_probe().run(busy_steps(0.0002, [0], steps=5))
        after = sum(done[0] for done in heavy)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return before, after

    before, after = asyncio.run(run())
    slice_steps = SLICE_SECONDS / 0.0002
    assert after - before <= slice_steps + 1, (before, after)


# Every bound at the bound and one past it -----------------------------------------------------------------


def padded_to(size: int) -> bytes:
    """A vLLM ``/metrics`` of exactly ``size`` bytes (a comment line fills it up)."""
    body = vllm_metrics(INFO_LINE)
    filler = size - len(body) - 3
    assert filler >= 0
    return body + b"#" + b" " * filler + b"\n\n"


@pytest.mark.parametrize("framing", ["Content-Length", "until the connection closes"])
def test_a_body_of_exactly_the_cap_is_read_and_one_byte_more_refused(
    framing: str, make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """A 4 KiB header beside it shows the response head is not counted into the body's cap."""
    body = padded_to(8 << 10)
    assert len(body) == 8 << 10
    big_header = "X-Padding: " + "p" * 4096
    headers = (big_header, f"Content-Length: {len(body)}") if framing == "Content-Length" else (big_header,)
    served = target(hostile.answering(head(*headers) + body))
    at_the_cap = make_client(probe_allowed_targets=(LOOPBACK,), probe_max_body_bytes=len(body))
    assert single_value(probe(at_the_cap, served).text, "cache_config_probe_success") == 1.0
    under_it = make_client(probe_allowed_targets=(LOOPBACK,), probe_max_body_bytes=len(body) - 1)
    refused = probe_log(under_it, served)[-1]
    if framing == "Content-Length":
        assert refused == f"Content-Length {len(body)} is over --probe.max-body-bytes ({len(body) - 1})"
    else:
        assert (
            refused
            == f"the body passed --probe.max-body-bytes ({len(body) - 1} bytes on the wire, chunk framing included)"
        )


@pytest.mark.parametrize(("engines", "permitted"), [(4, True), (5, False)])
def test_exactly_the_engines_a_deployment_may_have_are_read_and_one_more_refused(
    engines: int, permitted: bool, make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    client = make_client(probe_allowed_targets=(LOOPBACK,), max_engines_per_replica=4)
    served = target(hostile.serving(vllm_metrics(*(recorded_line("qwen3-next", engine) for engine in range(engines)))))
    reply = probe(client, served)
    if permitted:
        assert single_value(reply.text, "cache_config_probe_success") == 1.0
        assert set(info_labels(reply.text, MODEL)) == {"0", "1", "2", "3"}
    else:
        assert single_value(reply.text, "cache_config_probe_success") == 0.0
        assert "more than 4 engines" in probe_log(client, served)[-1]


@pytest.mark.parametrize("host", ["127.0.0.1", "vllm"])
def test_a_pattern_is_matched_whole_not_as_a_prefix_of_a_longer_target(
    host: str, lookups: list[str], make_client: Callable[..., TestClient], target: Callable[[hostile.Answer], str]
) -> None:
    """``vllm:80`` permits ``vllm:80``, never ``vllm:8080``: a port one digit short refuses, the whole permits."""
    port = target(hostile.serving(vllm_metrics(INFO_LINE))).rpartition(":")[2]
    short = make_client(probe_allowed_targets=(f"{host}:{port[:-1]}",))
    assert probe(short, f"{host}:{port}").problem(403)["field"] == "query.target"
    whole = make_client(probe_allowed_targets=(f"{host}:{port}",))
    assert single_value(probe(whole, f"{host}:{port}").text, "cache_config_probe_success") == 1.0
