#!/usr/bin/env bash
# Issue [8]'s baseline on the GPU, results under $OUT: the workloads suite, every peer in one process (JSON + PNG),
# then the same suite's auto-vs-best (dense cells) so backend=None's choice is judged on these kinds too.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout ${BENCH_SECONDS:-400} python -m flashport bench --suite workloads \
  --peers ${PEERS:-flashport,flashport-triton,sdpa-cudnn,sdpa-fa2,flex} --out "$OUT" 2>&1 \
  | grep -v "sdp_utils\|warnings.warn" > "$OUT/bench_workloads.log"
echo "bench rc=${PIPESTATUS[0]}"; tail -40 "$OUT/bench_workloads.log"
if [ "${AVB_SECONDS:-0}" -gt 0 ]; then
  timeout $AVB_SECONDS python -m flashport bench --suite workloads --auto-vs-best --rounds ${ROUNDS:-2} --out "$OUT" 2>&1 \
    | grep -v sdp_utils > "$OUT/autobest_workloads.log"; grep "min ratio" "$OUT/autobest_workloads.log"
fi
rm -rf "$OUT/cache"
