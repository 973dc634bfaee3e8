"""The vLLM plugin against vLLM's own ``MPClient._apply_ready_response``, ``CacheConfig`` and ready responses.

By default the tests import the stand-in ``vllm`` package (tests/vllm_standin), a
copy of vLLM 0.32.0's module paths, names, signatures and method bodies.
With ``CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM=1`` they import the installed vLLM
instead; ``tests/real_vllm/test_real_vllm.py`` runs them so with a real vLLM, so that every
test here holds for the real package too.

Each test gets a pristine ``MPClient._apply_ready_response`` and ``MPClient.shutdown`` (and ``MAIN_PROCESS_METHODS``);
the plugin's forwarder is flushed instead of sleeping, and closed at the end so no
thread outlives its test. Backoff is shortened to milliseconds.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import msgspec
import pytest

from exporter.vllm_plugin import api_servers, delivery
from exporter.vllm_plugin import plugin as vllm_plugin
from exporter.vllm_plugin import target as plugin_target
from exporter.vllm_plugin.plugin import FORWARDER_ATTRIBUTE, Forwarder, register
from exporter.vllm_plugin.target import Target, deployment_of, replica_of
from tests.helpers.exposition import info_labels, samples
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.real_vllm.frontend import HYBRID_RESPONSE, frontend_client
from tests.support import ExporterProcess, free_port, wait_until

STANDIN = Path(__file__).resolve().parents[1] / "vllm_standin"
REAL_VLLM_VARIABLE = "CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM"
REAL_VLLM = os.environ.get(REAL_VLLM_VARIABLE) == "1"
CORE_CLIENT = "vllm.v1.engine.core_client"
# What the plugin wraps in vLLM's main process of a server with several API servers (``api_servers``).
MAIN_PROCESS_METHODS = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config"),
    ("vllm.v1.utils", "APIServerProcessManager", "__init__"),
    ("vllm.v1.utils", "APIServerProcessManager", "shutdown"),
)
VARIABLES = (
    plugin_target.URL_VARIABLE,
    plugin_target.DEPLOYMENT_VARIABLE,
    plugin_target.REPLICA_VARIABLE,
    plugin_target.HEARTBEAT_VARIABLE,
    plugin_target.TOKEN_FILE_VARIABLE,
    plugin_target.TOKEN_VARIABLE,
    plugin_target.TIMEOUT_VARIABLE,
)
# The plugin's timeout against an exporter that hangs. Elsewhere an answer is waited for as long as a loaded
# machine may take: a request given up on is repeated, and the tests count requests.
TIMEOUT = 0.25
ANSWER_TIMEOUT = 30.0


def is_vllm(module_name: str) -> bool:
    return module_name == "vllm" or module_name.startswith("vllm.")


def forget_vllm() -> None:
    for name in [name for name in sys.modules if is_vllm(name)]:
        del sys.modules[name]


@pytest.fixture(scope="module", autouse=True)
def vllm_package() -> Iterator[ModuleType]:
    """vLLM's ``core_client``: the stand-in's, or with ``CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM=1`` the real one."""
    if REAL_VLLM:
        core_client = importlib.import_module(CORE_CLIENT)
        assert STANDIN not in Path(core_client.__file__).parents, "the stand-in shadows the real vLLM"
        yield core_client
        return
    sys.path.insert(0, str(STANDIN))
    forget_vllm()
    try:
        yield importlib.import_module(CORE_CLIENT)
    finally:
        sys.path.remove(str(STANDIN))
        forget_vllm()


def forwarder() -> Forwarder:
    """The forwarder of the patched ``MPClient`` (fails when it is not patched)."""
    return getattr(importlib.import_module(CORE_CLIENT).MPClient._apply_ready_response, FORWARDER_ATTRIBUTE)


@pytest.fixture(autouse=True)
def pristine(monkeypatch: pytest.MonkeyPatch, vllm_package: ModuleType) -> Iterator[None]:
    """No plugin variables set, backoff short enough for tests, and vLLM's own methods back after the test."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(delivery, "FIRST_RETRY_SECONDS", 0.01)
    monkeypatch.setattr(delivery, "MAX_RETRY_SECONDS", 0.05)
    client_class = vllm_package.MPClient
    monkeypatch.setattr(client_class, "_apply_ready_response", client_class._apply_ready_response)
    monkeypatch.setattr(client_class, "shutdown", client_class.shutdown)
    for module_name, class_name, method in MAIN_PROCESS_METHODS:
        wrapped_class = getattr(importlib.import_module(module_name), class_name)
        monkeypatch.setattr(wrapped_class, method, getattr(wrapped_class, method))
    # Set by an APIServerProcessManager the test starts: unset again afterwards (no pid is empty).
    monkeypatch.setenv(api_servers.GOODBYE_BY_VARIABLE, "")
    yield
    method = getattr(getattr(sys.modules.get(CORE_CLIENT), "MPClient", None), "_apply_ready_response", None)
    if hasattr(method, FORWARDER_ATTRIBUTE):
        forwarder().close()


