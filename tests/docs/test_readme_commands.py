"""Every shell command of the README's operations sections, run exactly as written.

The commands run from a copy of the clone, with the project's commands on PATH (an activated venv). Those
that write to /etc, /opt or /var/lib run in a private mount and network namespace (`unshare`) with those
directories overlaid, so the machine is left as it was and 127.0.0.1:10987 is their own. The Docker
commands need the host's Docker daemon and run outside it, with the container, volume, image, port and compose
project renamed to names of this run (``own_names``): a user's exporter started from the README is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.figures import record
from tests.support import IN_CI, free_port, require_binary, wait_until

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
OPERATIONS = [
    "Use with vLLM",
    "Running with Docker",
    "Docker Compose",
    "Kubernetes",
    "systemd",
    "Scraping with Prometheus",
    "Pushing ready responses",
    "Securing a deployment",
]
# Blocks no test here can run, and what checks them instead.
NOT_RUN = {
    ("Use with vLLM", 1): "starts vLLM, which needs a model and an accelerator: tests/test_vllm_plugin.py",
    ("Running with Docker", 0): "pulls python:3.11-slim from Docker Hub; the offline build of the same section is run",
    ("Docker Compose", 0): "pulls Prometheus and Grafana from Docker Hub; the offline compose command is run",
    ("Kubernetes", 0): "needs a cluster: tests/test_deploy_manifests.py validates the manifests",
    ("systemd", 1): "needs a running systemd: tests/test_deploy_manifests.py verifies the unit",
    ("Scraping with Prometheus", 0): "the allowlist is run on a vLLM 0.34 engine's labels: tests/test_info_labels.py",
}
WAIT_FOR_EXPORTER = """
for _ in $(seq 200); do curl -sfk {scheme}://127.0.0.1:10987/-/healthy >/dev/null && break; sleep 0.1; done
curl -sfk {scheme}://127.0.0.1:10987/-/healthy >/dev/null
"""


def section(title: str) -> str:
    """A `## ` section of the README, with its `### ` subsections."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def blocks(title: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", section(title), flags=re.DOTALL | re.MULTILINE)


def block(title: str, index: int, containing: str) -> str:
    found = blocks(title)[index]
    assert containing in found, f"README {title!r} block {index} no longer holds {containing!r}"
    return found


def clone(destination: Path) -> Path:
    """The project's files as a fresh clone has them (tracked and new ones, not ignored ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def environment(path_first: Path, state_home: Path | None = None) -> dict[str, str]:
    """The environment of an activated venv: its bin directory first on PATH; with ``state_home``, the
    exporter's default storage (``$XDG_STATE_HOME/cache-config-exporter/exporter.db``) lies in it."""
    state = {"XDG_STATE_HOME": str(state_home)} if state_home is not None else {}
    return {**os.environ, "PATH": f"{path_first}:{os.environ['PATH']}", "VIRTUAL_ENV": str(path_first.parent), **state}


