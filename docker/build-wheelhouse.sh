#!/usr/bin/env bash
# Fills wheelhouse/ (at the repository root, inside the image's build context) with every wheel the
# image needs, for an offline build: the project's dependencies and its build system (setuptools),
# for the image's Python and CPU, whatever Python this machine has. Needs a package index (PyPI or a
# mirror pip is configured for) here, not inside the build.
#
#   docker/build-wheelhouse.sh [PYTHON_VERSION]     (default 3.11: python:3.11-slim and Debian bookworm)
#
# Then: docker build ... --build-arg PIP_OPTIONS="--no-index --find-links /src/wheelhouse" .
# Environment: PYTHON (default python3, 3.11 or newer: it reads pyproject.toml), WHEELHOUSE
# (default: wheelhouse/ at the repository root).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON_VERSION=${1:-3.11}
PYTHON=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-$REPO/wheelhouse}

requirements=$(mktemp "${TMPDIR:-/tmp}/cache-config-exporter-requirements.XXXXXX")
trap 'rm -f "$requirements"' EXIT
"$PYTHON" - "$REPO/pyproject.toml" >"$requirements" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)
print("\n".join(project["build-system"]["requires"] + project["project"]["dependencies"]))
PY

# Binary wheels that run on the image's glibc (bookworm: 2.36) and this machine's CPU: every
# manylinux tag from glibc 2.17 up to 2.36 (pip does not widen one --platform to the older ones).
platforms=()
for minor in $(seq 17 36); do
  platforms+=(--platform "manylinux_2_${minor}_$(uname -m)")
done
mkdir -p "$WHEELHOUSE"
"$PYTHON" -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
  --python-version "$PYTHON_VERSION" --implementation cp "${platforms[@]}" \
  --dest "$WHEELHOUSE" -r "$requirements"
printf 'build-wheelhouse: %s wheels for Python %s in %s\n' \
  "$(find "$WHEELHOUSE" -name '*.whl' | wc -l)" "$PYTHON_VERSION" "$WHEELHOUSE" >&2