def ready_response(**fields: Any) -> bytes:
    """A ready response as vLLM's engine core sends it: its dataclass, every field, as a msgpack map."""
    engine = importlib.import_module("vllm.v1.engine")
    return msgspec.msgpack.encode(engine.EngineCoreReadyResponse(**{**HYBRID_RESPONSE, **fields}))


def two_engines() -> tuple[bytes, bytes]:
    """Data parallel 2: both engines answer, each with its own blocks."""
    return tuple(ready_response(data_parallel_size=2, data_parallel_rank=rank) for rank in (0, 1))  # type: ignore[return-value]


def as_array(payloads: tuple[bytes, ...]) -> bytes:
    """Ready responses as the plugin sends those its engines report together: one msgpack array of them."""
    return msgspec.msgpack.encode([msgspec.Raw(payload) for payload in payloads])


def frontend(served_model_name: str | list[str] | None = "org/hybrid", **cache_config: Any) -> Any:
    """vLLM's frontend client whose (vLLM's own) ``CacheConfig`` has these values."""
    cache_config_class = importlib.import_module("vllm.config").CacheConfig
    client_class = importlib.import_module(CORE_CLIENT).MPClient
    return frontend_client(client_class, cache_config_class(**cache_config), served_model_name)


class BackgroundResources:
    """vLLM's ``BackgroundResources`` as ``MPClient.shutdown`` uses them: no engine manager; counts its clean-ups."""

    engine_manager = None

    def __init__(self) -> None:
        self.cleanups = 0

    def __call__(self) -> None:
        self.cleanups += 1


def running(client: Any) -> Any:
    """``client`` with what ``MPClient.__init__`` sets up for its shutdown: resources, freed once by a finalizer."""
    client.resources = BackgroundResources()
    client._finalizer = weakref.finalize(client, client.resources)
    return client


def plugin_on(monkeypatch: pytest.MonkeyPatch, url: str, **variables: str) -> None:
    """Set the plugin's variables (``deployment=...`` sets CACHE_CONFIG_EXPORTER_DEPLOYMENT) and load it.

    The timeout is ``ANSWER_TIMEOUT`` unless ``timeout=...`` is given."""
    monkeypatch.setenv(plugin_target.URL_VARIABLE, url)
    monkeypatch.setenv(plugin_target.TIMEOUT_VARIABLE, str(ANSWER_TIMEOUT))
    for name, value in variables.items():
        monkeypatch.setenv(f"CACHE_CONFIG_EXPORTER_{name.upper()}", value)
    register()


def vllm_state() -> dict[str, dict[str, Any]]:
    """Every attribute of vLLM's client module and of its classes: equal snapshots mean nothing was patched."""
    state = {}
    module = sys.modules.get(CORE_CLIENT)
    if module is not None:
        state[CORE_CLIENT] = dict(vars(module))
        classes = {key: value for key, value in vars(module).items() if isinstance(value, type)}
        state.update({f"{CORE_CLIENT}.{key}": dict(vars(value)) for key, value in classes.items()})
    return state


def plugin_logs(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == vllm_plugin.logger.name and r.levelno >= level]


