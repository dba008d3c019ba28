#!/usr/bin/env bash
# Everything that touches a GPU, beside torchrun, in one command of under 10 minutes (bench/gpu_suite.py
# says what each item measures). On a GPU machine that has torch but neither Ray nor Megatron, and no
# network, it first unpacks the bundle that ../shared/gpu/make-bundle.sh built into .gpu/. The dated
# section is appended to bench/RESULTS.md and written, with results.json and the logs, to --out
# (default $OUT, else /tmp/megaray-gpu-suite).
#   bench/gpu_suite.sh [--only parity,arch,restart,doctor,overhead] [--budget-s 570]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import ray, megatron.core" 2>/dev/null; then
  bundle=${MEGARAY_GPU_BUNDLE:-.gpu/site.tar.xz}
  if [ ! -f "$bundle" ]; then
    echo "gpu_suite: Ray or Megatron is missing here and there is no bundle at $bundle:" \
      "run ../shared/gpu/make-bundle.sh .gpu where PyPI is reachable, and carry .gpu" >&2
    exit 2
  fi
  mkdir -p /tmp/site && tar -C /tmp/site -xJf "$bundle"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec python3 bench/gpu_suite.py --results bench/RESULTS.md "$@"
