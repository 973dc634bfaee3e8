"""A stock vLLM install that never had this package: the plugin comes from a folder on ``PYTHONPATH`` (as an init
container fills a shared volume), and a real Prometheus joins vLLM's own series with the true capacity.

The stock install is the real-vLLM venv of tests/real_vllm/session.py without this project: a venv whose
site-packages links every entry of that venv's but the project's own, so vLLM, torch and the rest are the same
files and only the plugin is missing. The recipe of docs/vllm.md puts the wheel into a folder with ``pip install
--target``; vLLM, started with that folder on ``PYTHONPATH``, finds the plugin by its entry point, and Prometheus,
configured as docs/metrics.md's "Joining vLLM's own series" says, scrapes both vLLM and the exporter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import tests.real_vllm.test_real_vllm as real_vllm
from tests.helpers.exposition import info_labels, samples
from tests.helpers.prometheus import RULES, PrometheusServer, dashboard_queries
from tests.helpers.slow_group import SLOW_GROUP
from tests.real_vllm.test_real_vllm import VllmServer, exporter_series
from tests.support import ExporterProcess, free_port, wait_until

REPOSITORY = Path(__file__).resolve().parents[2]
# The plugin's folder (a session fixture) serves the slow tests too: built once, on the slow tests' worker.
pytestmark = pytest.mark.xdist_group(SLOW_GROUP)
METRICS_PAGE = REPOSITORY / "docs" / "metrics.md"
PLUGIN_GROUP = "vllm.general_plugins"
LIST_PLUGINS = (
    "import importlib.metadata as m, json; "
    f"print(json.dumps(sorted(e.name for e in m.entry_points(group={PLUGIN_GROUP!r}))))"
)


def run(*command: str | Path, env: dict[str, str] | None = None, cwd: Path = Path("/")) -> str:
    """Run from ``/`` by default: the clone's folder on ``sys.path`` would hold the project (its egg-info)."""
    done = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=600, env=env, cwd=cwd
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def plugins(python: Path, pythonpath: Path | None = None) -> list[str]:
    """vLLM's general plugins as ``python`` finds them by their entry points."""
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    return json.loads(run(python, "-c", LIST_PLUGINS, env=env))


@pytest.fixture(scope="session")
def stock_vllm(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with every package of the real-vLLM venv but this project (linked, not copied)."""
    venv = tmp_path_factory.mktemp("stock-vllm")
    run(vllm_venv / "bin" / "python", "-m", "venv", "--clear", "--without-pip", venv)
    paths = {"base": str(vllm_venv), "platbase": str(vllm_venv)}
    source = Path(sysconfig.get_path("purelib", vars=paths))
    target = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (record,) = source.glob("cache_config_exporter-*.dist-info/RECORD")
    project = {line.split("/", 1)[0] for line in record.read_text().splitlines()} - {".."}
    for entry in source.iterdir():
        if entry.name not in project:
            (target / entry.name).symlink_to(entry)
    vllm = venv / "bin" / "vllm"
    # As pip writes it: spawned processes import the main module again, so it must be guarded.
    vllm.write_text(
        f"#!{venv}/bin/python\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    vllm.chmod(0o755)
    python = venv / "bin" / "python"
    assert "cache_config_exporter" not in plugins(python), "the stock venv must not have the plugin"
    return venv


@pytest.fixture(scope="session")
def plugin_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe of docs/vllm.md: the wheel, then ``pip install --target FOLDER --no-deps`` of it."""
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--wheel", "--outdir", dist, REPOSITORY)
    (wheel,) = dist.glob("cache_config_exporter-*-py3-none-any.whl")
    folder = tmp_path_factory.mktemp("vllm-plugins")
    run(sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", "--target", folder,
        "--no-deps", wheel)  # fmt: skip
    return folder


def test_entry_points_in_a_target_folder_on_pythonpath_are_found(plugin_folder: Path) -> None:
    # No vLLM needed: any Python finds the entry point in the folder, and vLLM asks importlib.metadata the same.
    assert plugins(Path(sys.executable), plugin_folder) == ["cache_config_exporter"]


def readme_join_config(exporter: str, vllm: str) -> dict[str, object]:
    """docs/metrics.md's scrape configuration for the join, aimed at ``exporter`` and ``vllm``, every second."""
    text = METRICS_PAGE.read_text().split("\n## Joining vLLM's own series\n", 1)[1]
    (block,) = re.findall(r"```yaml\n(.*?)```", text.split("\n## ", 1)[0], re.S)
    config = yaml.safe_load(block)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"cache-config-exporter", "vllm"}
    jobs["cache-config-exporter"]["static_configs"] = [{"targets": [exporter]}]
    jobs["vllm"]["static_configs"] = [{"targets": [vllm]}]
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        **config,
    }