class Recorded(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: tuple[str, int]  # the client's address: which TCP connection the request came on


class StubExporter(ThreadingHTTPServer):
    """Records every request and answers ``status`` with ``body``; when ``slow``, only once ``release`` is set.

    With a ``refusal`` (a problem document), every PUT of a cache config is answered 422 with it;
    heartbeats are answered ``heartbeat_status`` (404: "send your state again"), goodbyes 204.
    """

    daemon_threads = True

    def __init__(
        self, status: int = 200, body: bytes = b"{}", slow: bool = False, refusal: bytes | None = None, port: int = 0
    ) -> None:
        super().__init__(("127.0.0.1", port), _StubHandler)
        self.status = status
        self.body = body
        self.slow = slow
        self.refusal = refusal
        self.heartbeat_status = 204
        self.release = threading.Event()
        self.requests: list[Recorded] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A slow answer meets a client that gave up: expected, not worth a traceback."""

    def routes(self, method: str | None = None) -> list[tuple[str, str]]:
        """``(method, path without query)`` of every request (only ``method``'s when given), in order."""
        return [(r.method, r.path) for r in self.requests if method in (None, r.method)]


class _StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # connections are kept, as the exporter's are
    server: StubExporter

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path, _, query = self.path.partition("?")
        self.server.requests.append(
            Recorded(
                self.command, path, dict(urllib.parse.parse_qsl(query)), dict(self.headers), body, self.client_address
            )
        )
        if self.server.slow:
            self.server.release.wait(10)
        refused = self.command == "PUT" and self.server.refusal is not None
        status, answer = (422, self.server.refusal) if refused else (self.server.status, self.server.body)
        if self.command == "DELETE" or (path.endswith("/heartbeat") and status < 400):
            status, answer = (self.server.heartbeat_status if self.command == "POST" else 204), b""
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json" if refused else "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read ``requests``."""


@pytest.fixture
def stub() -> Iterator[Callable[..., StubExporter]]:
    """Start recording stand-ins for the exporter on loopback; keyword arguments go to ``StubExporter``."""
    servers: list[StubExporter] = []

    def start(**kwargs: Any) -> StubExporter:
        server = StubExporter(**kwargs)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.release.set()
        server.shutdown()
        server.server_close()


def test_importing_the_plugin_loads_no_web_stack_and_no_vllm() -> None:
    """msgspec, which ``protocol`` loads, is vLLM's own dependency: loaded in every vLLM process before plugins."""
    code = "import json, sys, exporter.vllm_plugin; print(json.dumps([m.split('.')[0] for m in sys.modules]))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    loaded = set(json.loads(run.stdout))
    assert "exporter" in loaded
    assert not {"fastapi", "starlette", "uvicorn", "prometheus_client", "h11", "bcrypt", "vllm"} & loaded


def test_without_url_register_does_nothing_at_all() -> None:
    code = "import sys, exporter.vllm_plugin as p; p.register(); print(any(m.startswith('vllm') for m in sys.modules))"
    environ = {name: value for name, value in os.environ.items() if name not in VARIABLES}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True, env=environ)
    assert run.stdout.strip() == "False"

    register()
    client = frontend()
    assert not hasattr(type(client)._apply_ready_response, FORWARDER_ATTRIBUTE)
    client._apply_ready_response(ready_response())
    assert client.vllm_config.cache_config.num_gpu_blocks == 1997


def test_ready_response_reaches_a_live_exporter_with_vllm_own_labels_and_the_true_mamba_block_size(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    start_exporter: Callable[..., ExporterProcess],
    tmp_path: Path,
) -> None:
    caplog.set_level(logging.INFO, logger=vllm_plugin.logger.name)
    token_file = tmp_path / "ingest-token"
    token_file.write_text("live-ingest-token\n")
    exporter = start_exporter("--web.ingest-token-file", str(token_file))
    plugin_on(monkeypatch, exporter.url, token_file=str(token_file))
    # Served by path, as ``vllm serve "/models/Qwen3 Next (test)"`` does without --served-model-name.
    client = frontend("/models/Qwen3 Next (test)", mamba_cache_mode="align", gpu_memory_utilization=0.85)

    assert client._apply_ready_response(ready_response()) is None
    # vLLM's own handling ran and its effect is kept, including its wrong Mamba block size.
    cache_config = client.vllm_config.cache_config
    assert (cache_config.block_size, cache_config.num_gpu_blocks, cache_config.mamba_block_size) == (1056, 1997, 16)
    assert forwarder().flush(10)
    replica = forwarder().replica
    assert f"deployment 'Qwen3_Next__test_' as replica '{replica}'" in "\n".join(plugin_logs(caplog, logging.INFO))

    with urllib.request.urlopen(f"{exporter.url}/metrics", timeout=10) as response:
        exposition = response.read().decode()
    labels = info_labels(exposition, "Qwen3_Next__test_")
    assert set(labels) == {"0"}
    # This vLLM server is one replica of the deployment, named after its host and API port.
    assert labels["0"]["replica"] == replica == replica_of(None, [], socket.gethostname())
    vllm_labels = cache_config.metrics_info()
    shown = {name: value for name, value in labels["0"].items() if name not in ("deployment", "replica", "engine")}
    # Exactly vLLM's labels and values, but the Mamba block size the engine really runs with.
    assert shown == {**vllm_labels, "mamba_block_size": "1056"}
    assert (shown["gpu_memory_utilization"], shown["mamba_cache_mode"]) == ("0.85", "align")
    gauges = {
        sample.name: sample.value
        for sample in samples(exposition, "cache_config_mamba_block_size")
        + samples(exposition, "cache_config_vllm_mamba_block_size")
        if sample.labels["deployment"] == "Qwen3_Next__test_"
    }
    assert gauges == {"cache_config_mamba_block_size": 1056, "cache_config_vllm_mamba_block_size": 16}


def test_vllm_own_config_goes_first_and_again_only_when_it_changed(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter], tmp_path: Path
) -> None:
    server = stub()
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    plugin_on(
        monkeypatch, server.url, deployment="team/qwen3:35b@prod", replica="gpu-7:8001", token_file=str(token_file),
        token="not-me",
    )  # fmt: skip
    client = frontend(mamba_cache_mode="align", kv_cache_dtype_skip_layers=["model.layers.0"])
    configs = []
    for payload in two_engines():
        client._apply_ready_response(payload)
        configs.append(client.vllm_config.cache_config.metrics_info())
        assert forwarder().flush(10)
    # Unchanged since the last PUT (an engine answering again): only the payload goes.
    forwarder().submit(client, two_engines()[1])
    assert forwarder().flush(10)

    base = "/api/v1/deployments/team/qwen3%3A35b%40prod"
    assert server.routes() == [
        ("PUT", f"{base}/cache-config"),
        ("POST", f"{base}/ready"),
        ("PUT", f"{base}/cache-config"),
        ("POST", f"{base}/ready"),
        ("POST", f"{base}/ready"),
    ]
    assert urllib.parse.unquote(server.requests[0].path).startswith("/api/v1/deployments/team/qwen3:35b@prod/")
    # Every request names the replica and promises heartbeats at the default interval.
    assert all(r.query == {"replica": "gpu-7:8001", "heartbeat": "30"} for r in server.requests)
    assert [r.body for r in server.requests if r.method == "POST"] == [*two_engines(), two_engines()[1]]
    assert {r.headers["Content-Type"] for r in server.requests if r.method == "PUT"} == {"application/json"}
    assert {r.headers["Content-Type"] for r in server.requests if r.method == "POST"} == {"application/vnd.msgpack"}
    assert {r.headers["Authorization"] for r in server.requests} == {"Bearer from-the-file"}

    # Each PUT is exactly vLLM's metrics_info() at that moment: every label, rendered by vLLM, nothing converted.
    sent = [json.loads(r.body) for r in server.requests if r.method == "PUT"]
    assert sent == configs
    assert (sent[0]["num_gpu_blocks"], sent[1]["num_gpu_blocks"]) == ("1997", "3994")
    assert (sent[1]["kv_cache_dtype_skip_layers"], sent[1]["num_cpu_blocks"]) == ("['model.layers.0']", "None")


