#!/usr/bin/env bash
# Issues [6] and [7]'s GPU evidence, results under $OUT (8 files at most come back: logs go into one tar).
#   [6]: re-tune the buckets matching RETUNE (merged into the shipped table), then auto-vs-best of the standard suite.
#   [7]: the instrumentation's host cost, the GPU leak test (and the guard's lazy read-back), a torch.profiler
#        trace of a bench run, then the GPU tier with TIER_SECONDS if set.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT/logs"; export OUT
export FLASHPORT_CACHE_DIR=$OUT/cache
L=$OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$L/card.txt"
timeout 90 python tools/gpu/instrument_cost.py 2>&1 | grep -v "sdp_utils\|USDT\|_warn_once\|UserWarning" | tee "$L/instrument_cost.log"
timeout 240 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_operability_gpu.py 2>&1 > "$L/operability_gpu.log"
tail -3 "$L/operability_gpu.log"; grep -A8 '"allocated_before"' "$L/operability_gpu.log" | head -9
timeout ${BENCH_SECONDS:-150} python -m flashport bench --suite models --peers flashport,sdpa-cudnn \
  --trace "$OUT/trace_bench_models_h200.json.gz" --out "$L" 2>&1 | grep -v "sdp_utils\|warnings.warn" > "$L/bench_models_trace.log"
echo "bench rc=${PIPESTATUS[0]}"; grep -E "^trace:|wrote" "$L/bench_models_trace.log"
if [ -n "${RETUNE:-}" ]; then
  timeout 90 python -m flashport tune --match "$RETUNE" --rounds ${ROUNDS:-3} \
    --out flashport/configs/selection-nvidia-h200.json 2>&1 | grep -v "sdp_utils\|warnings.warn" > "$L/retune.log"
  echo "retune rc=${PIPESTATUS[0]}"; tail -3 "$L/retune.log"; cp flashport/configs/selection-nvidia-h200.json "$OUT/"
  timeout ${AVB_SECONDS:-200} python -m flashport bench --suite standard --auto-vs-best --rounds ${ROUNDS:-3} \
    --out "$OUT" 2>&1 | grep -v "sdp_utils" > "$L/autobest_standard.log"
  echo "autobest rc=${PIPESTATUS[0]}"; grep -E "min ratio" "$L/autobest_standard.log"
  awk '/ratio/ && ($NF+0 < 0.97 || $(NF-2)+0 < 0.97)' "$L/autobest_standard.log" | head -20
fi
[ "${TIER_SECONDS:-0}" -gt 0 ] && timeout $TIER_SECONDS python -m pytest -q -x -p no:cacheprovider tests/gpu \
  --deselect tests/gpu/test_operability_gpu.py 2>&1 | tail -15 | tee "$L/gpu_tier.log"
rm -rf "$OUT/cache"; tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"; ls -la "$OUT"
exit 0
