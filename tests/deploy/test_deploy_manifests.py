"""deploy/: Kubernetes manifests checked offline against the Kubernetes schemas and against each other,
their settings run by a real exporter, and the systemd unit checked by systemd-analyze."""

from __future__ import annotations

import functools
import ipaddress
import json
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
from exporter.flags.option import ENV_PREFIX
from tests.helpers.http import request
from tests.helpers.prometheus import RULES, promtool
from tests.probe.test_probe import pod_discovery_as_files, promtool_discovers_kubernetes, readme_configs
from tests.support import ExporterProcess, require_binary

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT_PAGE = (REPO / "docs" / "deployment.md").read_text()
METRICS_PAGE = (REPO / "docs" / "metrics.md").read_text()
KUBERNETES = REPO / "deploy" / "kubernetes"
EXPORTER = KUBERNETES / "exporter"
OPERATOR = KUBERNETES / "prometheus-operator"
VLLM_EXAMPLE = KUBERNETES / "examples" / "vllm.yaml"
PROBE = KUBERNETES / "probe"
# Every folder of manifests, and every kustomization an operator applies (each without and with the Operator's).
FOLDERS = [EXPORTER, OPERATOR, PROBE / "exporter", PROBE / "prometheus-operator"]
BUILDS = {
    KUBERNETES: ["NetworkPolicy", "Service", "StatefulSet"],
    KUBERNETES / "with-prometheus-operator": ["NetworkPolicy", "PrometheusRule", "Service", "ServiceMonitor",
                                             "StatefulSet"],
    PROBE: ["Deployment", "NetworkPolicy", "Service"],
    PROBE / "with-prometheus-operator": ["Deployment", "NetworkPolicy", "Service", "ServiceMonitor"],
}  # fmt: skip
# The one namespace of the exporters and of the vLLM servers (Prometheus runs in monitoring).
NAMESPACE = "vllm"
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


def vllm_example() -> dict[str, dict[str, Any]]:
    """deploy/kubernetes/examples/vllm.yaml by kind: the vLLM Deployment and its Service."""
    return {document["kind"]: document for document in yaml.safe_load_all(VLLM_EXAMPLE.read_text())}


@functools.cache
def kustomize(folder: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize FOLDER``: what ``kubectl apply -k`` would apply."""
    built = subprocess.run(
        [require_binary("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60, check=False
    )
    assert built.returncode == 0, built.stderr
    return list(yaml.safe_load_all(built.stdout))


def rendered(folder: Path) -> dict[str, dict[str, Any]]:
    """What ``kubectl apply -k FOLDER`` would apply, by kind."""
    return {document["kind"]: document for document in kustomize(folder)}


def service_address(service: dict[str, Any]) -> str:
    """Where a Service is reached from other namespaces: NAME.NAMESPACE.svc:PORT."""
    (port,) = service["spec"]["ports"]
    return f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port['port']}"


def operator_spelling(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus relabelling rule as the Prometheus Operator spells it: ``source_labels`` is ``sourceLabels``."""
    return {re.sub(r"_(\w)", lambda letter: letter.group(1).upper(), key): value for key, value in rule.items()}


def readme_secret() -> tuple[str, str]:
    """The name and key of the Secret the ``kubectl create secret`` of docs/deployment.md makes."""
    (command,) = re.findall(r"^kubectl create secret generic (\S+) .*--from-literal=(\w+)=", DEPLOYMENT_PAGE, re.M)
    return command


def serve_variables() -> set[str]:
    """The environment variables ``serve`` reads: one per flag, named after the flag's destination."""
    return {ENV_PREFIX + dest.upper() for dest in vars(build_parser().parse_args(["serve"])) if dest != "command"}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda folder: str(folder.relative_to(KUBERNETES)))
