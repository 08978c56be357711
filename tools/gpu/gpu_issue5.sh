#!/usr/bin/env bash
# Issue [5]'s GPU evidence in one device call (about 9 minutes on one H200), results under $OUT:
#   fuzz_h200.{log,jsonl}  the random-contract fuzz (flashport.fuzz), concurrently with
#   gpu_tier.log           the GPU test tier, then
#   memcheck.log           compute-sanitizer memcheck over the KV-cache, paged, varlen and bad-content tests,
#   memcheck_negative.log  the same bad call with the guard switched off (must report errors), and last
#   guard_cost.json        what the content guard costs a decode step (alone on the GPU).
# Usage: OUT=... FUZZ_N=6000 FUZZ_SECONDS=420 bash tools/gpu/gpu_issue5.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
N=${FUZZ_N:-6000}; T=${FUZZ_SECONDS:-420}; SEED=${FUZZ_SEED:-20261204}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout $((T + 60)) python -m flashport.fuzz --n "$N" --seed "$SEED" --workers "${FUZZ_WORKERS:-8}" --device cuda \
  --size full --max-seconds "$T" --log "$OUT/fuzz_h200.jsonl" > "$OUT/fuzz_h200.log" 2>&1 &
fuzz=$!
(
  FLASHPORT_FUZZ_N=100 timeout "${GPU_TIER_SECONDS:-240}" python -m pytest -q -p no:cacheprovider --durations=15 tests/gpu \
    > "$OUT/gpu_tier.log" 2>&1; echo "gpu tier rc=$?" >> "$OUT/gpu_tier.log"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest -q -p no:cacheprovider \
    tests/gpu/test_contents_gpu.py tests/gpu/test_decode_gpu.py tests/gpu/test_triton_gpu.py::test_varlen_poisoned_padding \
    tests/gpu/test_triton_gpu.py::test_check_grid_gpu_cases -k "not graph" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?" >> "$OUT/memcheck.log"
  timeout 45 compute-sanitizer --tool memcheck python tools/gpu/memcheck_negative.py > "$OUT/memcheck_negative.log" 2>&1
  echo "negative control rc=$?" >> "$OUT/memcheck_negative.log"
) &
side=$!
wait $fuzz; echo "fuzz rc=$?" | tee -a "$OUT/fuzz_h200.log"
wait $side
OUT=$OUT timeout 60 python tools/gpu/guard_cost.py > "$OUT/guard_cost.log" 2>&1; echo "guard cost rc=$?"
tail -n 40 "$OUT/fuzz_h200.log"; grep -E "passed|failed|rc=" "$OUT/gpu_tier.log" | tail -3
grep -E "ERROR SUMMARY|rc=" "$OUT/memcheck.log" "$OUT/memcheck_negative.log"; cat "$OUT/guard_cost.log"
