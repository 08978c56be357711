#!/usr/bin/env bash
# Issue [7]'s GPU evidence, results under $OUT: the instrumentation's host cost, the GPU leak test (and the
# guard's lazy read-back), a torch.profiler trace of a bench run, then the GPU tier with what time is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"; export OUT
export FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout 90 python tools/gpu/instrument_cost.py 2>&1 | grep -v sdp_utils | tee "$OUT/instrument_cost.log"
timeout 200 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_operability_gpu.py 2>&1 | tee "$OUT/operability_gpu.log" | tail -40
timeout ${BENCH_SECONDS:-150} python -m flashport bench --suite models --peers flashport,sdpa-cudnn \
  --trace "$OUT/trace_bench_models_h200.json.gz" --out "$OUT" 2>&1 | grep -v "sdp_utils\|warnings.warn" > "$OUT/bench_models_trace.log"
echo "bench rc=${PIPESTATUS[0]}"; grep -E "^trace:|wrote" "$OUT/bench_models_trace.log"; ls -la "$OUT"/trace* 2>/dev/null
[ "${TIER_SECONDS:-0}" -gt 0 ] && timeout $TIER_SECONDS python -m pytest -q -x -p no:cacheprovider tests/gpu \
  --deselect tests/gpu/test_operability_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tier.log"
exit 0