def test_each_kustomization_lists_every_manifest_of_its_folder(folder: Path) -> None:
    on_disk = {path.name for path in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(listed(folder)) == sorted(on_disk)


@pytest.mark.parametrize("folder", list(BUILDS), ids=lambda folder: str(folder.relative_to(REPO)))
def test_kustomize_builds_each_exporter_into_one_namespace_without_and_with_the_operator_component(
    folder: Path,
) -> None:
    """Without the Operator's CRDs nothing of theirs is applied; with them, they carry the release label."""
    built = kustomize(folder)
    assert sorted(document["kind"] for document in built) == BUILDS[folder]
    for document in built:
        assert document["metadata"]["namespace"] == NAMESPACE
        labels = document["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "cache-config-exporter"
        # kube-prometheus-stack's serviceMonitorSelector and ruleSelector match release: <Helm release>.
        assert ("release" in labels) is (document["kind"] in OPERATOR_KINDS)
    # No Secret: applying one would overwrite the live token; docs/deployment.md creates it with kubectl.
    assert not any(document["kind"] == "Secret" for document in built)


def test_the_docs_write_no_token_into_the_tracked_folder() -> None:
    assert not re.search(r">\s*deploy/", DEPLOYMENT_PAGE)


def kubernetes_resources() -> list[tuple[str, dict[str, Any]]]:
    """Every resource of Kubernetes' own kinds that the kustomizations apply, and the vLLM example's."""
    applied = [
        (f"{folder.relative_to(KUBERNETES)} {document['kind']}", document)
        for folder in (KUBERNETES / "with-prometheus-operator", PROBE)
        for document in kustomize(folder)
        if document["kind"] not in OPERATOR_KINDS
    ]
    return [*applied, *((f"examples {kind}", document) for kind, document in vllm_example().items())]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_manifests_are_valid_kubernetes_resources(version: str) -> None:
    # Strict: a misspelt or misplaced field is an error, not silently ignored as kubectl would.
    resources = kubernetes_resources()
    assert len(resources) == 8
    for name, document in resources:
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {error}")


@pytest.mark.parametrize("folder", [KUBERNETES, PROBE], ids=lambda folder: str(folder.relative_to(REPO)))
def test_the_operator_resources_are_not_in_the_kubernetes_schemas(folder: Path) -> None:
    """They are CRDs of the Prometheus Operator: checked by the tests below instead of by schema."""
    for document in kustomize(folder / "with-prometheus-operator"):
        if document["kind"] in OPERATOR_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(document, KUBERNETES_VERSIONS[-1], strict=True)


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
    deployment = vllm_example()["Deployment"]
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
    # The exporter's Service, its port, in its namespace, the vLLM servers' too; the Secret and key
    # docs/deployment.md creates.
    service = rendered(KUBERNETES)["Service"]
    assert environment["CACHE_CONFIG_EXPORTER_URL"]["value"] == f"http://{service_address(service)}"
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"]
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
    tests/probe/test_stock_vllm.py): instance becomes the vLLM server, the exporter's address stays in exporter."""
    section = METRICS_PAGE.split("\n## Joining vLLM's own series\n", 1)[1].split("\n## ", 1)[0]
    (config,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (job,) = [job for job in yaml.safe_load(config)["scrape_configs"] if job["job_name"] == "cache-config-exporter"]
    (endpoint,) = manifests()["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["metricRelabelings"] == [operator_spelling(rule) for rule in job["metric_relabel_configs"]]


# The probe-only exporter of deploy/kubernetes/probe ---------------------------------------------------------------


def test_the_probe_only_exporter_keeps_nothing_and_runs_with_the_fewest_privileges() -> None:
    pod = rendered(PROBE)["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    assert set(environment) <= serve_variables()
    assert environment["CACHE_CONFIG_EXPORTER_PROBE_ONLY"] == "true"
    # The pod network's placeholder: a CIDR, as the docs say to replace it.
    assert ipaddress.ip_network(environment["CACHE_CONFIG_EXPORTER_PROBE_ALLOWED_TARGETS"]).num_addresses > 1
    # Nothing to keep, nothing to mount: no volume, no token, no service account token.
    assert "volumes" not in pod and "volumeMounts" not in container
    assert not {name for name in environment if "TOKEN" in name}
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10987
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}
    }  # fmt: skip
    (pushing,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == pushing["image"]


def test_the_probe_resources_select_each_other_and_never_the_pushing_exporters() -> None:
    """Both exporters can run in the one namespace: neither's Service or NetworkPolicy selects the other's pods."""
    probe, pushing = rendered(PROBE), rendered(KUBERNETES)
    probe_pod = probe["Deployment"]["spec"]["template"]["metadata"]["labels"]
    pushing_pod = pushing["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    (container,) = probe["Deployment"]["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    (service_port,) = probe["Service"]["spec"]["ports"]
    assert ports[service_port["targetPort"]] == service_port["port"]
    for resources, own, other in ((probe, probe_pod, pushing_pod), (pushing, pushing_pod, probe_pod)):
        workload = resources.get("Deployment") or resources["StatefulSet"]
        selectors = [workload["spec"]["selector"]["matchLabels"], resources["Service"]["spec"]["selector"],
                     resources["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"]]  # fmt: skip
        assert all(selector.items() <= own.items() and not selector.items() <= other.items() for selector in selectors)
    assert probe["Service"]["metadata"]["name"] != pushing["Service"]["metadata"]["name"]
    # Only Prometheus is let in, as it is to the pushing exporter; the vLLM pods have nothing to send.
    sources = [source for rule in probe["NetworkPolicy"]["spec"]["ingress"] for source in rule["from"]]
    (prometheus,) = [source for rule in pushing["NetworkPolicy"]["spec"]["ingress"] for source in rule["from"]
                     if "namespaceSelector" in source]  # fmt: skip
    assert sources == [prometheus]


def multi_target_rules(rules: list[dict[str, Any]], target: str) -> list[dict[str, Any]]:
    """The rules that make the target the ``target`` parameter and the instance, and the exporter the address."""
    return [rule for rule in rules if rule.get(target) in ("__param_target", "instance", "__address__")]


def test_the_probe_service_monitor_probes_vllms_service_through_the_probe_exporter() -> None:
    """The Operator's spelling of docs/probe.md's Kubernetes job, over the vLLM example's Service."""
    built = rendered(PROBE / "with-prometheus-operator")
    monitor = built["ServiceMonitor"]["spec"]
    vllm = vllm_example()["Service"]
    assert vllm["metadata"]["namespace"] == built["ServiceMonitor"]["metadata"]["namespace"]
    assert monitor["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["path"] == "/probe"
    assert endpoint["port"] in {port["name"] for port in vllm["spec"]["ports"]}
    (job,) = readme_configs()["vllm-cache-config-pods"]["scrape_configs"]
    spelled = [operator_spelling(rule) for rule in multi_target_rules(job["relabel_configs"], "target_label")]
    assert multi_target_rules(endpoint["relabelings"], "targetLabel") == spelled
    assert endpoint["relabelings"][-1] == {
        "targetLabel": "__address__",
        "replacement": service_address(built["Service"]),
    }


def test_the_docs_kubernetes_scrape_configurations_probe_through_it_and_pass_promtool(tmp_path: Path) -> None:
    """docs/probe.md's Kubernetes jobs name the probe-only exporter's Service as deploy/kubernetes/probe makes it;
    with a promtool built without Kubernetes discovery, checked with the discovery swapped for file_sd."""
    address = service_address(rendered(PROBE)["Service"])
    as_written = promtool_discovers_kubernetes(tmp_path)
    for name in ("vllm-cache-config-pods", "vllm-cache-config-sharded"):
        config = readme_configs()[name]
        (job,) = config["scrape_configs"]
        assert job["relabel_configs"][-1] == {"target_label": "__address__", "replacement": address}, name
        path = tmp_path / f"{name}.yml"
        path.write_text(json.dumps(config if as_written else pod_discovery_as_files(config, tmp_path / "pods.json")))
        checked = promtool("check", "config", str(path))
        assert checked.returncode == 0, f"{name}:\n{checked.stdout}{checked.stderr}"


def test_the_probe_deployment_settings_start_an_exporter_that_answers_its_probes(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    """The container's environment, its address moved onto a free port: no token, no store."""
    (container,) = rendered(PROBE)["Deployment"]["spec"]["template"]["spec"]["containers"]
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    environment.pop("CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS")  # start_exporter picks a free port on 0.0.0.0
    exporter = start_exporter(env={**os.environ, **environment}, host="0.0.0.0")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert request(exporter.url, "GET", container[probe]["httpGet"]["path"], timeout=5).status == 200
    request(exporter.url, "POST", "/api/v1/ready", b"\x80").problem(404)
    assert not exporter.storage.exists()
