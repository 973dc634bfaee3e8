"""The vLLM plugin against vLLM's own ``MPClient._apply_ready_response``, ``CacheConfig`` and ready responses.

By default the tests import the stand-in ``vllm`` package (tests/vllm_standin), a
copy of vLLM 0.32.0's module paths, names, signatures and method bodies.
With ``CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM=1`` they import the installed vLLM
instead; ``tests/test_real_vllm.py`` runs them so with a real vLLM, so that every
test here holds for the real package too.

Each test gets a pristine ``MPClient._apply_ready_response``; the plugin's
forwarder is flushed instead of sleeping, and closed at the end so no thread
outlives its test.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import msgspec
import pytest

from exporter import vllm_plugin
from exporter.vllm_plugin import FORWARDER_ATTRIBUTE, Forwarder, Target, deployment_of, register
from tests.real_vllm.frontend import HYBRID_RESPONSE, frontend_client
from tests.support import ExporterProcess, free_port, info_labels, samples

STANDIN = Path(__file__).parent / "vllm_standin"
REAL_VLLM_VARIABLE = "CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM"
REAL_VLLM = os.environ.get(REAL_VLLM_VARIABLE) == "1"
CORE_CLIENT = "vllm.v1.engine.core_client"
VARIABLES = (
    vllm_plugin.URL_VARIABLE,
    vllm_plugin.DEPLOYMENT_VARIABLE,
    vllm_plugin.TOKEN_FILE_VARIABLE,
    vllm_plugin.TOKEN_VARIABLE,
    vllm_plugin.TIMEOUT_VARIABLE,
)
TIMEOUT = 0.25


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
    """No plugin variables set, backoff short enough for tests, and vLLM's own method back after the test."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(vllm_plugin, "RETRY_DELAYS_SECONDS", (0.01, 0.02, 0.04))
    client_class = vllm_package.MPClient
    monkeypatch.setattr(client_class, "_apply_ready_response", client_class._apply_ready_response)
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


def frontend(served_model_name: str | list[str] | None = "org/hybrid", **cache_config: Any) -> Any:
    """vLLM's frontend client whose (vLLM's own) ``CacheConfig`` has these values."""
    cache_config_class = importlib.import_module("vllm.config").CacheConfig
    client_class = importlib.import_module(CORE_CLIENT).MPClient
    return frontend_client(client_class, cache_config_class(**cache_config), served_model_name)


def plugin_on(monkeypatch: pytest.MonkeyPatch, url: str, **variables: str) -> None:
    """Set the plugin's variables (``deployment=...`` sets CACHE_CONFIG_EXPORTER_DEPLOYMENT) and load it."""
    monkeypatch.setenv(vllm_plugin.URL_VARIABLE, url)
    monkeypatch.setenv(vllm_plugin.TIMEOUT_VARIABLE, str(TIMEOUT))
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
    headers: dict[str, str]
    body: bytes


class StubExporter(ThreadingHTTPServer):
    """Records every request and answers ``status`` with ``body``; when ``slow``, only once ``release`` is set.

    With a ``refusal`` (a problem document), every PUT of a cache config is answered 422 with it.
    """

    daemon_threads = True

    def __init__(
        self, status: int = 200, body: bytes = b"{}", slow: bool = False, refusal: bytes | None = None
    ) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.status = status
        self.body = body
        self.slow = slow
        self.refusal = refusal
        self.release = threading.Event()
        self.requests: list[Recorded] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        """A slow answer meets a client that gave up: expected, not worth a traceback."""


