#!/usr/bin/env bash
# Builds an image from deploy/image/Dockerfile: `make image` (cpu) and
# `make image-cuda` (cuda). Sets up podman and makes the base image first when
# they are missing (both idempotent), then prints the image's size.
#   tools/image/build.sh cpu|cuda [more podman build flags, e.g. --no-cache]
# Environment: SHARDGEMM_IMAGE (tag; default localhost/shardgemm:VARIANT),
# SHARDGEMM_BASE_IMAGE (default localhost/shardgemm-base:bookworm), CUDA_HOME
# (the toolkit mounted into the cuda build; default /usr/local/cuda-13.0).
set -euo pipefail
cd "$(dirname "$0")/../.."
variant=${1:-cpu}
shift || true
case $variant in cpu | cuda) ;; *) echo "usage: $0 cpu|cuda [podman build flags]" >&2; exit 2 ;; esac
tag=${SHARDGEMM_IMAGE:-localhost/shardgemm:$variant}
if [[ $(id -u) -ne 0 ]]; then
  echo "image: run as root (rootful podman; make_base.sh runs debootstrap)" >&2
  exit 1
fi
base=${SHARDGEMM_BASE_IMAGE:-localhost/shardgemm-base:bookworm}

bash tools/image/setup_podman.sh
bash tools/image/make_base.sh "$base"

revision=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || revision+="-dirty"
args=(--format docker --ignorefile deploy/image/Dockerfile.dockerignore -f deploy/image/Dockerfile
  --target "$variant" -t "$tag" --build-arg BASE_IMAGE="$base"
  --label org.opencontainers.image.revision="$revision")
if [[ $variant == cuda ]]; then
  cuda=$(readlink -f "${CUDA_HOME:-/usr/local/cuda-13.0}")
  if [[ ! -x $cuda/bin/nvcc ]]; then
    echo "image: no CUDA toolkit at ${CUDA_HOME:-/usr/local/cuda-13.0} (set CUDA_HOME)" >&2
    exit 1
  fi
  name=$(basename "$cuda")
  args+=(--volume "$cuda:/usr/local/$name:ro" --build-arg CUDA_DIR="$name")
fi

echo "== podman build $tag (revision $revision)"
start=$SECONDS
podman build "${args[@]}" "$@" .
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "== $tag built in $((SECONDS - start)) s: $(awk -v b="$size" 'BEGIN {printf "%.0f MB", b / 1e6}')"
