"""The real server as a user runs it: a subprocess, real HTTP on loopback, a real SQLite file."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from protocol import releases
from tests.helpers.exposition import info_labels, samples, scrape
from tests.helpers.http import MSGPACK, request
from tests.helpers.release_payloads import vllm_decode
from tests.support import ExporterProcess, fixture_bytes


def cache_config_series(exposition: str) -> list[tuple[str, list, float]]:
    return sorted(
        (sample.name, sorted(sample.labels.items()), sample.value)
        for name in ("cache_config_info", "cache_config_block_size", "cache_config_mamba_block_size",
                     "cache_config_num_gpu_blocks", "cache_config_last_update_timestamp_seconds")
        for sample in samples(exposition, name)
    )  # fmt: skip


def test_push_scrape_restart_shows_the_same_true_block_sizes(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    path = "/api/v1/deployments/qwen/ready"
    assert request(exporter.url, "POST", path, fixture_bytes("hybrid-tp1-post50809"), MSGPACK).status == 200
    assert request(exporter.url, "POST", "/api/v1/ready", fixture_bytes("dp2-rank0"), MSGPACK).status == 200
    before = scrape(exporter.url)
    labels = info_labels(before, "qwen")["0"]
    assert (labels["block_size"], labels["mamba_block_size"]) == ("1056", "1056")

    assert exporter.restart() is exporter
    after = scrape(exporter.url)
    assert cache_config_series(after) == cache_config_series(before)
    assert len(cache_config_series(after)) == 10


def test_bad_payloads_over_http_get_4xx_and_change_nothing(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    path = "/api/v1/deployments/qwen/ready"
    request(exporter.url, "POST", path, fixture_bytes("dp2-rank0"), MSGPACK)
    before = cache_config_series(scrape(exporter.url))
    broken = msgspec.msgpack.decode(fixture_bytes("dp2-rank1"))
    broken["block_size"] = -1
    for body, headers in [
        (msgspec.msgpack.encode(broken), MSGPACK),
        (fixture_bytes("dp2-rank1-conflicting-stats-address"), MSGPACK),
        (b"\x00" * 64, MSGPACK),
        (b"{", {"Content-Type": "application/json"}),
        (fixture_bytes("dp2-rank1"), {"Content-Type": "application/octet-stream"}),
    ]:
        refused = request(exporter.url, "POST", path, body, headers)
        assert 400 <= refused.status < 500
        assert msgspec.json.decode(refused.body)["field"]
    assert cache_config_series(scrape(exporter.url)) == before


def test_settings_come_from_environment_variables(start_exporter: Callable[..., ExporterProcess], tmp_path: Path):
    config = tmp_path / "base.yaml"
    config.write_text("mamba_cache_mode: align\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "CACHE_CONFIG_EXPORTER_METRIC_PREFIX": "vllm:",
        "CACHE_CONFIG_EXPORTER_CACHE_CONFIG_FILE": str(config),
        "CACHE_CONFIG_EXPORTER_WEB_TELEMETRY_PATH": "/scrape",
    }
    exporter = start_exporter(env=env)
    request(exporter.url, "POST", "/api/v1/ready", fixture_bytes("hybrid-tp1-post50809"), MSGPACK)
    probe = request(exporter.url, "GET", "/scrape")
    assert probe.status == 200
    labels = info_labels(probe.text, "default", "vllm:cache_config_info")["0"]
    assert (labels["mamba_cache_mode"], labels["block_size"]) == ("align", "1056")


def test_the_readme_quickstart_lines_are_what_a_user_sees(start_exporter: Callable[..., ExporterProcess]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("\n## Quickstart\n")
    quickstart = readme[start : readme.index("\n## ", start + 1)]
    documented = [line for line in quickstart.splitlines() if line.startswith("cache_config_")]
    [fixture] = re.findall(r"--data-binary @(\S+)", quickstart)
    [pattern] = re.findall(r"grep -E '(.+)'", quickstart)
    exporter = start_exporter()
    body = (Path(__file__).resolve().parents[2] / fixture).read_bytes()
    request(exporter.url, "POST", "/api/v1/deployments/qwen/ready", body, MSGPACK)
    scraped = [line for line in scrape(exporter.url).splitlines() if re.search(pattern, line)]
    assert scraped == documented
    assert len(documented) == 4


def test_the_docs_python_example_is_accepted_by_the_exporter_and_by_every_vllm_decoder(
    start_exporter: Callable[..., ExporterProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    [example] = [block.partition("\n")[2] for block in page.split("```")[1:] if block.startswith("python\n")]
    exporter = start_exporter()
    namespace: dict[str, object] = {}
    exec(example.replace("http://127.0.0.1:10987", exporter.url), namespace)  # the documented code, as written
    assert capsys.readouterr().out == "1056 1056\n"
    payload = namespace["encode_ready_response"](namespace["response"])  # type: ignore[operator]
    for release in releases():
        assert vllm_decode(release, payload).num_gpu_blocks == 1997, release.version
