#!/usr/bin/env python3
"""Try the exporter against a real vLLM, without a GPU: vLLM's own cache_config_info beside the exporter's.

Builds the CPU vLLM once (``scripts/build_vllm_venv.py``: minutes and 3.5 GB the first
time, cached outside the clone, this clone's project installed into it), makes a tiny
hybrid model with random weights (``tests/real_vllm/tiny_models.py``, nothing
downloaded), starts the exporter and ``vllm serve`` with the plugin on loopback,
and prints vLLM's ``vllm:cache_config_info`` line, the exporter's ``cache_config_info``
line and the labels where they differ: the true ``mamba_block_size``. Everything it
started is stopped again; ``--keep-running`` leaves both servers up until Ctrl-C.

Usage, from a clone: ``python3 scripts/try_vllm_cpu.py [--model qwen3-next] [--keep-running]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
MODELS = ("qwen3-next", "granite-moe-hybrid", "llama")
# vLLM's CPU backend: this much memory for the KV cache (GiB), a short context and few sequences keep it small.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}  # fmt: skip
CPU_FLAGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager")
SERVE_TIMEOUT_SECONDS = 300
INFO_LINE = re.compile(r"^(?:vllm:)?cache_config_info\{(.*)\} ", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def say(message: str) -> None:
    print(f"try_vllm_cpu: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> str | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode() if answer.status == 200 else None
    except OSError:
        return None


def wait_for(what: str, condition: Callable[[], str | None], process: subprocess.Popen[bytes], log: Path) -> str:
    """Poll ``condition`` until it answers; fail with the log's tail when ``process`` exits or time runs out."""
    deadline = time.monotonic() + SERVE_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        answer = condition()
        if answer is not None:
            return answer
        if process.poll() is not None:
            raise SystemExit(f"try_vllm_cpu: {what} exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    raise SystemExit(f"try_vllm_cpu: no {what} after {SERVE_TIMEOUT_SECONDS} s:\n{log.read_text()[-4000:]}")


def build_venv() -> Path:
    """The cached CPU vLLM venv, with this clone's project (and so its plugin) installed."""
    say("building or reusing the CPU vLLM venv (the first build takes minutes)")
    built = subprocess.run(
        [sys.executable, str(REPOSITORY / "scripts" / "build_vllm_venv.py")], stdout=subprocess.PIPE, text=True
    )
    if built.returncode:
        raise SystemExit(built.returncode)
    return Path(built.stdout.splitlines()[-1])


def make_model(venv: Path, out_dir: Path, name: str) -> Path:
    """The tiny models of the tests, made with the venv's torch and transformers; the folder of ``name``."""
    say("making the tiny models (random weights, nothing downloaded)")
    made = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "tests.real_vllm.tiny_models", str(out_dir)],
        cwd=REPOSITORY, stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    if made.returncode:
        raise SystemExit(made.returncode)
    return out_dir / name


@contextlib.contextmanager
def started(command: list[str], log: Path, environment: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process group, stopped with SIGTERM (SIGKILL after 60 s) on the way out."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def info_line(exposition: str, deployment: str | None = None) -> str | None:
    """The first ``cache_config_info`` line (of ``deployment``), without the value."""
    for match in INFO_LINE.finditer(exposition):
        if deployment is None or f'deployment="{deployment}"' in match.group(1):
            return match.group(0).rstrip()
    return None


def differing(vllm: str, exporter: str) -> list[str]:
    """The labels both lines have, where their values differ, as ``name: vLLM's -> the exporter's``."""
    theirs, ours = dict(LABEL.findall(vllm)), dict(LABEL.findall(exporter))
    return [f"{name}: {theirs[name]} -> {ours[name]}" for name in theirs if name in ours and theirs[name] != ours[name]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="the tiny model to serve")
    parser.add_argument("--keep-running", action="store_true", help="leave both servers up until Ctrl-C")
    arguments = parser.parse_args()
    venv = build_venv()
    work = Path(tempfile.mkdtemp(prefix="try-vllm-cpu-"))
    model = make_model(venv, work / "models", arguments.model)
    exporter_url = f"http://127.0.0.1:{free_port()}"
    vllm_port = free_port()
    vllm_url = f"http://127.0.0.1:{vllm_port}"
    clean = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
    exporter_command = [
        str(venv / "bin" / "cache-config-exporter"), "serve",
        "--web.listen-address", exporter_url.removeprefix("http://"), "--storage.path", str(work / "exporter.db"),
    ]  # fmt: skip
    vllm_command = [
        str(venv / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(vllm_port), *CPU_FLAGS,
    ]  # fmt: skip
    # The replica is the address vLLM is reached at, as Prometheus would scrape it.
    plugin = {"CACHE_CONFIG_EXPORTER_URL": exporter_url, "CACHE_CONFIG_EXPORTER_REPLICA": f"127.0.0.1:{vllm_port}"}
    with started(exporter_command, work / "exporter.log", clean) as exporter:
        wait_for("exporter", lambda: get(f"{exporter_url}/-/ready"), exporter, work / "exporter.log")
        say(f"exporter on {exporter_url}; starting vllm serve {model.name} on {vllm_url} (about a minute)")
        environment = {**clean, **CPU_ENVIRONMENT, **plugin}
        with started(vllm_command, work / "vllm.log", environment) as vllm:
            wait_for("vllm serve", lambda: get(f"{vllm_url}/health"), vllm, work / "vllm.log")
            ours = wait_for(
                "exporter series",
                lambda: info_line(get(f"{exporter_url}/metrics") or "", model.name),
                vllm,
                work / "vllm.log",
            )
            theirs = info_line(get(f"{vllm_url}/metrics") or "")
            print(f"vLLM's own ({vllm_url}/metrics):\n{theirs}\n")
            print(f"the exporter's ({exporter_url}/metrics):\n{ours}\n")
            print("where they differ (vLLM's -> the engine's true value):")
            for line in differing(theirs or "", ours) or ["(nothing: this model has no Mamba layers)"]:
                print(f"  {line}")
            if arguments.keep_running:
                say(f"both servers keep running (logs in {work}); Ctrl-C stops them")
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
    say(f"stopped; logs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
