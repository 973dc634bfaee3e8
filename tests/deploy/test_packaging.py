"""The wheel and sdist of `python -m build`, installed into a separate venv and used as a user would."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.exposition import scrape
from tests.helpers.http import request
from tests.helpers.slow_group import SLOW_GROUP
from tests.support import FIXTURES, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
# The built wheel and sdist (module fixtures) serve the slow test too: built once, on the slow tests' worker.
pytestmark = pytest.mark.xdist_group(SLOW_GROUP)


def run(*command: str | Path, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        list(map(str, command)), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`: the sdist, then the wheel built from that sdist (so the sdist is proven complete)."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, REPO, cwd=out)
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv (no access to the clone) with the built wheel installed; its bin directory."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", venv, cwd=venv)
    (wheel,) = dist.glob("*.whl")
    run(venv / "bin" / "pip", "install", "--disable-pip-version-check", "--quiet", wheel, cwd=venv)
    return venv / "bin"


def test_the_sdist_has_the_sources_license_and_readme(dist: Path) -> None:
    (sdist,) = dist.glob("cache_config_exporter-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "exporter/cli.py", "protocol/__init__.py"} <= names


def test_the_wheel_declares_the_license_command_and_vllm_plugin(dist: Path) -> None:
    (wheel,) = dist.glob("cache_config_exporter-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name.rsplit("/", 1)[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert f"{info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata
    assert "cache-config-exporter = exporter.cli:main" in entry_points
    assert "[vllm.general_plugins]\ncache_config_exporter = exporter.vllm_plugin:register" in entry_points
    assert not any(name.startswith("tests/") for name in names)


@pytest.fixture
def served(installed: Path, tmp_path: Path) -> Iterator[str]:
    """The installed command serving on a free loopback port, run outside the clone."""
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [installed / "cache-config-exporter", "serve", "--web.listen-address", f"127.0.0.1:{port}",
         "--storage.path", tmp_path / "exporter.db"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return request(url, "GET", "/-/healthy", timeout=1).status == 200
        except OSError:
            return False

    wait_until(healthy, timeout=30)
    yield url
    process.terminate()
    assert process.wait(timeout=20) == 0
    log.close()


@pytest.mark.slow
def test_the_installed_wheel_serves_pushes_and_loads_as_a_vllm_plugin(installed: Path, served: str) -> None:
    assert "cache-config-exporter 0.1.0" in run(installed / "cache-config-exporter", "--version", cwd=installed)
    pushed = run(
        installed / "cache-config-exporter", "push", FIXTURES / "hybrid-tp1-post50809.msgpack",
        "--url", served, "--deployment", "qwen", cwd=installed,
    )  # fmt: skip
    assert "block_size=1056" in pushed
    scraped = scrape(served)
    assert 'cache_config_block_size{deployment="qwen",replica="default",engine="0"} 1056.0' in scraped
    # What vLLM does to find general plugins, in the installed environment.
    plugin = run(
        installed / "python", "-c",
        "from importlib.metadata import entry_points; "
        "(plugin,) = entry_points(group='vllm.general_plugins', name='cache_config_exporter'); "
        "print(callable(plugin.load()))",
        cwd=installed,
    )  # fmt: skip
    assert plugin.strip() == "True"
