"""The exporter's image carries the vLLM plugin alone in /opt/vllm-plugins, for stock vLLM images: copied out by a
Kubernetes init container (deploy/kubernetes/examples/vllm.yaml), or layered on with the Dockerfile of docs/vllm.md.

Built offline as docs/deployment.md's "Building offline" does, on the base image of docker/make-base-image.sh (skipped
where it was never made: tests/deploy/test_docker_image.py makes it); the layer recipe of docs/vllm.md is built on
that base in place of vLLM's image, which only adds the folder and PYTHONPATH to whatever image it names.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.docs.test_readme_commands import DOCS, clone, docker  # noqa: F401  (docker: a fixture)
from tests.helpers.progress import watched
from tests.support import IN_CI

BASE_IMAGE = "cache-config-exporter-base:bookworm"
LIST_PLUGINS = (
    "from importlib.metadata import entry_points; "
    "print(sorted(e.value for e in entry_points(group='vllm.general_plugins')))"
)


def run(command: list[str], cwd: Path | None = None, timeout: float = 600) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def built(config: pytest.Config, command: list[str], cwd: Path) -> None:
    """A build step, shown on the terminal as it goes."""
    done = watched(config, Path(command[0]).name, command, timeout=600, cwd=cwd)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_the_image_holds_the_plugin_for_stock_vllm_images(
    docker: str,  # noqa: F811
    pytestconfig: pytest.Config,
    tmp_path: Path,
) -> None:
    if subprocess.run([docker, "image", "inspect", BASE_IMAGE], capture_output=True, check=False).returncode:
        message = f"{BASE_IMAGE} was never made (docker/make-base-image.sh; tests/deploy/test_docker_image.py makes it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    work = clone(tmp_path / "clone")
    image = f"cce-plugin-test-{uuid.uuid4().hex[:12]}"
    layered = f"{image}-vllm"
    try:
        built(pytestconfig, ["docker/build-wheelhouse.sh"], work)
        # The classic builder keeps the builder stage as an untagged image: labelled with this build's ID, it is
        # removed below (and only it: builds of others running beside this one keep theirs).
        arguments = {
            "BASE_IMAGE": BASE_IMAGE,
            "BUILD_ID": image,
            "PIP_OPTIONS": "--no-index --find-links /src/wheelhouse",
        }
        build_arguments = [part for name, value in arguments.items() for part in ("--build-arg", f"{name}={value}")]
        built(
            pytestconfig,
            [docker, "build", "--network", "none", "-f", "docker/Dockerfile", "-t", image, *build_arguments, "."],
            work,
        )
        # The folder holds the plugin's packages and metadata, nothing else (no dependencies, no scripts).
        listed = run([docker, "run", "--rm", "--entrypoint", "ls", image, "/opt/vllm-plugins"]).split()
        assert sorted(listed) == ["cache_config_exporter-0.1.0.dist-info", "exporter", "protocol"]

        # The init container of the Kubernetes example: its command, as the image's user, read-only root.
        documents = yaml.safe_load_all((work / "deploy" / "kubernetes" / "examples" / "vllm.yaml").read_text())
        (example,) = [document for document in documents if document and document.get("kind") != "Service"]
        (init,) = example["spec"]["template"]["spec"]["initContainers"]
        shared = init["volumeMounts"][0]["mountPath"]
        copied = run([docker, "run", "--rm", "--read-only", "--tmpfs", f"{shared}:uid=10987,gid=10987",
                      "--entrypoint", "sh", image, "-c", f"{' '.join(init['command'])} && ls {shared}"])  # fmt: skip
        assert sorted(copied.split()) == sorted(listed)

        # The layer of docs/vllm.md on a stock image: any python3 there finds the plugin by its entry point.
        (recipe,) = re.findall(r"^```dockerfile\n(.*?)^```$", DOCS, flags=re.DOTALL | re.MULTILINE)
        stock = re.search(r"^FROM (\S+)$", recipe, re.M)
        assert stock is not None and stock.group(1).startswith("vllm/vllm-openai:")
        dockerfile = recipe.replace("cache-config-exporter:0.1.0", image).replace(stock.group(1), BASE_IMAGE)
        (tmp_path / "layer").mkdir()
        (tmp_path / "layer" / "Dockerfile").write_text(dockerfile)
        built(pytestconfig, [docker, "build", "--network", "none", "-t", layered, "."], tmp_path / "layer")
        found = run([docker, "run", "--rm", layered, "python3", "-c", LIST_PLUGINS])
        assert found.strip() == "['exporter.vllm_plugin:register']"
    finally:
        subprocess.run([docker, "rmi", "-f", layered, image], capture_output=True, check=False, env=os.environ)
        ours = f"label=org.cache-config-exporter.build-id={image}"
        subprocess.run([docker, "image", "prune", "--force", "--filter", ours], capture_output=True, check=False)
    assert not run([docker, "image", "ls", "--quiet", "--filter", ours]).split(), "the build left an image behind"
