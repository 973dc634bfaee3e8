#!/usr/bin/env bash
# Builds the image, runs it, pushes a fixture, scrapes it, restarts and
# re-creates the container, and checks that the state survived on the volume.
#
# Works without Docker Hub: when BASE_IMAGE is neither present nor pullable,
# docker/make-base-image.sh makes a Debian bookworm base with debootstrap (kept,
# so later runs reuse it). docker/build-wheelhouse.sh fetches every wheel on the
# host, and the image is built with --network none and pip --no-index. Starts
# dockerd when no daemon answers, and stops it again.
#
# Every container, volume and image it makes has a name of this run's own
# (cache-config-exporter-test-RUN), and it removes only what it made: run next to
# an exporter started from the README, it never touches that one or its volume.
#
# Exit codes: 0 passed; 77 skipped, no Docker daemon can be started here;
# anything else failed (the message says what).
#
# Environment: BASE_IMAGE (default python:3.11-slim), IMAGE (default: a tag of
# this run, removed afterwards; a given IMAGE is built and kept), PYTHON
# (interpreter used to fetch wheels and to scrape; default python3),
# DEBIAN_MIRROR (see docker/make-base-image.sh), DOCKER_WAIT (seconds, default 60).
set -euo pipefail

SKIP=77
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
RUN=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
OWN_IMAGE=""
if [[ -z ${IMAGE:-} ]]; then
  IMAGE="cache-config-exporter-test:$RUN"
  OWN_IMAGE=$IMAGE
fi
PYTHON=${PYTHON:-python3}
DOCKER_WAIT=${DOCKER_WAIT:-60}
FIXTURE="$REPO/tests/fixtures/vllm-ready/hybrid-tp1-post50809.msgpack"
DEPLOYMENT=docker-image-test
STARTED=$SECONDS

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cache-config-exporter-image.XXXXXX")
NAME="cache-config-exporter-test-$RUN"
VOLUME="cache-config-exporter-test-$RUN"
RUN_LABEL="org.cache-config-exporter.test-run=$RUN"
DOCKERD_PID=""
# What this run made, and only that, is removed at the end.
CONTAINERS=()
VOLUME_MADE=""

log() { printf 'test-image: %s\n' "$*" >&2; }

fail() {
  log "FAILED: $*"
  exit 1
}

cleanup() {
  local status=$?
  set +e
  for container in "${CONTAINERS[@]}"; do
    if [[ $status -ne 0 ]] && docker container inspect "$container" >/dev/null 2>&1; then
      log "logs of $container:"
      docker logs --tail 40 "$container" >&2
    fi
    docker rm --force --volumes "$container" >/dev/null 2>&1
  done
  if [[ -n $VOLUME_MADE ]]; then docker volume rm --force "$VOLUME" >/dev/null 2>&1; fi
  if [[ -n $OWN_IMAGE ]]; then docker rmi "$OWN_IMAGE" >/dev/null 2>&1; fi
  # The builder stage this run's build left behind (labelled with the run's BUILD_ID); anyone else's stay.
  docker image prune --force --filter "label=org.cache-config-exporter.build-id=$RUN" >/dev/null 2>&1
  if [[ -n $DOCKERD_PID ]]; then
    log "stopping the dockerd it started"
    kill "$DOCKERD_PID" 2>/dev/null
    wait_for "dockerd to stop" 30 exited "$DOCKERD_PID" || kill -9 "$DOCKERD_PID"
    wait "$DOCKERD_PID" 2>/dev/null
  fi
  # A failed debootstrap can leave proc or sys mounted in its rootfs: never delete through them.
  awk -v work="$WORK/" 'index($2, work) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
  rm -rf --one-file-system "$WORK"
  exit "$status"
}
trap cleanup EXIT

