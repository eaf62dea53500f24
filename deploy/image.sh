#!/usr/bin/env bash
# `make image`: build deploy/Dockerfile.$FLAVOR (cpu|cuda) as $IMAGE with docker (a daemon that answers) or podman.
# Where the public base cannot be pulled, a Debian bookworm base is built with debootstrap and imported as
# localhost/poolbench-base:bookworm (podman's store keeps it; the root filesystem is cached under build/containers).
# With podman, torch comes from a local wheel folder when one holds it (TORCH_WHEELS, default: pip's find-links),
# and the host's CA bundle is mounted for pip. Between builds, podman's layer store is the cache (the base, torch and
# the dependencies are layers of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
FLAVOR=${FLAVOR:-cpu}
IMAGE=${IMAGE:-poolbench/poolbench:$FLAVOR}
CACHE=${CONTAINER_CACHE:-build/containers}
LOCAL_BASE=localhost/poolbench-base:bookworm
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/containers.conf}

if [ -z "${ENGINE:-}" ]; then
    if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then ENGINE=docker
    elif command -v podman >/dev/null 2>&1; then ENGINE=podman
    else echo "make image: neither a docker daemon nor podman is here (apt-get install podman runc)" >&2; exit 1; fi
fi
if [ "$FLAVOR" = cuda ]; then DEFAULT_BASE=docker.io/nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
else DEFAULT_BASE=docker.io/library/python:3.11-slim-bookworm; fi
BASE_IMAGE=${BASE_IMAGE:-$DEFAULT_BASE}

has_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

local_base() {
    # A minimal Debian with python3 and its venv module: what the Dockerfile needs of a base, nothing pulled.
    if has_image "$LOCAL_BASE"; then return; fi
    command -v debootstrap >/dev/null 2>&1 || { echo "make image: debootstrap is needed for the local base" >&2; exit 1; }
    mkdir -p "$CACHE"
    if [ ! -f "$CACHE/rootfs/.complete" ]; then
        rm -rf "$CACHE/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,procps \
            bookworm "$CACHE/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/debootstrap.log"
        touch "$CACHE/rootfs/.complete"
    fi
    tar -C "$CACHE/rootfs" --exclude=./.complete -c . | "$ENGINE" import - "$LOCAL_BASE" >/dev/null
}

if ! has_image "$BASE_IMAGE" && ! timeout "${PULL_TIMEOUT:-60}" "$ENGINE" pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
    [ "$FLAVOR" = cpu ] || { echo "make image: the base $BASE_IMAGE cannot be pulled (the CUDA image needs it)" >&2; exit 1; }
    echo "make image: the base $BASE_IMAGE cannot be pulled here; building the local Debian base $LOCAL_BASE instead"
    local_base
    BASE_IMAGE=$LOCAL_BASE
fi

args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_SPEC=$TORCH_SPEC" -f "deploy/Dockerfile.$FLAVOR" -t "$IMAGE")
[ -n "${TORCH_INDEX_URL:-}" ] && args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
if [ "$ENGINE" = podman ]; then
    args+=(--network host)
    host_ca=/etc/ssl/certs/ca-certificates.crt
    [ -f "$host_ca" ] && args+=(-v "$host_ca:/etc/ssl/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/host-ca.crt)
    wheels=${TORCH_WHEELS:-$(pip config get global.find-links 2>/dev/null || true)}
    wheels=${wheels%% *}
    torch_name=${TORCH_SPEC%%[=<>]*}
    if [ -z "${TORCH_INDEX_URL:-}" ] && [ -n "$wheels" ] && compgen -G "$wheels/${torch_name}-*.whl" >/dev/null; then
        echo "make image: torch from the wheel folder $wheels"
        args+=(-v "$wheels:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
    fi
fi
echo "make image: $ENGINE build ${args[*]} ."
start=$(date +%s)
"$ENGINE" build "${args[@]}" .
size=$("$ENGINE" image inspect "$IMAGE" --format '{{.Size}}')
echo "make image: $IMAGE built in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB ($ENGINE, base $BASE_IMAGE)"
