#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, into .whl/ (ignored by git), for the device tool to carry: run here, where
# pip reaches PyPI. The image is Python 3.12 on x86-64 (/work/.library/device/KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "gguf>=0.10"
ls -l .whl
