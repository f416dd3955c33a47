#!/usr/bin/env bash
# Wheels for a GPU machine with no network whose Python lacks Dask (the Dask GPU tests and
# scripts/examples/dask_chain.py need dask and distributed): downloads them and the pure-Python
# dependencies such an image usually lacks into DIR (default .whl) for Python 3.12 on x86-64.
# There: python3 -m pip install --no-index --no-deps DIR/*.whl   (or --target and PYTHONPATH).
# Usage: scripts/device_wheels.sh [DIR]
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" \
  dask distributed partd locket tblib tornado zict importlib_metadata
ls -l "$DIR"
