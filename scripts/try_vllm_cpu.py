#!/usr/bin/env python3
"""Try the exporter against a real vLLM, without a GPU: vLLM's own cache_config_info beside the exporter's.

Builds the CPU vLLM once (``scripts/build_vllm_venv.py``: minutes and 3.5 GB the first
time, cached outside the clone, this clone's project installed into it), makes a tiny
hybrid model with random weights (``tests/real_vllm/tiny_models.py``, nothing
downloaded), starts the exporter and ``vllm serve`` with the plugin on loopback,
and prints vLLM's ``vllm:cache_config_info`` line, the exporter's ``cache_config_info``
line and the labels where they differ: the true ``mamba_block_size``. Everything it
started is stopped again, also when it is stopped with SIGTERM or Ctrl-C or fails: each
child (the venv's build, the models' maker, each server) runs in a process group of its
own that is ended on the way out (``scripts/process_groups.py``); ``--keep-running``
leaves both servers up until Ctrl-C or SIGTERM.
``--port`` and ``--exporter-port`` choose vLLM's and the exporter's ports (free ones by
default); a port in use is refused before anything is built.

On stderr it says what it is doing with the seconds since it began, the venv's build
its own progress, and every ``PROGRESS_SECONDS`` of waiting for a server that server's
last log line.

Usage, from a clone: ``python3 scripts/try_vllm_cpu.py [--model qwen3-next] [--port N] [--exporter-port N]
[--keep-running]``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

try:
    from scripts import process_groups
except ModuleNotFoundError:  # run as a script: its own folder is on sys.path, the repository is not
    import process_groups  # type: ignore[no-redef]

REPOSITORY = Path(__file__).resolve().parent.parent
MODELS = ("qwen3-next", "granite-moe-hybrid", "llama")
# vLLM's CPU backend: this much memory for the KV cache (GiB), a short context and few sequences keep it small.
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}  # fmt: skip
CPU_FLAGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager")
SERVE_TIMEOUT_SECONDS = 300
# Seconds a server, or the venv's build, has to end after SIGTERM before its process group is killed.
STOP_GRACE_SECONDS = 60.0
# Seconds between the lines that say what a server being waited for is doing.
PROGRESS_SECONDS = 15.0
BEGAN = time.monotonic()
INFO_LINE = re.compile(r"^(?:vllm:)?cache_config_info\{(.*)\} ", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def say(message: str) -> None:
    """``message`` on stderr, with the seconds since the script began."""
    print(f"try_vllm_cpu: [{time.monotonic() - BEGAN:4.0f} s] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_number(text: str) -> int:
    """A TCP port from the command line: 1 to 65535."""
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text} is not a port (1-65535)")
    return port


def why_not_listen(port: int) -> str | None:
    """Why a server could not listen on ``port`` of loopback, where both servers listen (``in use``, ...); None
    when it could."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            return "in use" if error.errno == errno.EADDRINUSE else error.strerror
    return None


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """The options, with the ports checked before anything is built: a port in use ends the script at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default=MODELS[0], help="the tiny model to serve")
    parser.add_argument("--port", type=port_number, help="vLLM's port on 127.0.0.1 (default: a free one)")
    parser.add_argument(
        "--exporter-port", type=port_number, help="the exporter's port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument("--keep-running", action="store_true", help="leave both servers up until Ctrl-C")
    arguments = parser.parse_args(argv)
    if arguments.port is not None and arguments.port == arguments.exporter_port:
        parser.error(f"--port and --exporter-port are both {arguments.port}: vLLM and the exporter need one each")
    for flag, port in (("--port", arguments.port), ("--exporter-port", arguments.exporter_port)):
        reason = None if port is None else why_not_listen(port)
        if reason:
            parser.error(f"{flag} {port}: cannot listen on 127.0.0.1:{port} ({reason}); choose another or leave it out")
    return arguments


def get(url: str) -> str | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode() if answer.status == 200 else None
    except OSError:
        return None


def wait_for(what: str, condition: Callable[[], str | None], process: subprocess.Popen[bytes], log: Path) -> str:
    """Poll ``condition`` until it answers, saying every ``PROGRESS_SECONDS`` what ``process`` last logged; fail
    with the log's tail when ``process`` exits or time runs out."""
    started = time.monotonic()
    deadline, next_report = started + SERVE_TIMEOUT_SECONDS, started + PROGRESS_SECONDS
    while time.monotonic() < deadline:
        answer = condition()
        if answer is not None:
            return answer
        if process.poll() is not None:
            raise SystemExit(
                f"try_vllm_cpu: waiting for {what}, the server exited with {process.returncode}:\n"
                f"{log.read_text()[-4000:]}"
            )
        if time.monotonic() >= next_report:
            next_report += PROGRESS_SECONDS
            say(f"waiting for {what} ({time.monotonic() - started:.0f} s); its log: {last_line(log)}")
        time.sleep(0.5)
    raise SystemExit(f"try_vllm_cpu: {what} did not answer in {SERVE_TIMEOUT_SECONDS} s:\n{log.read_text()[-4000:]}")


