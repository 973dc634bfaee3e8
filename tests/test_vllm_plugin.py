"""The vLLM plugin against a stand-in ``vllm`` package (tests/vllm_standin) with vLLM's module, class and method names.

Every test imports the stand-in afresh and forgets it afterwards, so each one
patches a pristine ``MPClient``; the plugin's forwarder is flushed instead of
sleeping, and closed at the end so no thread outlives its test.
"""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

from exporter import vllm_plugin
from exporter.vllm_plugin import FORWARDER_ATTRIBUTE, Forwarder, Target, register
from protocol.cache_config import LABEL_NAMES
from tests.support import ExporterProcess, fixture_bytes, free_port, info_labels

STANDIN = Path(__file__).parent / "vllm_standin"
CORE_CLIENT = "vllm.v1.engine.core_client"
VARIABLES = (
    vllm_plugin.URL_VARIABLE,
    vllm_plugin.DEPLOYMENT_VARIABLE,
    vllm_plugin.TOKEN_FILE_VARIABLE,
    vllm_plugin.TOKEN_VARIABLE,
    vllm_plugin.TIMEOUT_VARIABLE,
)
TIMEOUT = 0.25
HYBRID = fixture_bytes("hybrid-tp1-post50809")
DP2 = (fixture_bytes("dp2-rank0"), fixture_bytes("dp2-rank1"))


def is_vllm(module_name: str) -> bool:
    return module_name == "vllm" or module_name.startswith("vllm.")


def forget_vllm() -> None:
    for name in [name for name in sys.modules if is_vllm(name)]:
        del sys.modules[name]


def forwarder() -> Forwarder:
    """The forwarder of the patched stand-in ``MPClient`` (fails when it is not patched)."""
    return getattr(importlib.import_module(CORE_CLIENT).MPClient._apply_ready_response, FORWARDER_ATTRIBUTE)


@pytest.fixture(autouse=True)
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in ``vllm`` importable, no plugin variables set, and backoff short enough for tests."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(vllm_plugin, "RETRY_DELAYS_SECONDS", (0.01, 0.02, 0.04))
    monkeypatch.syspath_prepend(str(STANDIN))
    forget_vllm()
    yield
    core_client = sys.modules.get(CORE_CLIENT)
    method = getattr(getattr(core_client, "MPClient", None), "_apply_ready_response", None)
    if hasattr(method, FORWARDER_ATTRIBUTE):
        forwarder().close()
    forget_vllm()


def frontend(served_model_name: str | list[str] | None = "org/hybrid", **cache_config: Any) -> Any:
    """A stand-in frontend client whose vLLM config has these cache config values."""
    config = importlib.import_module("vllm.config")
    core_client = importlib.import_module(CORE_CLIENT)
    vllm_config = config.VllmConfig(
        cache_config=config.CacheConfig(**cache_config), model_config=config.ModelConfig(served_model_name)
    )
    return core_client.MPClient(vllm_config)


def plugin_on(monkeypatch: pytest.MonkeyPatch, url: str, **variables: str) -> None:
    """Set the plugin's variables (``deployment=...`` sets CACHE_CONFIG_EXPORTER_DEPLOYMENT) and load it."""
    monkeypatch.setenv(vllm_plugin.URL_VARIABLE, url)
    monkeypatch.setenv(vllm_plugin.TIMEOUT_VARIABLE, str(TIMEOUT))
    for name, value in variables.items():
        monkeypatch.setenv(f"CACHE_CONFIG_EXPORTER_{name.upper()}", value)
    register()


def vllm_state() -> dict[str, dict[str, Any]]:
    """Every attribute of the stand-in's modules and of their classes: equal snapshots mean nothing was patched."""
    state = {}
    for name, module in list(sys.modules.items()):
        if module is not None and is_vllm(name):
            state[name] = dict(vars(module))
            classes = {key: value for key, value in vars(module).items() if isinstance(value, type)}
            state.update({f"{name}.{key}": dict(vars(value)) for key, value in classes.items()})
    return state


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == vllm_plugin.logger.name and r.levelno >= logging.WARNING
    ]