# wait_for WHAT SECONDS COMMAND...: polls COMMAND until it succeeds; fails after SECONDS.
wait_for() {
  local what=$1 deadline=$((SECONDS + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "gave up waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

# exited PID: the process is gone or a zombie (a child of this shell stays one until waited for).
exited() {
  [[ ! -e /proc/$1/stat ]] || [[ $(awk '{ print $3 }' "/proc/$1/stat") == Z ]]
}

skip() {
  log "SKIPPED: $*"
  exit "$SKIP"
}

ensure_docker() {
  command -v docker >/dev/null || skip "no docker client (Debian package docker.io)"
  docker info >/dev/null 2>&1 && return
  command -v dockerd >/dev/null || skip "no Docker daemon answers and there is no dockerd (Debian package docker.io)"
  [[ $(id -u) -eq 0 ]] || skip "no Docker daemon answers and only root can start dockerd"
  log "starting dockerd (log in $WORK/dockerd.log)"
  # Host networking only: no bridge and no firewall rules are needed for this test.
  dockerd --bridge=none --iptables=false --ip6tables=false >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  if ! wait_for "the Docker daemon" "$DOCKER_WAIT" docker info; then
    tail -n 20 "$WORK/dockerd.log" >&2
    kill -0 "$DOCKERD_PID" 2>/dev/null || DOCKERD_PID=""
    skip "no Docker daemon could be started within ${DOCKER_WAIT}s"
  fi
}

# Sets BASE_IMAGE to the bookworm base of docker/make-base-image.sh (made once, then reused).
debootstrapped_base() {
  BASE_IMAGE=cache-config-exporter-base:bookworm
  "$REPO/docker/make-base-image.sh" "$BASE_IMAGE" || fail "docker/make-base-image.sh failed"
}

ensure_base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  log "$BASE_IMAGE is not present; trying to pull it"
  if timeout 300 docker pull --quiet "$BASE_IMAGE" >"$WORK/pull.log" 2>&1; then
    return
  fi
  log "cannot pull $BASE_IMAGE: $(tail -n 1 "$WORK/pull.log")"
  debootstrapped_base
}

# The wheelhouse of docker/build-wheelhouse.sh, for the image's Python, in a copy of the build context.
build_wheelhouse() {
  local image_python
  image_python=$(docker run --rm --network none --entrypoint python3 "$BASE_IMAGE" \
    -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  mkdir -p "$WORK/context/docker"
  cp -R "$REPO/pyproject.toml" "$REPO/protocol" "$REPO/exporter" "$REPO/.dockerignore" "$WORK/context/"
  for optional in README.md LICENSE; do
    if [[ -f $REPO/$optional ]]; then cp "$REPO/$optional" "$WORK/context/"; fi
  done
  cp "$REPO/docker/healthcheck.py" "$WORK/context/docker/"
  log "building the wheelhouse for Python $image_python"
  if ! WHEELHOUSE="$WORK/context/wheelhouse" PYTHON="$PYTHON" "$REPO/docker/build-wheelhouse.sh" "$image_python" \
    >"$WORK/wheels.log" 2>&1; then
    tail -n 20 "$WORK/wheels.log" >&2
    fail "docker/build-wheelhouse.sh failed"
  fi
}

build_image() {
  log "building $IMAGE on $BASE_IMAGE (log in $WORK/build.log)"
  if ! DOCKER_BUILDKIT=0 docker build --network none --file "$REPO/docker/Dockerfile" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "BUILD_ID=$RUN" \
    --build-arg "PIP_OPTIONS=--no-index --find-links /src/wheelhouse" \
    --tag "$IMAGE" "$WORK/context" >"$WORK/build.log" 2>&1; then
    tail -n 30 "$WORK/build.log" >&2
    fail "docker build failed"
  fi
}

# expect_config GO-TEMPLATE EXPECTED: one field of the image's configuration.
expect_config() {
  local actual
  actual=$(docker image inspect --format "$1" "$IMAGE")
  [[ $actual == "$2" ]] || fail "image $1 is '$actual', expected '$2'"
}

check_image_config() {
  expect_config '{{.Config.User}}' 10987:10987
  expect_config '{{json .Config.ExposedPorts}}' '{"10987/tcp":{}}'
  expect_config '{{json .Config.Volumes}}' '{"/var/lib/cache-config-exporter":{}}'
  expect_config '{{join .Config.Entrypoint " "}}' cache-config-exporter
  docker image inspect --format '{{json .Config.Env}}' "$IMAGE" |
    grep -q '"CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS=0.0.0.0:10987"' ||
    fail "the image does not listen on 0.0.0.0:10987 by default"
  docker image inspect --format '{{json .Config.Healthcheck.Test}}' "$IMAGE" | grep -q healthcheck.py ||
    fail "the image has no HEALTHCHECK"
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Prints the body of a GET of argv[1]; runs on the host and inside the image.
FETCH_PY='
import sys
import urllib.request

opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
with opener.open(sys.argv[1], timeout=5) as response:
    sys.stdout.write(response.read().decode())
'

# scrape [CONTAINER]: /metrics into $WORK/scrape.txt, from the host on $PORT, or inside CONTAINER on 10987.
scrape() {
  if [[ $# -eq 0 ]]; then
    "$PYTHON" -c "$FETCH_PY" "http://127.0.0.1:$PORT/metrics" >"$WORK/scrape.txt" ||
      fail "cannot scrape http://127.0.0.1:$PORT/metrics"
  else
    docker exec "$1" python3 -c "$FETCH_PY" http://127.0.0.1:10987/metrics >"$WORK/scrape.txt" ||
      fail "cannot scrape /metrics inside $1"
  fi
}

healthy() {
  [[ $(docker inspect --format '{{.State.Health.Status}}' "$1") == healthy ]]
}

# start_container NAME ARGS...: runs the image with docker run ARGS and waits for its HEALTHCHECK.
start_container() {
  local name=$1
  shift
  # Counted as this run's only once created: a name taken by someone else's container fails here instead.
  docker run --detach --name "$name" --label "$RUN_LABEL" --health-interval 1s --health-start-period 30s \
    "$@" "$IMAGE" >/dev/null || fail "cannot create container $name"
  CONTAINERS+=("$name")
  wait_for "$name to be healthy" 60 healthy "$name" ||
    fail "$name never became healthy (its HEALTHCHECK against /-/healthy)"
}

# start_on_volume NAME: the image on the test volume, on the host network but listening on $PORT of loopback only.
start_on_volume() {
  start_container "$1" --network host --env "CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS=127.0.0.1:$PORT" \
    --volume "$VOLUME:/var/lib/cache-config-exporter"
}

# expect_metric LINE: the last scrape has exactly this sample line.
expect_metric() {
  grep -qxF "$1" "$WORK/scrape.txt" || fail "the scrape lacks: $1"
}

# expect_hybrid_state WHEN DEPLOYMENT: the last scrape shows the hybrid fixture's true block sizes,
# in the info metric and in the gauges.
expect_hybrid_state() {
  grep -E '^cache_config_info\{.*\} 1\.0$' "$WORK/scrape.txt" | grep -E "[{,]deployment=\"$2\"[,}]" |
    grep -E '[{,]block_size="1056"[,}]' | grep -qE '[{,]mamba_block_size="1056"[,}]' ||
    fail "$1: the scrape has no cache_config_info with block_size=\"1056\" mamba_block_size=\"1056\""
  expect_metric "cache_config_block_size{deployment=\"$2\",replica=\"default\",engine=\"0\"} 1056.0"
  expect_metric "cache_config_num_gpu_blocks{deployment=\"$2\",replica=\"default\",engine=\"0\"} 1997.0"
  log "$1: block_size=\"1056\" mamba_block_size=\"1056\" num_gpu_blocks 1997"
}

# The image as shipped: 0.0.0.0:10987 with unauthenticated ingest, in a network namespace of its own
# (--network none: nothing outside the container can reach it), pushed to and scraped from inside.
check_defaults() {
  local name="$NAME-defaults"
  start_container "$name" --network none
  docker exec --interactive "$name" cache-config-exporter push /dev/stdin --deployment defaults <"$FIXTURE" >&2 ||
    fail "push inside $name failed"
  scrape "$name"
  expect_hybrid_state "with the image's defaults" defaults
  docker rm --force --volumes "$name" >/dev/null
}

# Push, scrape, restart, re-create on the same volume: the state must survive on the volume.
check_volume() {
  PORT=$(free_port)
  # docker volume create succeeds on an existing volume: refuse one this run did not make.
  ! docker volume inspect "$VOLUME" >/dev/null 2>&1 || fail "volume $VOLUME exists already: not this run's"
  docker volume create --label "$RUN_LABEL" "$VOLUME" >/dev/null
  VOLUME_MADE=yes
  start_on_volume "$NAME"
  log "pushing $(basename "$FIXTURE") with the image's own push command"
  docker run --rm --interactive --network host "$IMAGE" push /dev/stdin \
    --url "http://127.0.0.1:$PORT" --deployment "$DEPLOYMENT" <"$FIXTURE" >&2 || fail "push failed"
  scrape
  expect_hybrid_state "after the push" "$DEPLOYMENT"
  expect_metric 'cache_config_exporter_ready_responses_accepted_total 1.0'

  local started code
  started=$(docker inspect --format '{{.State.StartedAt}}' "$NAME")
  docker restart --time 20 "$NAME" >/dev/null
  [[ $(docker inspect --format '{{.State.StartedAt}}' "$NAME") != "$started" ]] || fail "the container did not restart"
  wait_for "$NAME to be healthy again" 60 healthy "$NAME" || fail "$NAME never became healthy after the restart"
  scrape
  expect_hybrid_state "after docker restart" "$DEPLOYMENT"
  # Nothing was pushed to this process: the state came from the store.
  expect_metric 'cache_config_exporter_ready_responses_accepted_total 0.0'

  docker stop --time 20 "$NAME" >/dev/null
  code=$(docker inspect --format '{{.State.ExitCode}}' "$NAME")
  [[ $code == 0 ]] || fail "SIGTERM did not stop the exporter cleanly (exit code $code)"
  docker rm "$NAME" >/dev/null
  start_on_volume "$NAME-new"
  scrape
  expect_hybrid_state "in a new container on the same volume" "$DEPLOYMENT"
}

main() {
  [[ -f $FIXTURE ]] || fail "missing fixture $FIXTURE"
  ensure_docker
  ensure_base_image
  build_wheelhouse
  build_image
  check_image_config
  [[ $(docker run --rm --network none --entrypoint id "$IMAGE" -u) != 0 ]] || fail "the image runs as root"
  check_defaults
  check_volume
  log "PASSED in $((SECONDS - STARTED))s (image $IMAGE, base $BASE_IMAGE)"
}

main "$@"
