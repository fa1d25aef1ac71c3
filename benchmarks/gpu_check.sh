#!/usr/bin/env bash
# The GPU check in one command, on a GPU machine whose image has its own torch, Triton and transformers and no
# network (benchmarks/gpu_check.py says what it runs). Wheels the image lacks travel in .whl/ (make gpu-wheels
# fetches them where pip can reach PyPI); the project runs from this tree on PYTHONPATH, never pip-installed.
# The JSON and logs go to $OUT (the device tool's), else /tmp/tokenmill-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/tokenmill-gpu-check}"
py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tokenmill-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/tokenmill-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" benchmarks/gpu_check.py --out "$out" "$@"
