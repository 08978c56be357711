#!/usr/bin/env bash
# Issue [6]'s GPU evidence, results under $OUT. STEP=1: smoke check of the plans, `flashport tune` (standard +
# models, every eligible backend, fwd and bwd) and the standard suite's auto-vs-best with the new table.
# STEP=2: the models suite's auto-vs-best and the GPU test tier.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export FLASHPORT_CACHE_DIR=$OUT/cache
TABLE=flashport/configs/selection-nvidia-h200.json
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
if [ "${STEP:-1}" = 1 ]; then
  timeout 60 python tools/gpu/plan_smoke.py 2>&1 | tee "$OUT/plan_smoke.log" | tail -20
  timeout ${TUNE_SECONDS:-300} python -m flashport tune --suite all --out "$OUT/selection-nvidia-h200.json" > "$OUT/tune.log" 2>&1
  echo "tune rc=$?" | tee -a "$OUT/tune.log"; tail -5 "$OUT/tune.log"
  FLASHPORT_TABLE=$OUT/selection-nvidia-h200.json timeout ${AVB_SECONDS:-200} python -m flashport bench --suite standard \
    --auto-vs-best --out "$OUT" > "$OUT/autobest_standard.log" 2>&1
  echo "autobest rc=$?" | tee -a "$OUT/autobest_standard.log"; tail -45 "$OUT/autobest_standard.log"
else
  timeout ${AVB_SECONDS:-240} python -m flashport bench --suite models --auto-vs-best --out "$OUT" \
    > "$OUT/autobest_models.log" 2>&1
  echo "autobest rc=$?" | tee -a "$OUT/autobest_models.log"; tail -25 "$OUT/autobest_models.log"
  FLASHPORT_FUZZ_N=100 timeout ${GPU_TIER_SECONDS:-300} python -m pytest -q -p no:cacheprovider tests/gpu \
    > "$OUT/gpu_tier.log" 2>&1; echo "gpu tier rc=$?" >> "$OUT/gpu_tier.log"; tail -15 "$OUT/gpu_tier.log"
fi