def test_a_refused_field_warns_once_and_ready_responses_still_go(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stub: Callable[..., StubExporter]
) -> None:
    problem = {"field": "prefix_cache_retention_interval", "detail": "'None' is not an integer"}
    server = stub(refusal=json.dumps(problem).encode())
    plugin_on(monkeypatch, server.url)
    client = frontend()
    for payload in two_engines():
        client._apply_ready_response(payload)
        assert forwarder().flush(10)

    (warning,) = plugin_logs(caplog)
    assert "'prefix_cache_retention_interval'" in warning
    assert "'None' is not an integer" in warning
    # Refused, so not retried; the changed config (summed blocks) is offered once more.
    assert [method for method, _ in server.routes()] == ["PUT", "POST", "PUT", "POST"]


@pytest.mark.parametrize(
    ("served_model_name", "configured", "expected"),
    [
        pytest.param("org/model", None, "org/model", id="served-name"),
        pytest.param(["Qwen/Qwen3-Next", "alias"], None, "Qwen/Qwen3-Next", id="first-served-name"),
        pytest.param([], None, "default", id="no-served-name"),
        pytest.param(None, None, "default", id="none"),
        pytest.param("org/model", "team/qwen3:35b@prod", "team/qwen3:35b@prod", id="configured"),
        pytest.param("/models/granite-4.0-h-tiny/", None, "granite-4.0-h-tiny", id="absolute-path"),
        pytest.param("~/models/Llama 3.1 (8B)", None, "Llama_3.1__8B_", id="home-path"),
        pytest.param("../tiny/.hidden", None, "_hidden", id="relative-path"),
        pytest.param("/", None, "default", id="root"),
        pytest.param("org//model name", "", "org/model_name", id="empty-segment-and-space"),
        pytest.param("x", "-team/a?b", "_team/a_b", id="configured-made-to-fit"),
        pytest.param("é" * 300, None, "_" * 200, id="too-long"),
        pytest.param("a" * 199 + "/b", None, "a" * 199, id="cut-right-after-a-slash"),
    ],
)
def test_deployment_name_fits_the_exporter(
    served_model_name: str | list[str] | None, configured: str | None, expected: str
) -> None:
    assert deployment_of(frontend(served_model_name).vllm_config, configured) == expected


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({"data_parallel_rank": 3, "instance_id": "run-1"}, (3, "run-1"), id="rank-and-run"),
        pytest.param({"data_parallel_rank": True, "instance_id": "run-1"}, (0, "run-1"), id="a-boolean-is-no-rank"),
        pytest.param({"data_parallel_rank": "1", "instance_id": ""}, (0, None), id="neither-given-as-such"),
    ],
)
def test_the_engine_and_the_run_are_read_as_the_exporter_reads_them(
    fields: dict[str, object], expected: tuple[int, str | None]
) -> None:
    assert vllm_plugin.engine_and_run(msgspec.msgpack.encode(fields)) == expected


@pytest.mark.parametrize(
    ("configured", "argv", "host", "expected"),
    [
        pytest.param(None, ["vllm", "serve", "org/m", "--port", "8001"], "gpu-node-7", "gpu-node-7:8001", id="port"),
        pytest.param(None, ["vllm", "serve", "org/m", "--port=9000"], "gpu-node-7", "gpu-node-7:9000", id="port="),
        pytest.param(None, ["vllm", "serve", "org/m"], "gpu-node-7", "gpu-node-7:8000", id="vllm-default-port"),
        pytest.param(None, ["--port", "1", "--port", "2"], "h.example", "h.example:2", id="last-port-wins"),
        pytest.param(None, ["serve", "--port"], "h", "h:8000", id="port-without-value"),
        pytest.param(None, [], "-pod name/x", "_pod_name_x:8000", id="host-made-to-fit"),
        pytest.param("pod-3", ["--port", "8001"], "h", "pod-3", id="configured"),
        pytest.param("team/a b", [], "h", "team_a_b", id="configured-made-to-fit"),
        pytest.param("é" * 300, [], "h", "_" * 200, id="too-long"),
    ],
)
def test_replica_name_tells_vllm_servers_apart_and_fits_the_exporter(
    configured: str | None, argv: list[str], host: str, expected: str
) -> None:
    assert replica_of(configured, argv, host) == expected


