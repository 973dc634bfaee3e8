"""The real server as a user runs it: a subprocess, real HTTP on loopback, a real SQLite file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from protocol import releases
from tests.release_payloads import vllm_decode
from tests.support import FIXTURES, MSGPACK, ExporterProcess, fixture_bytes, info_labels, samples


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def scrape(exporter: ExporterProcess) -> str:
    status, body = http("GET", f"{exporter.url}/metrics")
    assert status == 200
    return body.decode()


def cache_config_series(exposition: str) -> list[tuple[str, list, float]]:
    return sorted(
        (sample.name, sorted(sample.labels.items()), sample.value)
        for name in ("cache_config_info", "cache_config_block_size", "cache_config_mamba_block_size",
                     "cache_config_num_gpu_blocks", "cache_config_last_update_timestamp_seconds")
        for sample in samples(exposition, name)
    )  # fmt: skip


def test_push_scrape_restart_shows_the_same_true_block_sizes(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    url = f"{exporter.url}/api/v1/deployments/qwen/ready"
    assert http("POST", url, fixture_bytes("hybrid-tp1-post50809"), MSGPACK)[0] == 200
    assert http("POST", f"{exporter.url}/api/v1/ready", fixture_bytes("dp2-rank0"), MSGPACK)[0] == 200
    before = scrape(exporter)
    labels = info_labels(before, "qwen")["0"]
    assert (labels["block_size"], labels["mamba_block_size"]) == ("1056", "1056")

    assert exporter.restart() is exporter
    after = scrape(exporter)
    assert cache_config_series(after) == cache_config_series(before)
    assert len(cache_config_series(after)) == 10


def test_bad_payloads_over_http_get_4xx_and_change_nothing(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    url = f"{exporter.url}/api/v1/deployments/qwen/ready"
    http("POST", url, fixture_bytes("dp2-rank0"), MSGPACK)
    before = cache_config_series(scrape(exporter))
    broken = msgspec.msgpack.decode(fixture_bytes("dp2-rank1"))
    broken["block_size"] = -1
    for body, headers in [
        (msgspec.msgpack.encode(broken), MSGPACK),
        (fixture_bytes("dp2-rank1-conflicting-stats-address"), MSGPACK),
        (b"\x00" * 64, MSGPACK),
        (b"{", {"Content-Type": "application/json"}),
        (fixture_bytes("dp2-rank1"), {"Content-Type": "application/octet-stream"}),
    ]:
        status, problem = http("POST", url, body, headers)
        assert 400 <= status < 500
        assert msgspec.json.decode(problem)["field"]
    assert cache_config_series(scrape(exporter)) == before


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_push_sends_msgpack_and_json_files(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    pushed = run_cli("push", str(FIXTURES / "dp2-rank0.msgpack"), "--url", exporter.url, "--deployment", "dp")
    assert pushed.returncode == 0, pushed.stderr
    assert "block_size=1056" in pushed.stdout
    pushed = run_cli("push", str(FIXTURES / "dp2-rank1.json"), "--url", exporter.url, "--deployment", "dp")
    assert pushed.returncode == 0, pushed.stderr
    assert "num_gpu_blocks=3994" in pushed.stdout
    old = run_cli("push", str(FIXTURES / "minimal-pre42967.msgpack"), "--url", exporter.url, "--engine", "4")
    assert old.returncode == 0, old.stderr
    assert set(info_labels(scrape(exporter), "default")) == {"4"}


def test_cli_push_names_the_replica_and_reaches_every_exporter_of_a_list(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """``CACHE_CONFIG_EXPORTER_URL`` may list an HA pair, as for the plugin: push sends to each."""
    pair = [start_exporter(storage=tmp_path / f"{name}.db") for name in ("a", "b")]
    urls = f"{pair[0].url}, {pair[1].url}"
    env = {**os.environ, "CACHE_CONFIG_EXPORTER_URL": urls, "CACHE_CONFIG_EXPORTER_REPLICA": "gpu-3:8000"}
    pushed = run_cli("push", str(FIXTURES / "hybrid-tp1-post50809.msgpack"), "--deployment", "qwen", env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert [line.split(": deployment")[0] for line in pushed.stdout.splitlines()] == [pair[0].url, pair[1].url]
    for exporter in pair:
        [sample] = samples(scrape(exporter), "cache_config_block_size")
        assert sample.labels == {"deployment": "qwen", "replica": "gpu-3:8000", "engine": "0"}


def test_cli_push_reports_refusals_and_unreachable_exporters(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    exporter = start_exporter()
    junk = tmp_path / "junk.json"
    junk.write_text('{"max_model_len": 0, "num_gpu_blocks": 1}')
    refused = run_cli("push", str(junk), "--url", exporter.url)
    assert refused.returncode == 1
    assert "422" in refused.stderr and "$.max_model_len" in refused.stderr
    exporter.stop()
    unreachable = run_cli("push", str(FIXTURES / "dp2-rank0.msgpack"), "--url", exporter.url, "--timeout", "2")
    assert unreachable.returncode == 1
    assert "cannot reach" in unreachable.stderr


def test_settings_come_from_environment_variables(start_exporter: Callable[..., ExporterProcess], tmp_path: Path):
    config = tmp_path / "base.yaml"
    config.write_text("mamba_cache_mode: align\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "CACHE_CONFIG_EXPORTER_METRIC_PREFIX": "vllm:",
        "CACHE_CONFIG_EXPORTER_CACHE_CONFIG_FILE": str(config),
        "CACHE_CONFIG_EXPORTER_WEB_TELEMETRY_PATH": "/probe",
    }
    exporter = start_exporter(env=env)
    http("POST", f"{exporter.url}/api/v1/ready", fixture_bytes("hybrid-tp1-post50809"), MSGPACK)
    status, body = http("GET", f"{exporter.url}/probe")
    assert status == 200
    labels = info_labels(body.decode(), "default", "vllm:cache_config_info")["0"]
    assert (labels["mamba_cache_mode"], labels["block_size"]) == ("align", "1056")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--metric.prefix", "bad prefix"), "--metric.prefix"),
        (("--cache-config.file", "/nonexistent/cache.toml"), "--cache-config.file"),
        (("--web.listen-address", "nowhere"), "--web.listen-address"),
    ],
)
def test_serve_refuses_bad_settings_with_a_clear_message(tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    result = run_cli("serve", "--storage.path", str(tmp_path / "x.db"), *flags)
    assert result.returncode == 2
    assert message in result.stderr


def test_serve_refuses_a_foreign_storage_file(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.db"
    foreign.write_bytes(b"not sqlite at all" * 200)
    result = run_cli("serve", "--storage.path", str(foreign), "--web.listen-address", "127.0.0.1:0")
    assert result.returncode == 2
    assert "not a database" in result.stderr
    assert foreign.read_bytes() == b"not sqlite at all" * 200


def test_the_readme_quickstart_lines_are_what_a_user_sees(start_exporter: Callable[..., ExporterProcess]) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart") : readme.index("## How it works")]
    documented = [line for line in quickstart.splitlines() if line.startswith("cache_config_")]
    [fixture] = re.findall(r"--data-binary @(\S+)", quickstart)
    [pattern] = re.findall(r"grep -E '(.+)'", quickstart)
    exporter = start_exporter()
    body = (Path(__file__).parent.parent / fixture).read_bytes()
    http("POST", f"{exporter.url}/api/v1/deployments/qwen/ready", body, MSGPACK)
    scraped = [line for line in scrape(exporter).splitlines() if re.search(pattern, line)]
    assert scraped == documented
    assert len(documented) == 4


def test_the_readme_python_example_is_accepted_by_the_exporter_and_by_every_vllm_decoder(
    start_exporter: Callable[..., ExporterProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    [example] = [block.partition("\n")[2] for block in readme.split("```")[1:] if block.startswith("python\n")]
    exporter = start_exporter()
    namespace: dict[str, object] = {}
    exec(example.replace("http://127.0.0.1:10987", exporter.url), namespace)  # the documented code, as written
    assert capsys.readouterr().out == "1056 1056\n"
    payload = namespace["encode_ready_response"](namespace["response"])  # type: ignore[operator]
    for release in releases():
        assert vllm_decode(release, payload).num_gpu_blocks == 1997, release.version