def run_isolated(tmp_path: Path, script: str, timeout: float = 300, own_network: bool = True) -> str:
    """``script`` (bash) from a clone in a private mount namespace with /etc, /opt, /var/lib overlaid, and
    with ``own_network`` a network namespace of its own (its own 127.0.0.1:10987, no way out)."""
    for binary in ("unshare", "ip", "curl", "openssl"):
        require_binary(binary)
    if os.geteuid() != 0:
        message = "overlaying /etc, /opt and /var/lib in a private mount namespace needs root"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    work = clone(tmp_path / "clone")
    mounts = []
    for directory in ("/etc", "/opt", "/var/lib"):
        layer = tmp_path / "overlay" / directory.strip("/")
        (layer / "upper").mkdir(parents=True)
        (layer / "work").mkdir()
        options = f"lowerdir={directory},upperdir={layer}/upper,workdir={layer}/work"
        mounts.append(f"mount -t overlay overlay -o {options} {directory}")
    setup = "\n".join(
        [
            "set -euo pipefail",
            *(["ip link set lo up"] if own_network else []),
            *mounts,
            "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
        ]
    )
    namespaces = ["--net"] if own_network else []
    done = subprocess.run(
        ["unshare", "--mount", *namespaces, "--propagation", "private", "bash", "-c", f"{setup}\n{script}"],
        cwd=work, env=environment(Path(sys.executable).parent, tmp_path / "state"), capture_output=True, text=True,
        timeout=timeout,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def in_background(commands: str, scheme: str = "http") -> str:
    """A block whose last command is ``serve``: run it in the background and wait until it answers."""
    return f"(\n{commands}) &\n" + WAIT_FOR_EXPORTER.format(scheme=scheme)


def test_every_operations_command_is_run_or_says_why_not() -> None:
    """The blocks the tests below run (by section and index, each checked by ``block``), and NOT_RUN, are all."""
    run_here = {("Securing a deployment", index) for index in range(7)} | {
        ("Pushing ready responses", 0),
        ("Pushing ready responses", 1),
        ("Use with vLLM", 0),
        ("Use with vLLM", 2),
        ("systemd", 0),
        ("systemd", 2),
        ("Scraping with Prometheus", 1),
    }
    run_here |= {("Running with Docker", index) for index in (1, 2, 3, 4)} | {("Docker Compose", 1)}
    every = {(title, index) for title in OPERATIONS for index in range(len(blocks(title)))}
    assert every == run_here | set(NOT_RUN), "a README block is neither run nor listed in NOT_RUN"


def test_ingest_tokens_with_their_senders_and_a_rotation(tmp_path: Path) -> None:
    securing = "Securing a deployment"
    script = "\n".join([
        in_background(block(securing, 0, "--web.ingest-token-file")),
        block(securing, 1, "--token-file"),
        "old=$(cat /etc/cache-config-exporter/ingest.token)",
        # The rotation from a fresh shell, whose umask lets others read what it creates.
        f"(umask 022\n{block(securing, 2, '>> /etc/cache-config-exporter/ingest.token')}\n)",
        "new=$(cat /etc/cache-config-exporter/ingest.token.new)",
        f"(umask 022\n{block(securing, 3, 'mv ')}\n)",
        'echo "live token mode: $(stat -c %a /etc/cache-config-exporter/ingest.token)"',
        "ingest() { curl -s -o /dev/null -w '%{http_code}\\n' -X POST -H 'Content-Type: application/vnd.msgpack'"
        " -H \"Authorization: Bearer $1\" --data-binary @tests/fixtures/vllm-ready/hybrid-tp1-post50809.msgpack"
        " http://127.0.0.1:10987/api/v1/deployments/qwen/ready; }",
        'echo "new token: $(ingest "$new")"',
        'echo "old token: $(ingest "$old")"',
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert "deployment qwen: 1 engine(s), block_size=1056" in output
    assert '"block_size":"1056"' in output, "curl's answer: the synced state"
    assert "new token: 200" in output and "old token: 401" in output
    assert "live token mode: 600" in output


def test_pushing_with_the_client_and_curl(tmp_path: Path) -> None:
    pushing = "Pushing ready responses"
    quickstart_serve = "cache-config-exporter serve\n"
    assert quickstart_serve.strip() in section("Quickstart")
    script = "\n".join([
        in_background(quickstart_serve),
        block(pushing, 0, "--format json"),
        block(pushing, 1, "curl -sf"),
        "curl -s http://127.0.0.1:10987/metrics | grep '^cache_config_block_size'",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert output.count("engine(s), block_size=1056 ") == 2, output
    assert '"block_size":"1056"' in output, "curl's answer: the synced state"
    assert 'cache_config_block_size{deployment="qwen-json",replica="default",engine="0"} 1056.0' in output


def test_the_web_config_example_serves_https_with_basic_auth(tmp_path: Path) -> None:
    securing = "Securing a deployment"
    script = "\n".join([
        in_background(block(securing, 4, "--web.config.file"), scheme="https"),
        block(securing, 5, "-u \"prometheus:"),
        "echo; curl -s -o /dev/null -w 'without a password: %{http_code}\\n' --cacert"
        " /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/metrics",
        "curl -sI --cacert /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/-/healthy",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert "cache_config_exporter_build_info" in output
    assert "without a password: 401" in output
    assert "x-frame-options: deny" in output.lower()


def test_the_old_tls_flags_example_serves_https(tmp_path: Path) -> None:
    securing = "Securing a deployment"
    make_certificate = block(securing, 4, "openssl req").split("openssl rand")[0]
    script = "\n".join([
        make_certificate,
        in_background(block(securing, 6, "--web.tls-cert-file"), scheme="https"),
        "curl -sf --cacert /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/-/healthy",
    ])  # fmt: skip
    assert "Healthy." in run_isolated(tmp_path, script)


def test_the_prometheus_configs_with_the_relabelling_pass_promtool(tmp_path: Path) -> None:
    """The configuration that drops vLLM's own copy of the metric, and the join's (run in tests/test_stock_vllm.py)."""
    configs = re.findall(r"^```yaml\n(.*?)^```$", section("Scraping with Prometheus"), flags=re.DOTALL | re.MULTILINE)
    assert len(configs) == 2
    for config in configs:
        (tmp_path / "prometheus.yml").write_text(config)
        checked = subprocess.run(
            [require_binary("promtool"), "check", "config", "prometheus.yml"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert checked.returncode == 0, checked.stdout + checked.stderr
    (vllm,) = [job for job in yaml.safe_load(configs[0])["scrape_configs"] if job["job_name"] == "vllm"]
    (drop,) = vllm["metric_relabel_configs"]
    assert drop["action"] == "drop" and re.fullmatch(drop["regex"], "vllm:cache_config_info")


def test_the_promtool_commands_of_the_alerting_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    commands = block("Scraping with Prometheus", 1, "promtool test rules")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], cwd=clone(tmp_path), env=environment(Path(promtool).parent),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_environment_variable_is_in_the_readme() -> None:
    from exporter.cli import build_parser
    from exporter.settings import ENV_PREFIX

    read = set()
    for command in ("serve", "push"):
        arguments = ["push", "x"] if command == "push" else ["serve"]
        read |= {
            ENV_PREFIX + name.upper()
            for name in vars(build_parser().parse_args(arguments))
            if name not in {"command", "file"}
        }
    for source in (REPO / "exporter").glob("*.py"):
        read |= set(re.findall(r'"(CACHE_CONFIG_EXPORTER_[A-Z_]+)"', source.read_text()))
    missing = sorted(name for name in read if f"`{name}`" not in README)
    assert not missing, f"not in the README: {missing}"


@pytest.mark.slow
def test_installing_the_wheel_for_vllm_and_for_systemd(tmp_path: Path) -> None:
    """The build, the install into "vLLM's python3" (a fresh venv), and the systemd install commands."""
    vllm_python = tmp_path / "vllm-venv"
    subprocess.run([sys.executable, "-m", "venv", vllm_python], check=True, timeout=120)
    script = "\n".join([
        f"export PATH={vllm_python / 'bin'}:$PATH",
        block("Use with vLLM", 0, "python -m build"),
        block("Use with vLLM", 2, "--target /opt/vllm-plugins"),
        block("systemd", 0, "useradd"),
        f"{require_binary('systemd-analyze')} verify /etc/systemd/system/cache-config-exporter.service",
        "/opt/cache-config-exporter/bin/cache-config-exporter --version",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script, timeout=900, own_network=False)  # pip needs the package index
    assert "name='cache_config_exporter'" in output and "exporter.vllm_plugin:register" in output
    # From the folder on PYTHONPATH, before the same plugin installed in that python3.
    assert "/opt/vllm-plugins/exporter/vllm_plugin.py" in output
    assert "cache-config-exporter 0.1.0" in output


# The README's name for the container, its volume and the image, where Docker takes it as a name.
_README_NAME = re.compile(r"(?<=\s)cache-config-exporter(?=[\s:])")


def own_names(script: str, name: str, port: int) -> str:
    """The README's Docker commands with this run's container, volume and image ``name`` and host ``port``."""
    renamed = _README_NAME.sub(name, script).replace("-p 10987:10987", f"-p 127.0.0.1:{port}:10987")
    renamed = renamed.replace("http://127.0.0.1:10987", f"http://127.0.0.1:{port}")
    assert not _README_NAME.search(renamed) and "-p 10987:10987" not in renamed
    return renamed


def test_own_names_rename_every_docker_resource_and_no_path() -> None:
    script = "\n".join(block("Running with Docker", index, "docker") for index in range(5))
    renamed = own_names(script, "cce-readme-run", 40123)
    for renamed_use in ("docker volume create cce-readme-run", "--name cce-readme-run", "-v cce-readme-run:/var/lib",
                        "-t cce-readme-run", "host cce-readme-run push", "docker rm -f cce-readme-run"):  # fmt: skip
        assert renamed_use in renamed
    assert "/var/lib/cache-config-exporter" in renamed and "/etc/cache-config-exporter" in renamed
    assert "cache-config-exporter-base:bookworm" in renamed
    assert "-p 127.0.0.1:40123:10987" in renamed and "chown 10987:10987" in renamed, "the port, not the owner"


def test_the_systemd_token_folder_lets_the_service_user_read_its_token(tmp_path: Path) -> None:
    """Even over a folder made under ``umask 077`` (0700, which the service's user could not enter)."""
    require_binary("runuser")
    script = "\n".join([
        "useradd --system --home-dir /var/lib/cache-config-exporter --shell /usr/sbin/nologin cache-config-exporter",
        "(umask 077 && mkdir -p /etc/cache-config-exporter)",
        block("systemd", 2, "install -d"),
        "stat -c '%a %U %G %n' /etc/cache-config-exporter /etc/cache-config-exporter/ingest.token",
        "runuser -u cache-config-exporter -- wc -c /etc/cache-config-exporter/ingest.token",
        "cat /etc/default/cache-config-exporter",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert "750 root cache-config-exporter /etc/cache-config-exporter\n" in output
    assert "640 root cache-config-exporter /etc/cache-config-exporter/ingest.token\n" in output
    assert "65 /etc/cache-config-exporter/ingest.token\n" in output  # 64 hex digits and a newline
    assert "CACHE_CONFIG_EXPORTER_WEB_INGEST_TOKEN_FILE=/etc/cache-config-exporter/ingest.token" in output


@pytest.fixture
def docker(tmp_path: Path) -> Iterator[str]:
    """The docker client, with a daemon: the running one, or a dockerd started here (bridge networking for
    compose's network and -p; no firewall rules) and stopped afterwards."""
    docker = require_binary("docker")

    def answers() -> bool:
        return subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False).returncode == 0

    if answers():
        yield docker
        return
    log = (tmp_path / "dockerd.log").open("wb")
    daemon = subprocess.Popen(
        [require_binary("dockerd"), "--iptables=false", "--ip6tables=false"], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_until(lambda: answers() or daemon.poll() is not None, timeout=60, interval=0.5)
        assert daemon.poll() is None, (tmp_path / "dockerd.log").read_text()
        yield docker
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()


@pytest.mark.slow
def test_the_offline_docker_route_and_compose_as_written(
    tmp_path: Path, docker: str, record_property: Callable[[str, object], None]
) -> None:
    """Base image, wheelhouse, offline build, run, push, the production run with a token, and compose."""
    tokens = Path("/etc/cache-config-exporter")
    if tokens.exists():
        pytest.fail(f"{tokens} exists: this test writes it as the README does and removes it after")
    require_binary("docker-compose")
    work = clone(tmp_path / "clone")
    # Names of this run's own: a container, volume or image of the README's names may be the user's.
    names = f"cce-readme-{uuid.uuid4().hex[:12]}"
    port = free_port()
    project = names
    override = tmp_path / "compose-images.yaml"
    image = {"image": f"{names}-compose"}
    override.write_text(yaml.safe_dump({"services": {"exporter": image, "push-hybrid-fixture": image}}))
    compose = f"docker-compose -f docker/compose.yaml -f {override}"
    status = f"docker inspect -f '{{{{.State.Health.Status}}}}' {names}"
    healthy = (
        f'for _ in $(seq 150); do [ "$({status})" = healthy ] && break; sleep 0.2; done; echo "healthy: $SECONDS s"'
    )
    ingest = (
        "curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json'"
        " --data-binary @tests/fixtures/vllm-ready/hybrid-tp1-post50809.json"
        f" http://127.0.0.1:{port}/api/v1/deployments/qwen/ready"
    )
    token = '-H "Authorization: Bearer $(cat /etc/cache-config-exporter/ingest.token)"'

    script = "\n".join([
        "set -euo pipefail",
        own_names(block("Running with Docker", 4, "docker build --network none"), names, port),
        "SECONDS=0",
        own_names(block("Running with Docker", 1, "docker volume create"), names, port),
        healthy,
        own_names(block("Running with Docker", 2, "push /dev/stdin"), names, port),
        "SECONDS=0",
        own_names(block("Running with Docker", 3, "chown 10987:10987"), names, port),
        healthy,
        f'echo "unauthenticated: $({ingest})"',
        f'echo "with the token: $({ingest} {token})"',
        f"curl -s http://127.0.0.1:{port}/metrics | grep '^cache_config_block_size'",
        f"docker rm -f {names}",
        block("Docker Compose", 1, "PIP_OPTIONS=").replace("docker-compose -f docker/compose.yaml", compose),
        f"docker wait {project}_push-hybrid-fixture_1",
        f"{compose} logs push-hybrid-fixture",
    ])  # fmt: skip
    environment = {**os.environ, "COMPOSE_PROJECT_NAME": project}
    try:
        done = subprocess.run(
            ["bash", "-c", script], cwd=work, env=environment, capture_output=True, text=True, timeout=600, check=False
        )
    finally:
        subprocess.run([docker, "rm", "-f", names], capture_output=True, check=False)
        subprocess.run(
            ["docker-compose", "-f", "docker/compose.yaml", "-f", str(override), "down", "--volumes"],
            cwd=work, env=environment, capture_output=True, check=False, timeout=120,
        )  # fmt: skip
        subprocess.run([docker, "volume", "rm", "-f", names], capture_output=True, check=False)
        subprocess.run([docker, "rmi", names, f"{names}:0.1.0", f"{names}-compose"], capture_output=True, check=False)
        shutil.rmtree(tokens, ignore_errors=True)
    assert done.returncode == 0, f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert "unauthenticated: 401" in done.stdout
    assert "with the token: 200" in done.stdout, "uid 10987 read the chown-ed token file"
    health_times = [int(seconds) for seconds in re.findall(r"^healthy: (\d+) s$", done.stdout, flags=re.MULTILINE)]
    assert len(health_times) == 2 and max(health_times) <= 15, f"new containers healthy after {health_times} s"
    record(record_property, "docker_healthy_after_start", seconds=health_times)
    kept = 'cache_config_block_size{deployment="qwen",replica="default",engine="0"} 1056.0'
    assert kept in done.stdout, "the volume kept the push"
    assert "deployment qwen3-hybrid: 1 engine(s), block_size=1056" in done.stdout