def test_registration_says_so_in_vllm_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=vllm_plugin.logger.name)
    plugin_on(monkeypatch, "http://127.0.0.1:1")
    assert plugin_logs(caplog, logging.INFO) == [
        "cache-config-exporter: forwarding ready responses to http://127.0.0.1:1"
    ]


def test_loading_twice_patches_once(monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url)
    core_client = importlib.import_module(CORE_CLIENT)
    patched = core_client.MPClient._apply_ready_response
    register()
    assert core_client.MPClient._apply_ready_response is patched
    assert not hasattr(patched.__wrapped__, FORWARDER_ATTRIBUTE)

    client = frontend()
    client._apply_ready_response(ready_response())
    assert forwarder().flush(10)
    assert client.vllm_config.cache_config.num_gpu_blocks == 1997
    assert [r.method for r in server.requests] == ["PUT", "POST"]


def test_a_failing_original_propagates_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url)
    client = frontend()
    with pytest.raises(msgspec.DecodeError):
        client._apply_ready_response(b"\xc1")
    assert forwarder().flush(10)
    assert server.requests == []


def test_an_empty_payload_is_vllm_business_only(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    """What an engine before 0.20 sends first: vLLM handles it, there is nothing to forward."""
    server = stub()
    plugin_on(monkeypatch, server.url)
    client = frontend()
    client._apply_ready_response(b"")
    assert client._effective_attention_block_sizes == {None}
    assert forwarder().flush(10)
    assert server.requests == []


@pytest.mark.parametrize(
    ("exporter", "reason"),
    [
        pytest.param(None, "refused", id="down"),
        pytest.param({"slow": True}, "timed out", id="slow"),
        pytest.param({"status": 401, "body": b'{"detail": "missing bearer token"}'}, "missing bearer token", id="401"),
        pytest.param({"status": 503}, "HTTP 503", id="503"),
    ],
)
def test_an_exporter_away_changes_nothing_for_vllm_and_gets_everything_once_back(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stub: Callable[..., StubExporter],
    exporter: dict[str, Any] | None,
    reason: str,
) -> None:
    caplog.set_level(logging.INFO, logger=vllm_plugin.logger.name)
    port = free_port()
    server = stub(port=port, **exporter) if exporter is not None else None
    url = f"http://127.0.0.1:{port}"
    plugin_on(monkeypatch, url, timeout=str(TIMEOUT))
    client = frontend()
    for payload in two_engines():
        started = time.monotonic()
        client._apply_ready_response(payload)
        # Queued, not sent: even one attempt would take the whole timeout against the slow exporter.
        assert time.monotonic() - started < TIMEOUT
    assert client.vllm_config.cache_config.num_gpu_blocks == 3994

    (warning,) = wait_until(lambda: plugin_logs(caplog))
    assert reason in warning
    # Kept and retried: the newest labels and each engine's ready response, never a response before its labels.
    assert forwarder().backlog() == {url: 3}
    if server is not None:
        wait_until(lambda: len(server.requests) >= 3)
        assert {method for method, _ in server.routes()} == {"PUT"}
        server.status, server.body, server.slow = 200, b"{}", False
        server.release.set()
    else:
        server = stub(port=port)
    assert forwarder().flush(10)

    # The labels, then both engines' responses in one request.
    assert [method for method, _ in server.routes()][-2:] == ["PUT", "POST"]
    assert json.loads(server.requests[-2].body) == client.vllm_config.cache_config.metrics_info()
    assert server.requests[-1].body == as_array(two_engines())
    assert len(plugin_logs(caplog)) == 1
    assert f"{url} is reachable again" in plugin_logs(caplog, logging.INFO)[-1]


def test_heartbeats_keep_the_replica_and_an_exporter_without_it_gets_the_whole_state_again(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url, heartbeat_seconds="1", replica="r1")
    client = frontend()
    for payload in two_engines():
        client._apply_ready_response(payload)
    assert forwarder().flush(10)
    delivered = len(server.requests)

    def heartbeats() -> list[Recorded]:
        return [r for r in server.requests if r.path.endswith("/heartbeat")]

    wait_until(lambda: len(heartbeats()) >= 2, timeout=5)
    assert heartbeats()[0].query == {"replica": "r1", "interval": "1"}
    # Labels, engines and heartbeats came on one kept connection: a fleet's heartbeats cost no new connections.
    assert len({r.peer for r in server.requests}) == 1
    # The exporter restarted without its storage: it answers the next heartbeat 404.
    server.heartbeat_status = 404
    again = delivered + len(heartbeats())

    def resent() -> list[Recorded]:
        return [r for r in server.requests[again:] if not r.path.endswith("/heartbeat")]

    wait_until(lambda: len(resent()) == 2, timeout=5)
    server.heartbeat_status = 204
    assert [r.method for r in resent()] == ["PUT", "POST"]
    assert json.loads(resent()[0].body) == client.vllm_config.cache_config.metrics_info()
    assert resent()[1].body == as_array(two_engines())


def test_goodbye_removes_the_replica_and_an_exporter_that_hangs_neither_delays_nor_blocks_it(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server = stub()
    with socket.socket() as hanging:
        # Takes connections (the kernel does) but never answers.
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)
        plugin_on(
            monkeypatch,
            f"{server.url}, http://127.0.0.1:{hanging.getsockname()[1]}",
            replica="r1",
            timeout=str(TIMEOUT),
        )
        frontend()._apply_ready_response(ready_response())
        (answering,) = [delivery for delivery in forwarder().deliveries if delivery.url == server.url]
        assert answering.flush(10)

        started = time.monotonic()
        forwarder().goodbye()
        assert time.monotonic() - started < TIMEOUT + 0.2
    assert server.routes("DELETE") == [("DELETE", "/api/v1/deployments/org/hybrid")]
    assert server.requests[-1].query == {"replica": "r1"}


def held_replicas(exporter: ExporterProcess) -> list[str]:
    """The replicas of ``org/hybrid`` the exporter holds."""
    reply = request(exporter.url, "GET", "/api/v1/deployments?deployment=org/hybrid")
    assert reply.status == 200, reply.body[:300]
    return [replica["replica"] for replica in reply.json()]


def test_vllm_shutting_its_client_down_says_goodbye_at_once(
    monkeypatch: pytest.MonkeyPatch, start_exporter: Callable[..., ExporterProcess]
) -> None:
    """What each API-server process of a vLLM server does as it stops, whether or not an exit handler runs after."""
    exporter = start_exporter()
    plugin_on(monkeypatch, exporter.url, replica="r1")
    client = running(frontend())
    for payload in two_engines():
        client._apply_ready_response(payload)
    assert forwarder().flush(10)
    assert held_replicas(exporter) == ["r1"]

    assert client.shutdown(timeout=5.0) is None
    # vLLM's own shutdown ran, then the goodbye: the replica is gone before ``shutdown`` returns.
    assert client.resources.cleanups == 1
    assert held_replicas(exporter) == []
    # vLLM may shut down twice (its engine monitor, then its API server): nothing more, nothing raised.
    client.shutdown()
    assert client.resources.cleanups == 1


def test_the_goodbye_is_said_once_so_that_being_asked_again_at_exit_waits_no_more(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url, replica="r1", timeout=str(TIMEOUT))
    client = running(frontend())
    client._apply_ready_response(ready_response())
    assert forwarder().flush(10)
    # The exporter stops answering: the labels in flight, then the goodbye, each wait out the timeout.
    server.slow = True
    client._apply_ready_response(ready_response())
    wait_until(lambda: len(server.requests) == 3)
    started = time.monotonic()
    client.shutdown()
    shutdown_seconds = time.monotonic() - started
    # What the exit of the process does next.
    started = time.monotonic()
    forwarder().goodbye()
    exit_seconds = time.monotonic() - started
    assert shutdown_seconds < TIMEOUT + 0.2
    assert exit_seconds < TIMEOUT / 2
    forwarder().close()
    assert server.routes("DELETE") == [("DELETE", "/api/v1/deployments/org/hybrid")]


class FailingEngineManager:
    """An engine manager whose shutdown runs out of time."""

    def shutdown(self, timeout: float | None = None) -> None:
        raise TimeoutError(f"engine cores still running after {timeout} s")


def delivered(monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]) -> tuple[StubExporter, Any]:
    """A running frontend whose first ready response the exporter stub already holds."""
    server = stub()
    plugin_on(monkeypatch, server.url, replica="r1")
    client = running(frontend())
    client._apply_ready_response(ready_response())
    assert forwarder().flush(10)
    return server, client


