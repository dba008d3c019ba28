#!/usr/bin/env bash
# Megatron-Bridge pretrain() of one recipe under torchrun and under megaray, in one command on one
# GPU machine; prints Megatron's own per-iteration times and the time to the first iteration.
# Usage: bench/gpu_parity.sh [RECIPE] [OVERRIDES...]     (default recipe: gpt_small)
set -uo pipefail
cd "$(dirname "$0")/.."
recipe=${1:-gpt_small}; shift || true
out=${OUT:-/tmp/megaray-parity}; mkdir -p "$out"
run() {  # name, command...
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@" 2>&1 | python3 bench/stamp.py "$t0" > "$out/$name.log"
  echo "$name exit=${PIPESTATUS[0]}"
}
torchrun_run() {
  run torchrun python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m launcher.bridge_target \
    --recipe "$recipe" logger.log_interval=1 "$@"
}
megaray_run() {
  run megaray python3 main.py --nodes 1 --gpus-per-node 1 --recipe "$recipe" logger.log_interval=1 "$@"
}
# The first run pays for a cold file cache (imports): ORDER=megaray-first swaps them to check that.
if [ "${ORDER:-torchrun-first}" = megaray-first ]; then megaray_run "$@"; torchrun_run "$@"
else torchrun_run "$@"; megaray_run "$@"; fi
python3 bench/parity_report.py "$out/torchrun.log" "$out/megaray.log"
