#!/usr/bin/env bash
# Idempotent machine setup: installs every Debian and PyPI package the build
# and tests need. Safe to run on every `make`; does nothing when all is present.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  bazel-bootstrap build-essential
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  nlohmann-json3-dev libcpp-httplib-dev clang-14 libclang-rt-14-dev libgoogle-perftools-dev
  prometheus  # the metrics test scrapes a real mesh with it
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python tools for tests and the Python client, pinned: install when any
# pinned version is missing or different. SHARDGEMM_SETUP_PYTHON=0 skips this
# (the image build needs only the Debian packages).
if [[ ${SHARDGEMM_SETUP_PYTHON:-1} != 0 ]] && ! python3 - tools/requirements.txt <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, want = line.split("==")
        if version(name) != want:
            sys.exit(1)
PY
then
  echo "setup: installing Python requirements"
  python3 -m pip install -q --disable-pip-version-check -r tools/requirements.txt
fi