@pytest.mark.slow
def test_a_stock_vllm_loads_the_plugin_from_pythonpath_and_prometheus_joins_its_series(
    stock_vllm: Path,
    plugin_folder: Path,
    tiny_models: dict[str, Path],
    start_exporter: Callable[..., ExporterProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = start_exporter()
    # The replica is the address Prometheus scrapes vLLM at, as the downward API's POD_IP:8000 is in a pod.
    port = free_port()
    monkeypatch.setattr(real_vllm, "free_port", lambda: port)
    # Not the clone's folder: vLLM's spawned processes would find the project there.
    monkeypatch.chdir(tmp_path)
    address = f"127.0.0.1:{port}"
    environment = {"PYTHONPATH": str(plugin_folder), "CACHE_CONFIG_EXPORTER_REPLICA": address}
    model = tiny_models["qwen3-next"]
    server = VllmServer(stock_vllm, model, exporter.url, tmp_path / "vllm.log", environment=environment)
    prometheus = PrometheusServer(tmp_path, [])
    try:
        server.wait_ready()
        server.complete(str(model))
        # The plugin ran, from the folder: the stock venv has none of its files.
        assert f"cache-config-exporter: forwarding ready responses to {exporter.url}" in server.log_text()
        exposition = wait_until(lambda: exporter_series(exporter, "qwen3-next"), timeout=30, interval=0.5)
        ours = info_labels(exposition, "qwen3-next")["0"]
        assert ours["replica"] == address
        (vllm_info,) = samples(server.metrics(), "vllm:cache_config_info")
        assert vllm_info.labels["mamba_block_size"] != ours["mamba_block_size"]  # vLLM's 16, the engine's 640

        prometheus.config.write_text(json.dumps(readme_join_config(f"127.0.0.1:{exporter.port}", address)))
        prometheus.start()
        # The ad hoc queries of docs/metrics.md: vLLM's series with the true block sizes, and tokens in use per server.
        (joined,) = prometheus.wait_for(
            "vllm:num_requests_running * on (instance, engine) group_left (block_size, mamba_block_size) "
            "cache_config_info",
            timeout=60,
        )
        assert joined["metric"]["instance"] == address
        assert (joined["metric"]["block_size"], joined["metric"]["mamba_block_size"]) == (
            ours["block_size"],
            ours["mamba_block_size"],
        )
        (in_use,) = prometheus.wait_for(
            "sum by (instance) (vllm:kv_cache_usage_perc * on (instance, engine) group_left "
            "cache_config_kv_cache_size_tokens)"
        )
        assert in_use["metric"] == {"instance": address}
        # The exporter's own metrics keep the exporter's instance.
        (accepted,) = prometheus.wait_for("cache_config_exporter_ready_responses_accepted_total")
        assert accepted["metric"]["instance"] == f"127.0.0.1:{exporter.port}"
        # The recording rules and the dashboard's panel that read vLLM's series.
        (capacity,) = prometheus.wait_for("instance:cache_config_kv_cache_size_tokens:sum", timeout=60)
        assert float(capacity["value"][1]) == float(vllm_info.labels["kv_cache_size_tokens"])
        (used,) = prometheus.wait_for("instance:vllm_kv_cache_used_tokens:sum", timeout=60)
        assert used["metric"]["instance"] == address and 0 <= float(used["value"][1]) <= float(capacity["value"][1])
        (joined_once,) = prometheus.wait_for(
            "vllm:num_requests_running * on (instance, engine) group_left (block_size, mamba_block_size) "
            "instance_engine:cache_config_info:max",
            timeout=60,
        )
        assert joined_once["metric"]["mamba_block_size"] == ours["mamba_block_size"]
        panel = [query.replace("$deployment", ".*") for query in dashboard_queries() if "vllm_kv_cache" in query]
        assert panel
        for query in panel:
            (series,) = prometheus.query(query)
            assert series["metric"]["instance"] == address, query
    finally:
        prometheus.stop()
        server.stop()


@pytest.mark.slow
def test_the_try_script_prints_vllms_line_beside_the_exporters(vllm_venv: Path) -> None:
    """The README's one command to try it without a GPU (its venv is the fixture's, built already)."""
    tried = subprocess.run(
        [sys.executable, str(REPOSITORY / "scripts" / "try_vllm_cpu.py")],
        capture_output=True, text=True, timeout=900, cwd=REPOSITORY,
    )  # fmt: skip
    assert tried.returncode == 0, tried.stderr[-5000:]
    vllm, exporter = re.findall(r"^(?:vllm:)?cache_config_info\{.*\}$", tried.stdout, re.M)
    assert vllm.startswith("vllm:cache_config_info{") and 'mamba_block_size="16"' in vllm
    assert exporter.startswith('cache_config_info{deployment="qwen3-next",')
    # The size the engine aligned its blocks to depends on the CPU's KV-cache dtype (640 on one machine here,
    # 384 on another): the exporter shows it as both block sizes, and the script names the change from 16.
    (true_size,) = set(re.findall(r'(?:^|,|\{)(?:block_size|mamba_block_size)="(\d+)"', exporter))
    assert int(true_size) > 16
    assert tried.stdout.rstrip().endswith(f"mamba_block_size: 16 -> {true_size}")