class Recorded(NamedTuple):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class StubExporter(ThreadingHTTPServer):
    """Records every request and answers ``status`` with ``body``; when ``slow``, only once ``release`` is set."""

    daemon_threads = True

    def __init__(self, status: int = 200, body: bytes = b"{}", slow: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.status = status
        self.body = body
        self.slow = slow
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
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

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
    assert {"exporter", "protocol", "msgspec"} <= loaded
    assert not {"fastapi", "starlette", "uvicorn", "prometheus_client", "vllm"} & loaded


def test_without_url_register_does_nothing_at_all() -> None:
    register()
    assert not any(is_vllm(name) for name in sys.modules)
    client = frontend()
    assert not hasattr(type(client)._apply_ready_response, FORWARDER_ATTRIBUTE)
    client._apply_ready_response(HYBRID)
    assert client.applied == [HYBRID]


def test_ready_response_reaches_a_live_exporter_with_vllm_own_labels(
    monkeypatch: pytest.MonkeyPatch, start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    token_file = tmp_path / "ingest-token"
    token_file.write_text("live-ingest-token\n")
    exporter = start_exporter("--web.ingest-token-file", str(token_file))
    plugin_on(monkeypatch, exporter.url, token_file=str(token_file))
    client = frontend(["org/hybrid", "alias"], mamba_cache_mode="align", gpu_memory_utilization=0.85)

    assert client._apply_ready_response(HYBRID) is None
    # vLLM's own handling ran and its effect is kept.
    assert client.applied == [HYBRID]
    assert (client.vllm_config.cache_config.block_size, client.vllm_config.cache_config.num_gpu_blocks) == (1056, 1997)
    assert forwarder().flush(10)

    with urllib.request.urlopen(f"{exporter.url}/metrics", timeout=10) as response:
        labels = info_labels(response.read().decode(), "org/hybrid")
    assert set(labels) == {"0"}
    assert {name: labels["0"][name] for name in ("block_size", "mamba_block_size", "num_gpu_blocks")} == {
        "block_size": "1056",
        "mamba_block_size": "1056",
        "num_gpu_blocks": "1997",
    }
    # Static values only the frontend knows arrived too.
    assert (labels["0"]["mamba_cache_mode"], labels["0"]["gpu_memory_utilization"]) == ("align", "0.85")


def test_static_config_goes_first_then_every_payload_in_order(
    monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter], tmp_path: Path
) -> None:
    server = stub()
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    plugin_on(monkeypatch, server.url, deployment="team/qwen3:35b@prod", token_file=str(token_file), token="not-me")
    client = frontend(mamba_cache_mode="align", prefix_caching_hash_algo=object())
    for payload in DP2:
        client._apply_ready_response(payload)
    assert forwarder().flush(10)

    base = "/api/v1/deployments/team/qwen3%3A35b%40prod"
    assert [(r.method, r.path) for r in server.requests] == [
        ("PUT", f"{base}/cache-config"),
        ("POST", f"{base}/ready"),
        ("POST", f"{base}/ready"),
    ]
    assert urllib.parse.unquote(server.requests[0].path).startswith("/api/v1/deployments/team/qwen3:35b@prod/")
    assert [r.body for r in server.requests[1:]] == list(DP2)
    assert [r.headers["Content-Type"] for r in server.requests] == [
        "application/json",
        *["application/vnd.msgpack"] * 2,
    ]
    assert {r.headers["Authorization"] for r in server.requests} == {"Bearer from-the-file"}

    config = json.loads(server.requests[0].body)
    assert set(config) <= set(LABEL_NAMES)
    # Not the exporter's (swap_space), not this vLLM's (use_replayssm) and not fitting (an object) stay out.
    assert not {"swap_space", "use_replayssm", "prefix_caching_hash_algo"} & set(config)
    assert config["mamba_cache_mode"] == "align"
    assert (config["block_size"], config["_block_size_resolved"]) == (1056, True)


def test_loading_twice_patches_once(monkeypatch: pytest.MonkeyPatch, stub: Callable[..., StubExporter]) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url)
    core_client = importlib.import_module(CORE_CLIENT)
    patched = core_client.MPClient._apply_ready_response
    register()
    assert core_client.MPClient._apply_ready_response is patched
    assert not hasattr(patched.__wrapped__, FORWARDER_ATTRIBUTE)

    client = frontend()
    client._apply_ready_response(HYBRID)
    assert forwarder().flush(10)
    assert client.applied == [HYBRID]
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
    for payload in DP2:
        started = time.monotonic()
        client._apply_ready_response(payload)
        # Queued, not sent: even one attempt would take the whole timeout against the slow exporter.
        assert time.monotonic() - started < TIMEOUT
    assert client.applied == list(DP2)
    assert client.vllm_config.cache_config.num_gpu_blocks == 3994

    assert forwarder().flush(10)
    (warning,) = warnings_logged(caplog)
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
    client._apply_ready_response(DP2[0])
    assert forwarder().flush(10)
    server.status = 200
    client._apply_ready_response(DP2[1])
    assert forwarder().flush(10)

    assert [r.method for r in server.requests] == ["PUT"] * 4 + ["PUT", "POST"]
    assert server.requests[-1].body == DP2[1]
    assert len(warnings_logged(caplog)) == 1
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_token_is_sent_as_bearer_and_never_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stub: Callable[..., StubExporter]
) -> None:
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.logger.name)
    token = "s3cr3t-t0ken"
    server = stub(status=403, body=json.dumps({"detail": f"token {token} is not allowed"}).encode())
    plugin_on(monkeypatch, server.url, token=token)
    frontend()._apply_ready_response(HYBRID)
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
    (warning,) = warnings_logged(caplog)
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
    assert bool(warnings_logged(caplog)) is warns
