"""deploy/: Kubernetes manifests checked offline against the Kubernetes schemas and against each other,
their settings run by a real exporter, and the systemd unit checked by systemd-analyze."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.cli import build_parser
from exporter.settings import ENV_PREFIX
from tests.helpers.http import request
from tests.helpers.prometheus import RULES
from tests.support import ExporterProcess, require_binary

REPO = Path(__file__).resolve().parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
UNIT = REPO / "deploy" / "systemd" / "cache-config-exporter.service"
# The oldest Kubernetes release still commonly run, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def manifests() -> dict[str, dict[str, Any]]:
    """Every resource that kustomization.yaml applies, by kind."""
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    documents = [yaml.safe_load((KUBERNETES / name).read_text()) for name in listed]
    return {document["kind"]: document for document in documents}


def serve_variables() -> set[str]:
    """The environment variables ``serve`` reads: one per flag, named after the flag's destination."""
    return {ENV_PREFIX + dest.upper() for dest in vars(build_parser().parse_args(["serve"])) if dest != "command"}


def test_kustomization_applies_every_manifest_of_the_folder() -> None:
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    on_disk = {path.name for path in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(listed) == sorted(on_disk)
    assert set(manifests()) == {"Secret", "StatefulSet", "Service", "NetworkPolicy", *OPERATOR_KINDS}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kind", ["Secret", "StatefulSet", "Service", "NetworkPolicy"])
def test_the_manifests_are_valid_kubernetes_resources(kind: str, version: str) -> None:
    # Strict: a misspelt or misplaced field is an error, not silently ignored as kubectl would.
    kubernetes_validate.validate(manifests()[kind], version, strict=True)


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
    # The token the exporter reads is the key of the secret that the StatefulSet mounts.
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    (token_volume,) = [volume for volume in pod["spec"]["volumes"] if "secret" in volume]
    assert token_volume["secret"]["secretName"] == resources["Secret"]["metadata"]["name"]
    (mount,) = [mount for mount in container["volumeMounts"] if mount["name"] == token_volume["name"]]
    token_key = Path(environment["CACHE_CONFIG_EXPORTER_WEB_INGEST_TOKEN_FILE"]).relative_to(mount["mountPath"])
    assert str(token_key) in resources["Secret"]["stringData"]
    (claim,) = resources["StatefulSet"]["spec"]["volumeClaimTemplates"]
    (data,) = [mount for mount in container["volumeMounts"] if mount["name"] == claim["metadata"]["name"]]
    assert Path(environment["CACHE_CONFIG_EXPORTER_STORAGE_PATH"]).parent == Path(data["mountPath"])


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