class _StubHandler(BaseHTTPRequestHandler):
    server: StubExporter

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append(Recorded(self.command, self.path, dict(self.headers), body))
        if self.server.slow:
            self.server.release.wait(10)
        refused = self.command == "PUT" and self.server.refusal is not None
        status, answer = (422, self.server.refusal) if refused else (self.server.status, self.server.body)
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json" if refused else "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_PUT = do_POST = _answer

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
    code = "import json, sys, exporter.vllm_plugin; print(json.dumps([m.split('.')[0] for m in sys.modules]))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    loaded = set(json.loads(run.stdout))
    assert "exporter" in loaded
    assert not {"fastapi", "starlette", "uvicorn", "prometheus_client", "msgspec", "vllm"} & loaded


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
    assert any("deployment 'Qwen3_Next__test_'" in line for line in plugin_logs(caplog, logging.INFO))

    with urllib.request.urlopen(f"{exporter.url}/metrics", timeout=10) as response:
        exposition = response.read().decode()
    labels = info_labels(exposition, "Qwen3_Next__test_")
    assert set(labels) == {"0"}
    vllm_labels = cache_config.metrics_info()
    shown = {name: value for name, value in labels["0"].items() if name not in ("deployment", "engine")}
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
    plugin_on(monkeypatch, server.url, deployment="team/qwen3:35b@prod", token_file=str(token_file), token="not-me")
    client = frontend(mamba_cache_mode="align", kv_cache_dtype_skip_layers=["model.layers.0"])
    configs = []
    for payload in two_engines():
        client._apply_ready_response(payload)
        configs.append(client.vllm_config.cache_config.metrics_info())
    # Unchanged since the last PUT (an engine answering again): only the payload goes.
    forwarder().submit(client, two_engines()[1])
    assert forwarder().flush(10)

    base = "/api/v1/deployments/team/qwen3%3A35b%40prod"
    assert [(r.method, r.path) for r in server.requests] == [
        ("PUT", f"{base}/cache-config"),
        ("POST", f"{base}/ready"),
        ("PUT", f"{base}/cache-config"),
        ("POST", f"{base}/ready"),
        ("POST", f"{base}/ready"),
    ]
    assert urllib.parse.unquote(server.requests[0].path).startswith("/api/v1/deployments/team/qwen3:35b@prod/")
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
    assert [r.method for r in server.requests] == ["PUT", "POST", "PUT", "POST"]


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
    ],
)
def test_deployment_name_fits_the_exporter(
    served_model_name: str | list[str] | None, configured: str | None, expected: str
) -> None:
    assert deployment_of(frontend(served_model_name), configured) == expected


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
    ("exporter", "attempts", "reason"),
    [
        pytest.param(None, 0, "refused", id="down"),
        pytest.param({"slow": True}, 4, "timed out", id="slow"),
        pytest.param(
            {"status": 401, "body": b'{"detail": "missing bearer token"}'}, 1, "missing bearer token", id="401"
        ),
        pytest.param({"status": 500}, 4, "HTTP 500", id="500"),
    ],
)
def test_an_exporter_away_changes_nothing_for_vllm_and_warns_once(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stub: Callable[..., StubExporter],
    exporter: dict[str, Any] | None,
    attempts: int,
    reason: str,
) -> None:
    server = stub(**exporter) if exporter is not None else None
    plugin_on(monkeypatch, server.url if server else f"http://127.0.0.1:{free_port()}")
    client = frontend()
    for payload in two_engines():
        started = time.monotonic()
        client._apply_ready_response(payload)
        # Queued, not sent: even one attempt would take the whole timeout against the slow exporter.
        assert time.monotonic() - started < TIMEOUT
    assert client.vllm_config.cache_config.num_gpu_blocks == 3994

    assert forwarder().flush(10)
    (warning,) = plugin_logs(caplog)
    assert reason in warning
    # Each payload's config PUT was given up on (retried only where retrying can help); no ready response was sent.
    assert [r.method for r in (server.requests if server else [])] == ["PUT"] * 2 * attempts


def test_one_warning_per_outage_and_the_config_still_goes_first(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stub: Callable[..., StubExporter]
) -> None:
    caplog.set_level(logging.INFO, logger=vllm_plugin.logger.name)
    server = stub(status=503)
    plugin_on(monkeypatch, server.url)
    client = frontend()
    first, second = two_engines()
    client._apply_ready_response(first)
    assert forwarder().flush(10)
    server.status = 200
    client._apply_ready_response(second)
    assert forwarder().flush(10)

    assert [r.method for r in server.requests] == ["PUT"] * 4 + ["PUT", "POST"]
    assert server.requests[-1].body == second
    assert len(plugin_logs(caplog)) == 1
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_token_is_sent_as_bearer_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stub: Callable[..., StubExporter]
) -> None:
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.logger.name)
    token = "s3cr3t-t0ken"
    server = stub(status=403, body=json.dumps({"detail": f"token {token} is not allowed"}).encode())
    plugin_on(monkeypatch, server.url, token=token)
    frontend()._apply_ready_response(ready_response())
    assert forwarder().flush(10)

    assert server.requests[0].headers["Authorization"] == f"Bearer {token}"
    assert "is not allowed" in caplog.text
    assert token not in caplog.text


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
        ({"CACHE_CONFIG_EXPORTER_URL": "http://e:1/"}, Target("http://e:1"), False),
        (
            {"CACHE_CONFIG_EXPORTER_URL": "https://e", "CACHE_CONFIG_EXPORTER_TIMEOUT": "0.5"},
            Target("https://e", timeout_seconds=0.5),
            False,
        ),
        ({"CACHE_CONFIG_EXPORTER_URL": "http://e", "CACHE_CONFIG_EXPORTER_TIMEOUT": "-1"}, Target("http://e"), True),
    ],
)
def test_target_from_environment(
    caplog: pytest.LogCaptureFixture, environ: dict[str, str], expected: Target | None, warns: bool
) -> None:
    assert Target.from_environment(environ) == expected
    assert bool(plugin_logs(caplog)) is warns
