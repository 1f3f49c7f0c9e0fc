#!/usr/bin/env bash
# `make image`: build the CPU image (deploy/docker/Dockerfile) as $IMAGE (paddlequic:cpu).
# Needs a running Docker engine and BuildKit (the Dockerfile uses `RUN --mount`): Docker 23 or
# later with the buildx plugin, or an older docker CLI, where DOCKER_BUILDKIT=1 is enough. The
# build downloads Paddle and the other wheels from PyPI. When python:3.11-slim-bookworm cannot
# be pulled (no registry reachable), a stand-in is made from Debian's archive (base_image.sh:
# root and debootstrap). DOCKER_BUILD_FLAGS are passed on (for example --network host).
set -euo pipefail

docker=${DOCKER:-docker}
image=${IMAGE:-paddlequic:cpu}
base=python:3.11-slim-bookworm
standin=paddlequic-base:bookworm
here=$(dirname "$0")

fail() {
    echo "make image: $*" >&2
    exit 1
}

"$docker" info >/dev/null 2>&1 ||
    fail "no Docker engine answers ('$docker info' failed): start one (systemctl start docker, or dockerd &) or point DOCKER_HOST at one"
client=$("$docker" version --format '{{.Client.Version}}' 2>/dev/null || echo 0)
if [ "${client%%.*}" -ge 23 ] 2>/dev/null && ! "$docker" buildx version >/dev/null 2>&1; then
    fail "the Dockerfile needs BuildKit (RUN --mount) and docker $client builds with it only through the buildx plugin: install docker-buildx-plugin, or use a docker CLI before 23 (DOCKER=/usr/bin/docker make image)"
fi

if "$docker" image inspect "$base" >/dev/null 2>&1 || "$docker" pull -q "$base" >/dev/null 2>&1; then
    echo "==> base image $base"
else
    if ! "$docker" image inspect "$standin" >/dev/null 2>&1; then
        echo "==> $base cannot be pulled: making $standin from Debian's archive (debootstrap)"
        DOCKER=$docker "$here/base_image.sh" "$standin"
    fi
    echo "==> base image $standin (a stand-in for $base)"
    base=$standin
fi

echo "==> building $image"
# shellcheck disable=SC2086  # DOCKER_BUILD_FLAGS holds several words
DOCKER_BUILDKIT=1 nice -n 19 "$docker" build ${DOCKER_BUILD_FLAGS:-} --build-arg "BASE=$base" \
    -f "$here/Dockerfile" -t "$image" "$here/../.."
"$docker" image ls "$image"
