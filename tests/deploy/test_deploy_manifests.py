"""deploy/: Kubernetes manifests checked offline against the Kubernetes schemas and against each other,
their settings run by a real exporter, and the systemd unit checked by systemd-analyze."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.cli import build_parser
from exporter.config.option import ENV_PREFIX
from tests.helpers.http import request
from tests.helpers.prometheus import RULES
from tests.support import ExporterProcess, require_binary

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT_PAGE = (REPO / "docs" / "deployment.md").read_text()
METRICS_PAGE = (REPO / "docs" / "metrics.md").read_text()
KUBERNETES = REPO / "deploy" / "kubernetes"
EXPORTER = KUBERNETES / "exporter"
OPERATOR = KUBERNETES / "prometheus-operator"
VLLM_EXAMPLE = KUBERNETES / "examples" / "vllm.yaml"
UNIT = REPO / "deploy" / "systemd" / "cache-config-exporter.service"
# The oldest Kubernetes release still commonly run, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def listed(folder: Path) -> list[str]:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]


def manifests() -> dict[str, dict[str, Any]]:
    """Every resource of the exporter and of the Operator's component, by kind."""
    documents = [
        yaml.safe_load((folder / name).read_text()) for folder in (EXPORTER, OPERATOR) for name in listed(folder)
    ]
    return {document["kind"]: document for document in documents}


