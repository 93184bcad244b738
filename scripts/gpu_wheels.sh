#!/usr/bin/env bash
# Fetch the wheels scripts/gpu_check.sh installs on a GPU host with no internet (run where PyPI is reachable):
#   scripts/gpu_wheels.sh [DIR]        # default gpu-wheels/ (git-ignored; carry it with the tree, ~7 MB)
# For the device image's Python (3.12, x86_64 manylinux); GPU_PYTHON_VERSION overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-wheels}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dir"
"$pip" download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON_VERSION:-3.12}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dir" -r scripts/gpu_requirements.txt
du -sh "$dir"