def test_vllm_own_shutdown_failing_still_ends_in_the_goodbye_and_its_error_stays_vllm_own(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server, client = delivered(monkeypatch, stub)
    client.resources.engine_manager = FailingEngineManager()
    with pytest.raises(TimeoutError, match=r"after 1\.0 s"):
        client.shutdown(timeout=1.0)
    assert server.routes("DELETE") == [("DELETE", "/api/v1/deployments/org/hybrid")]


def api_server(held: multiprocessing.synchronize.Event, leave: multiprocessing.synchronize.Event) -> None:
    """An API-server process: forwards its engines' ready responses, serves until told to leave, and returns
    without shutting its client down."""
    client = frontend()
    for payload in two_engines():
        client._apply_ready_response(payload)
    if forwarder().flush(10):
        held.set()
    leave.wait(30)


def test_an_api_server_process_says_goodbye_as_it_leaves_although_exit_handlers_never_run_there(
    monkeypatch: pytest.MonkeyPatch, start_exporter: Callable[..., ExporterProcess]
) -> None:
    """vLLM's API-server processes (``--api-server-count``, by default the data-parallel size) are multiprocessing
    children. A forked one leaves through ``os._exit`` after multiprocessing's exit function: no ``atexit`` there."""
    exporter = start_exporter()
    plugin_on(monkeypatch, exporter.url, replica="r1")
    context = multiprocessing.get_context("fork")
    held, leave = context.Event(), context.Event()
    process = context.Process(target=api_server, args=(held, leave), name="ApiServer_0")
    process.start()
    try:
        assert held.wait(30)
        assert held_replicas(exporter) == ["r1"]
        leave.set()
        process.join(30)
    finally:
        process.kill()
    assert process.exitcode == 0
    assert held_replicas(exporter) == []


def test_a_forked_child_never_says_goodbye_for_its_parent(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server, client = delivered(monkeypatch, stub)
    (delivery,) = forwarder().deliveries
    # Forked while no delivery thread holds the lock that the child takes.
    with delivery._condition:
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # The child forwards too (an engine answering again), then shuts its copy of the client down.
            client._apply_ready_response(ready_response())
            if forwarder().flush(10):
                client.shutdown()
                code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    # The child's own labels (vLLM summed the blocks once more) and ready response.
    assert [method for method, _ in server.routes()] == ["PUT", "POST", "PUT", "POST"]

    # The parent's own goodbye, once however often it is asked for.
    client.shutdown()
    forwarder().goodbye()
    assert server.routes("DELETE") == [("DELETE", "/api/v1/deployments/org/hybrid")]


def test_token_is_sent_as_bearer_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stub: Callable[..., StubExporter]
) -> None:
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.logger.name)
    token = "s3cr3t-t0ken"
    server = stub(status=403, body=json.dumps({"detail": f"token {token} is not allowed"}).encode())
    plugin_on(monkeypatch, server.url, token=token)
    frontend()._apply_ready_response(ready_response())
    # Refused, and tried again: the token may be rotated.
    wait_until(lambda: len(server.requests) >= 3)

    assert server.requests[0].headers["Authorization"] == f"Bearer {token}"
    assert "is not allowed" in caplog.text
    assert token not in caplog.text