def kustomize(folder: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize FOLDER``: what ``kubectl apply -k`` would apply."""
    built = subprocess.run(
        [require_binary("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert built.returncode == 0, built.stderr
    return list(yaml.safe_load_all(built.stdout))


def readme_secret() -> tuple[str, str]:
    """The name and key of the Secret the ``kubectl create secret`` of docs/deployment.md makes."""
    (command,) = re.findall(r"^kubectl create secret generic (\S+) .*--from-literal=(\w+)=", DEPLOYMENT_PAGE, re.M)
    return command


def serve_variables() -> set[str]:
    """The environment variables ``serve`` reads: one per flag, named after the flag's destination."""
    return {ENV_PREFIX + dest.upper() for dest in vars(build_parser().parse_args(["serve"])) if dest != "command"}


@pytest.mark.parametrize("folder", [EXPORTER, OPERATOR], ids=lambda folder: folder.name)
def test_each_kustomization_lists_every_manifest_of_its_folder(folder: Path) -> None:
    on_disk = {path.name for path in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(listed(folder)) == sorted(on_disk)
    assert set(manifests()) == {"StatefulSet", "Service", "NetworkPolicy", *OPERATOR_KINDS}


def test_kustomize_builds_the_exporter_without_and_with_the_operator_component() -> None:
    """Without the Operator's CRDs nothing of theirs is applied; with them, both carry the release label."""
    plain = kustomize(KUBERNETES)
    assert sorted(document["kind"] for document in plain) == ["NetworkPolicy", "Service", "StatefulSet"]
    operator = kustomize(KUBERNETES / "with-prometheus-operator")
    assert sorted(document["kind"] for document in operator) == sorted(["NetworkPolicy", "Service", "StatefulSet",
                                                                         *OPERATOR_KINDS])  # fmt: skip
    for document in operator:
        labels = document["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "cache-config-exporter"
        # kube-prometheus-stack's serviceMonitorSelector and ruleSelector match release: <Helm release>.
        assert ("release" in labels) is (document["kind"] in OPERATOR_KINDS)
    # No Secret: applying one would overwrite the live token; docs/deployment.md creates it with kubectl.
    assert not any(document["kind"] == "Secret" for document in plain + operator)
    # ... and writes no token into the tracked folder.
    assert not re.search(r">\s*deploy/", DEPLOYMENT_PAGE)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kind", ["StatefulSet", "Service", "NetworkPolicy", "vLLM Deployment"])
def test_the_manifests_are_valid_kubernetes_resources(kind: str, version: str) -> None:
    # Strict: a misspelt or misplaced field is an error, not silently ignored as kubectl would.
    document = yaml.safe_load(VLLM_EXAMPLE.read_text()) if kind == "vLLM Deployment" else manifests()[kind]
    kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("kind", sorted(OPERATOR_KINDS))
def test_the_operator_resources_are_not_in_the_kubernetes_schemas(kind: str) -> None:
    """They are CRDs of the Prometheus Operator: checked by the tests below instead of by schema."""
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(manifests()[kind], KUBERNETES_VERSIONS[-1], strict=True)


def test_the_resources_select_each_other() -> None:
    resources = manifests()
    pod = resources["StatefulSet"]["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert resources["StatefulSet"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = resources["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ports and service_port["port"] == ports["http"] == 10987
    monitor = resources["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [endpoint["port"] for endpoint in monitor["endpoints"]] == [service_port["name"]]
    policy = resources["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert {port["port"] for rule in policy["ingress"] for port in rule["ports"]} == {ports["http"]}
    sources = [source["podSelector"]["matchLabels"] for rule in policy["ingress"] for source in rule["from"]]
    assert {"app.kubernetes.io/name": "vllm"} in sources
    # The token the exporter reads is the key of the secret that the StatefulSet mounts, as docs/deployment.md makes it.
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    assert token_path(pod["spec"], container, environment["CACHE_CONFIG_EXPORTER_WEB_INGEST_TOKEN_FILE"]) == (
        readme_secret()
    )
    (claim,) = resources["StatefulSet"]["spec"]["volumeClaimTemplates"]
    (data,) = [mount for mount in container["volumeMounts"] if mount["name"] == claim["metadata"]["name"]]
    assert Path(environment["CACHE_CONFIG_EXPORTER_STORAGE_PATH"]).parent == Path(data["mountPath"])


def token_path(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The Secret and key a token file path of ``container`` reads."""
    (volume,) = [volume for volume in pod["volumes"] if "secret" in volume]
    (mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == volume["name"]]
    return volume["secret"]["secretName"], str(Path(path).relative_to(mount["mountPath"]))


def test_the_image_is_the_tag_the_readme_builds() -> None:
    (container,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    name, tag = container["image"].split(":")
    assert (name, tag) == ("cache-config-exporter", version("cache-config-exporter"))
    builds = re.findall(r"^docker build .*$", DEPLOYMENT_PAGE, re.M)
    assert builds and all(f" -t {container['image']} " in build for build in builds)


def test_the_vllm_example_gets_the_plugin_token_and_replica_the_exporter_and_prometheus_expect() -> None:
    deployment = yaml.safe_load(VLLM_EXAMPLE.read_text())
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    (init,) = spec["initContainers"]
    (vllm,) = spec["containers"]
    resources = manifests()
    exporter_pod = resources["StatefulSet"]["spec"]["template"]["spec"]
    # The plugin folder: the exporter's image holds it (the Dockerfile fills it), copied into the shared volume.
    assert init["image"] == exporter_pod["containers"][0]["image"]
    assert "--target /opt/vllm-plugins" in (REPO / "docker" / "Dockerfile").read_text()
    source, destination = init["command"][-2:]
    assert source == "/opt/vllm-plugins/."
    (shared,) = [volume["name"] for volume in spec["volumes"] if "emptyDir" in volume]
    assert {mount["mountPath"].rstrip("/") for mount in init["volumeMounts"] if mount["name"] == shared} == {
        destination.rstrip("/")
    }
    environment = {variable["name"]: variable for variable in vllm["env"]}
    (plugins,) = [mount for mount in vllm["volumeMounts"] if mount["name"] == shared]
    assert environment["PYTHONPATH"]["value"] == plugins["mountPath"] and plugins["readOnly"]
    # Only variables the plugin reads, besides PYTHONPATH and the downward API's POD_IP.
    plugin_source = (REPO / "exporter" / "vllm_plugin" / "target.py").read_text()
    assert all(f'"{name}"' in plugin_source for name in environment if name.startswith(ENV_PREFIX))
    # The exporter's Service, its port; the Secret and key docs/deployment.md creates.
    service = resources["Service"]
    (port,) = service["spec"]["ports"]
    assert environment["CACHE_CONFIG_EXPORTER_URL"]["value"] == (
        f"http://{service['metadata']['name']}.vllm.svc:{port['port']}"
    )
    token = environment["CACHE_CONFIG_EXPORTER_TOKEN_FILE"]["value"]
    assert token_path(spec, vllm, token) == readme_secret()
    # The replica is POD_IP:<vLLM's port>: what Prometheus' pod discovery scrapes, the join's instance.
    assert environment["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    names = list(environment)
    assert names.index("POD_IP") < names.index("CACHE_CONFIG_EXPORTER_REPLICA")  # $(POD_IP) expands only then
    (http,) = vllm["ports"]
    assert environment["CACHE_CONFIG_EXPORTER_REPLICA"]["value"] == f"$(POD_IP):{http['containerPort']}"
    assert vllm["args"][vllm["args"].index("--port") + 1] == str(http["containerPort"])
    # The exporter's NetworkPolicy lets these pods in.
    sources = [source["podSelector"]["matchLabels"] for rule in resources["NetworkPolicy"]["spec"]["ingress"]
               for source in rule["from"]]  # fmt: skip
    assert any(selector.items() <= pod["metadata"]["labels"].items() for selector in sources)


def test_the_pod_runs_as_the_image_user_and_reads_only_known_settings() -> None:
    pod = manifests()["StatefulSet"]["spec"]["template"]["spec"]
    assert "USER 10987:10987" in (REPO / "docker" / "Dockerfile").read_text()
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == 10987
    (container,) = pod["containers"]
    assert {variable["name"] for variable in container["env"]} <= serve_variables()


def test_the_prometheus_rule_holds_the_tested_alerting_rules() -> None:
    """docker/rules' file is unit-tested with promtool; the PrometheusRule must say exactly the same."""
    assert manifests()["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    job = manifests()["Service"]["metadata"]["name"]  # the Operator's job label is the Service's name
    assert f'up{{job="{job}"}}' in RULES.read_text()


def test_the_statefulset_settings_start_an_exporter_that_answers_its_probes(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """The container's environment, with its paths moved into a temp dir and its address onto loopback."""
    (container,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    moved = {"CACHE_CONFIG_EXPORTER_WEB_INGEST_TOKEN_FILE": str(token)}
    environment = {variable["name"]: moved.get(variable["name"], variable["value"]) for variable in container["env"]}
    environment.pop("CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS")  # start_exporter picks a free port on 0.0.0.0
    environment.pop("CACHE_CONFIG_EXPORTER_STORAGE_PATH")  # and a temp storage file
    exporter = start_exporter(env={**os.environ, **environment}, host="0.0.0.0")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert request(exporter.url, "GET", container[probe]["httpGet"]["path"], timeout=5).status == 200


def unit_with_installed_command(tmp_path: Path) -> Path:
    """The unit, with ExecStart's command pointed at this test environment's (verify needs it to exist)."""
    command = Path(sys.executable).parent / "cache-config-exporter"
    assert command.exists(), "the project is installed in the test environment"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/cache-config-exporter/bin/cache-config-exporter", str(command)))
    return unit


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = require_binary("systemd-analyze")
    checked = subprocess.run(
        [analyze, "verify", str(unit_with_installed_command(tmp_path))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr


def test_the_unit_is_hardened(tmp_path: Path) -> None:
    analyze = require_binary("systemd-analyze")
    checked = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=20", str(unit_with_installed_command(tmp_path))],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    # 0 is fully locked down, 10 is no hardening at all; the unit's score, read in the output, stays under 2.
    assert checked.returncode == 0, checked.stdout + checked.stderr
    exposure = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", checked.stdout).group(1))  # type: ignore[union-attr]
    assert exposure < 2.0, checked.stdout


def test_the_unit_environment_starts_an_exporter(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """The unit's Environment= lines are settings the exporter accepts (storage moved to a temp file)."""
    lines = [
        line.removeprefix("Environment=") for line in UNIT.read_text().splitlines() if line.startswith("Environment=")
    ]
    environment = dict(line.split("=", 1) for line in lines)
    assert environment["CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS"].startswith("127.0.0.1:")
    assert set(environment) <= serve_variables()
    environment.pop("CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS")
    environment.pop("CACHE_CONFIG_EXPORTER_STORAGE_PATH")
    start_exporter(env={**os.environ, **environment})


def test_the_service_monitor_relabels_as_the_readme_join_says() -> None:
    """The Operator's spelling of the metric_relabel_configs of docs/metrics.md (run in a real Prometheus by
    tests/test_stock_vllm.py): instance becomes the vLLM server, the exporter's address stays in exporter."""
    section = METRICS_PAGE.split("\n## Joining vLLM's own series\n", 1)[1].split("\n## ", 1)[0]
    (config,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (job,) = [job for job in yaml.safe_load(config)["scrape_configs"] if job["job_name"] == "cache-config-exporter"]
    (endpoint,) = manifests()["ServiceMonitor"]["spec"]["endpoints"]
    spelled = [
        {"sourceLabels": rule["source_labels"], "regex": rule["regex"], "targetLabel": rule["target_label"]}
        for rule in job["metric_relabel_configs"]
    ]
    assert endpoint["metricRelabelings"] == spelled
