#!/usr/bin/env bash
# `make images`: build the three images from the repository root where Docker runs; say why and exit 0 where
# it does not (no Docker here is not an error: `make test` needs none). TAG defaults to the project version.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG="${TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}"
PREFIX="${PREFIX:-diffstage}"
if ! command -v docker >/dev/null 2>&1; then
  echo "make images: skipped: docker is not installed (the images need Docker or a compatible CLI)"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  echo "make images: skipped: the Docker daemon is not reachable ('docker info' failed)"
  exit 0
fi
for image in runtime runtime-cuda operator; do
  if [ "$image" = runtime-cuda ] && [ "${SKIP_CUDA:-0}" = 1 ]; then
    echo "make images: $PREFIX/runtime-cuda skipped (SKIP_CUDA=1)"
    continue
  fi
  echo "make images: building $PREFIX/$image:$TAG"
  docker build -f "images/$image/Dockerfile" -t "$PREFIX/$image:$TAG" .
done
