#!/usr/bin/env bash
# Issue [6]'s GPU evidence, results under $OUT.
#   STEP=1: smoke check of every plan, then `flashport tune` (standard + models, every eligible backend, fwd and
#           bwd, ROUNDS interleaved rounds) into $OUT/selection-nvidia-h200.json.
#   STEP=2: auto-vs-best of both suites with the table shipped in flashport/configs (copy STEP 1's there first).
#   STEP=both: 1 then 2, STEP 1's table copied into flashport/configs of the device's working tree in between.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
STEP=${STEP:-1}
if [ "$STEP" = 1 ] || [ "$STEP" = both ]; then
  [ "${SMOKE:-1}" = 1 ] && timeout 60 python tools/gpu/plan_smoke.py 2>&1 | tee "$OUT/plan_smoke.log" | tail -4
  timeout ${TUNE_SECONDS:-480} python -m flashport tune --suite all --rounds ${ROUNDS:-2} \
    --out "$OUT/selection-nvidia-h200.json" 2>&1 | grep -v "sdp_utils_cpp\|^  warnings.warn" > "$OUT/tune.log"
  echo "tune rc=${PIPESTATUS[0]}" | tee -a "$OUT/tune.log"; tail -4 "$OUT/tune.log"
  python -c "import json; d=json.load(open('$OUT/selection-nvidia-h200.json')); print(len(d['buckets']), 'buckets')"
  [ "$STEP" = both ] && cp "$OUT/selection-nvidia-h200.json" flashport/configs/selection-nvidia-h200.json
fi
if [ "$STEP" = 2 ] || [ "$STEP" = both ]; then
  for suite in standard models; do
    timeout $([ $suite = standard ] && echo ${AVB_SECONDS:-180} || echo ${AVB_MODELS_SECONDS:-110}) python -m flashport bench --suite $suite --auto-vs-best --rounds ${ROUNDS:-2} \
      --out "$OUT" 2>&1 | grep -v "sdp_utils_cpp" > "$OUT/autobest_$suite.log"
    echo "autobest $suite rc=${PIPESTATUS[0]}" | tee -a "$OUT/autobest_$suite.log"
    grep -E "min ratio" "$OUT/autobest_$suite.log"
    awk '/ratio/ && ($NF+0 < 0.97 || $(NF-2)+0 < 0.97)' "$OUT/autobest_$suite.log" | head -20
  done
fi
