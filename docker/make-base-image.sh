#!/usr/bin/env bash
# Makes a Debian bookworm base image with python3 (and its venv module) without Docker Hub:
# debootstrap from this machine's Debian mirror, then `docker import`. For hosts where
# python:3.11-slim can be neither pulled nor loaded. Needs root and debootstrap.
#
#   docker/make-base-image.sh [TAG]     (default TAG: cache-config-exporter-base:bookworm)
#
# Then build with --build-arg BASE_IMAGE=TAG. An image of that tag that already exists is kept
# (delete it to make it again). Environment: DEBIAN_MIRROR (default: the mirror of this
# machine's apt sources, else deb.debian.org).
set -euo pipefail

TAG=${1:-cache-config-exporter-base:bookworm}
PACKAGES=python3,python3-venv,passwd,ca-certificates

log() { printf 'make-base-image: %s\n' "$*" >&2; }

if docker image inspect "$TAG" >/dev/null 2>&1; then
  log "$TAG exists already"
  exit 0
fi
command -v debootstrap >/dev/null || { log "debootstrap is missing (Debian package debootstrap)"; exit 1; }
[[ $(id -u) -eq 0 ]] || { log "debootstrap needs root"; exit 1; }

# The Debian mirror this machine's apt uses: the site of its bookworm sources, else of
# its first main suite (another Debian release's mirror serves bookworm too).
debian_mirror() {
  command -v apt-get >/dev/null || return 0
  # shellcheck disable=SC2016 # $(SITE) is apt's own field syntax, not the shell's
  apt-get indextargets --format '$(SITE) $(RELEASE)' 'Identifier: Packages' 2>/dev/null |
    awk '$2 == "bookworm" { print $1; found = 1; exit }
         $2 !~ /-/ && !first { first = $1 }
         END { if (!found && first) print first }'
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/cache-config-exporter-base.XXXXXX")
cleanup() {
  # A failed debootstrap can leave proc or sys mounted in its rootfs: never delete through them.
  awk -v work="$WORK/" 'index($2, work) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
  rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

mirror=${DEBIAN_MIRROR:-$(debian_mirror)}
mirror=${mirror:-http://deb.debian.org/debian}
proxy=""
eval "$(apt-config shell proxy Acquire::http::Proxy 2>/dev/null || true)"
log "debootstrapping bookworm from $mirror (a few minutes; log in $WORK/debootstrap.log)"
if ! http_proxy=${proxy:-${http_proxy:-}} debootstrap --variant=minbase --include="$PACKAGES" \
  bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1; then
  tail -n 20 "$WORK/debootstrap.log" >&2
  log "debootstrap failed"
  exit 1
fi
rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
tar -C "$WORK/rootfs" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
log "made $TAG"