def last_line(log: Path) -> str:
    """The last line a server wrote to its log, shortened to fit a terminal's line."""
    lines = log.read_text(errors="replace").strip().splitlines()
    line = lines[-1].strip() if lines else "(nothing yet)"
    return line if len(line) <= 160 else line[:157] + "..."


def build_venv() -> Path:
    """The cached CPU vLLM venv, with this clone's project (and so its plugin) installed; the build's progress
    goes to stderr as it comes."""
    say("building or reusing the CPU vLLM venv (the first build takes minutes and 3.5 GB)")
    return Path(output_of([sys.executable, str(REPOSITORY / "scripts" / "build_vllm_venv.py")]).splitlines()[-1])


def output_of(command: list[str], **popen: object) -> str:
    """What ``command`` printed on stdout, its process group ended if the script is stopped meanwhile; its exit
    code ends the script when it fails."""
    with process_groups.group(command, STOP_GRACE_SECONDS, stdout=subprocess.PIPE, text=True, **popen) as child:
        output, _ = child.communicate()
    if child.returncode:
        raise SystemExit(child.returncode)
    return str(output)


def make_model(venv: Path, out_dir: Path, name: str) -> Path:
    """The tiny models of the tests, made with the venv's torch and transformers; the folder of ``name``."""
    say("making the tiny models (random weights, nothing downloaded)")
    output_of(
        [str(venv / "bin" / "python"), "-m", "tests.real_vllm.tiny_models", str(out_dir)],
        cwd=REPOSITORY, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return out_dir / name


@contextlib.contextmanager
def started(command: list[str], log: Path, environment: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process group, stopped with SIGTERM (SIGKILL after ``STOP_GRACE_SECONDS``) on the way
    out."""
    with (
        log.open("wb") as output,
        process_groups.group(
            command, STOP_GRACE_SECONDS, stdout=output, stderr=subprocess.STDOUT, env=environment
        ) as process,
    ):
        yield process


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


class Commands(NamedTuple):
    """How the two servers are started: each command, and the plugin's variables for vLLM."""

    exporter: list[str]
    vllm: list[str]
    plugin: dict[str, str]


def commands(venv: Path, model: Path, work: Path, vllm_port: int, exporter_port: int) -> Commands:
    """The exporter and ``vllm serve`` on loopback at these ports, vLLM's plugin pointed at the exporter."""
    exporter = [
        str(venv / "bin" / "cache-config-exporter"), "serve",
        "--web.listen-address", f"127.0.0.1:{exporter_port}", "--storage.path", str(work / "exporter.db"),
    ]  # fmt: skip
    vllm = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(vllm_port),
        *CPU_FLAGS,
    ]
    # The replica is the address vLLM is reached at, as Prometheus would scrape it.
    plugin = {
        "CACHE_CONFIG_EXPORTER_URL": f"http://127.0.0.1:{exporter_port}",
        "CACHE_CONFIG_EXPORTER_REPLICA": f"127.0.0.1:{vllm_port}",
    }
    return Commands(exporter, vllm, plugin)


def main(argv: Sequence[str]) -> int:
    arguments = parse_arguments(argv)
    process_groups.stop_on_sigterm()
    venv = build_venv()
    work = Path(tempfile.mkdtemp(prefix="try-vllm-cpu-"))
    model = make_model(venv, work / "models", arguments.model)
    vllm_port, exporter_port = arguments.port or free_port(), arguments.exporter_port or free_port()
    run = commands(venv, model, work, vllm_port, exporter_port)
    exporter_url, vllm_url = run.plugin["CACHE_CONFIG_EXPORTER_URL"], f"http://127.0.0.1:{vllm_port}"
    clean = {name: value for name, value in os.environ.items() if not name.startswith("CACHE_CONFIG_EXPORTER_")}
    say(f"starting the exporter on {exporter_url}")
    with started(run.exporter, work / "exporter.log", clean) as exporter:
        wait_for("the exporter", lambda: get(f"{exporter_url}/-/ready"), exporter, work / "exporter.log")
        say(f"starting vllm serve {model.name} on {vllm_url} with the plugin (a minute or more)")
        environment = {**clean, **CPU_ENVIRONMENT, **run.plugin}
        with started(run.vllm, work / "vllm.log", environment) as vllm:
            wait_for("vllm serve", lambda: get(f"{vllm_url}/health"), vllm, work / "vllm.log")
            say("vllm serve is up; waiting for its engine's ready response at the exporter")
            ours = wait_for(
                "the exporter's series",
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
                say(f"both servers keep running (logs in {work}); Ctrl-C or SIGTERM stops them")
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
            say("stopping vllm serve and the exporter")
    say(f"done in {time.monotonic() - BEGAN:.0f} s; logs in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