def test_memory_stays_bounded_while_the_exporter_is_away_and_the_newest_run_arrives(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Hours away, simulated: 5,000 restarts of a server with two engines (10,000 ready responses)."""
    exporter = ExporterProcess(tmp_path / "exporter.db")
    plugin_on(monkeypatch, exporter.url, heartbeat_seconds="1")

    def restart(run: int) -> Any:
        client = frontend()
        for rank in (0, 1):
            client._apply_ready_response(
                ready_response(data_parallel_size=2, data_parallel_rank=rank, instance_id=f"run-{run}",
                               num_gpu_blocks=1000 + run)
            )  # fmt: skip
        return client

    for run in range(100):
        restart(run)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for run in range(100, 5000):
            client = restart(run)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    unbounded = 9800 * len(ready_response())
    record(record_property, "plugin memory, exporter away", ready_responses=10_000, grown_bytes=grown,
           unbounded_bytes=unbounded, held_items=forwarder().backlog()[exporter.url])  # fmt: skip
    # The newest labels and one ready response per engine, whatever the number of updates.
    assert forwarder().backlog() == {exporter.url: 3}
    assert grown < unbounded / 100

    try:
        exporter.start()
        assert forwarder().flush(10)
        with urllib.request.urlopen(f"{exporter.url}/api/v1/deployments?deployment=org/hybrid", timeout=10) as response:
            (replica,) = json.loads(response.read())
    finally:
        exporter.stop()
    assert (replica["replica"], replica["instance_id"]) == (forwarder().replica, "run-4999")
    assert replica["static_labels"] == client.vllm_config.cache_config.metrics_info()
    assert [engine["response"]["num_gpu_blocks"] for engine in replica["engines"]] == [5999, 5999]


def test_the_added_cost_on_vllm_start_up_path_is_tiny_with_the_exporter_down(
    monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    # Production backoff: the measure is the caller's time, with the delivery thread as it really runs.
    monkeypatch.setattr(delivery, "FIRST_RETRY_SECONDS", 0.5)
    monkeypatch.setattr(delivery, "MAX_RETRY_SECONDS", 30.0)
    plugin_on(monkeypatch, f"http://127.0.0.1:{free_port()}")
    wrapped = importlib.import_module(CORE_CLIENT).MPClient._apply_ready_response
    original = wrapped.__wrapped__
    payloads = [ready_response(instance_id=f"run-{run}") for run in range(1000)]

    def median_seconds(method: Callable[[Any, bytes], None]) -> float:
        timings = []
        for payload in payloads:
            client = frontend()
            started = time.perf_counter()
            method(client, payload)
            timings.append(time.perf_counter() - started)
        return statistics.median(timings)

    original_seconds, wrapped_seconds = median_seconds(original), median_seconds(wrapped)
    added = wrapped_seconds - original_seconds
    record(record_property, "plugin start-up cost, exporter down", original_us=round(original_seconds * 1e6, 1),
           wrapped_us=round(wrapped_seconds * 1e6, 1), added_us=round(added * 1e6, 1))  # fmt: skip
    # Per engine, once per start: far below a millisecond, against seconds to minutes of vLLM start-up.
    assert added < 0.001


@pytest.mark.parametrize(
    "break_vllm",
    [
        pytest.param(lambda mp: mp.setitem(sys.modules, CORE_CLIENT, None), id="no-module"),
        pytest.param(lambda mp: mp.delattr(importlib.import_module(CORE_CLIENT), "MPClient"), id="no-class"),
        pytest.param(
            lambda mp: mp.delattr(importlib.import_module(CORE_CLIENT).MPClient, "_apply_ready_response"),
            id="no-method",
        ),
    ],
)
def test_a_vllm_without_the_handler_gets_a_warning_and_no_change(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    break_vllm: Callable[[pytest.MonkeyPatch], None],
) -> None:
    break_vllm(monkeypatch)
    before = vllm_state()
    plugin_on(monkeypatch, "http://127.0.0.1:1")
    (warning,) = plugin_logs(caplog)
    assert "not forwarding" in warning
    assert vllm_state() == before


@pytest.mark.parametrize(
    ("environ", "expected", "warns"),
    [
        ({}, None, False),
        ({"CACHE_CONFIG_EXPORTER_URL": " "}, None, False),
        ({"CACHE_CONFIG_EXPORTER_URL": "exporter:10987"}, None, True),
        ({"CACHE_CONFIG_EXPORTER_URL": "http://e:1/"}, Target(("http://e:1",)), False),
        (
            {"CACHE_CONFIG_EXPORTER_URL": "https://e", "CACHE_CONFIG_EXPORTER_TIMEOUT": "0.5"},
            Target(("https://e",), timeout_seconds=0.5),
            False,
        ),
        (
            {"CACHE_CONFIG_EXPORTER_URL": "http://e", "CACHE_CONFIG_EXPORTER_TIMEOUT": "-1"},
            Target(("http://e",)),
            True,
        ),
        # An HA pair: each exporter gets everything; the same one twice is one.
        (
            {"CACHE_CONFIG_EXPORTER_URL": " http://a:1, http://b:2\thttp://a:1/ ,"},
            Target(("http://a:1", "http://b:2")),
            False,
        ),
        ({"CACHE_CONFIG_EXPORTER_URL": "http://a:1,exporter:10987"}, Target(("http://a:1",)), True),
        (
            {
                "CACHE_CONFIG_EXPORTER_URL": "http://e",
                "CACHE_CONFIG_EXPORTER_REPLICA": " pod-3 ",
                "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS": "5",
            },
            Target(("http://e",), replica="pod-3", heartbeat_seconds=5.0),
            False,
        ),
        # The exporter takes heartbeat intervals from 1 s to a day.
        (
            {"CACHE_CONFIG_EXPORTER_URL": "http://e", "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS": "0.5"},
            Target(("http://e",)),
            True,
        ),
        (
            {"CACHE_CONFIG_EXPORTER_URL": "http://e", "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS": "nan"},
            Target(("http://e",)),
            True,
        ),
    ],
)
def test_target_from_environment(
    caplog: pytest.LogCaptureFixture, environ: dict[str, str], expected: Target | None, warns: bool
) -> None:
    assert Target.from_environment(environ) == expected
    assert bool(plugin_logs(caplog)) is warns


def eight_engines(run: str) -> tuple[bytes, ...]:
    """Data parallel 8 in run ``run``: every engine answers as the server starts."""
    return tuple(
        ready_response(data_parallel_size=8, data_parallel_rank=rank, instance_id=run, num_gpu_blocks=1000 + rank)
        for rank in range(8)
    )


def test_a_data_parallel_server_starting_or_restarting_sends_its_engines_in_one_request(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]
) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url, replica="r1")
    client = frontend()
    for run in ("run-1", "run-2"):
        for payload in eight_engines(run):
            client._apply_ready_response(payload)
        assert forwarder().flush(10)
    # Per run: the newest labels once (the frontend's change with each engine's blocks), then the eight engines'
    # responses in one request.
    assert [method for method, _ in server.routes()] == ["PUT", "POST", "PUT", "POST"]
    assert json.loads(server.requests[2].body) == client.vllm_config.cache_config.metrics_info()
    assert [r.body for r in server.requests[1::2]] == [as_array(eight_engines(run)) for run in ("run-1", "run-2")]


def test_the_exporter_takes_a_data_parallel_servers_engines_from_one_request(
    monkeypatch: pytest.MonkeyPatch, start_exporter: Callable[..., ExporterProcess]
) -> None:
    exporter = start_exporter()
    plugin_on(monkeypatch, exporter.url, replica="r1")
    client = frontend()
    for payload in eight_engines("run-1"):
        client._apply_ready_response(payload)
    assert forwarder().flush(10)
    reply = request(exporter.url, "GET", "/api/v1/deployments/org/hybrid?replica=r1")
    engines = reply.json()["engines"]
    assert [(engine["engine"], engine["response"]["num_gpu_blocks"]) for engine in engines] == [
        (rank, 1000 + rank) for rank in range(8)
    ]
