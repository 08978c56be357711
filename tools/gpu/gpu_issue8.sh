#!/usr/bin/env bash
# Issue [8]'s baseline on the GPU, results under $OUT: the workloads suite, every peer in one process (JSON + PNG),
# then the same suite's auto-vs-best (dense cells) so backend=None's choice is judged on these kinds too.
# FA4 joins the peers when .fa4b is carried and the previous call (gpu_issue9.sh with .fa4a) left /tmp/fa4/ir.so.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .fa4b ] && [ -f /tmp/fa4/ir.so ]; then
  bash .fa4b/install.sh > /tmp/fa4_install.log 2>&1; echo "fa4 install rc=$?"; tail -2 /tmp/fa4_install.log
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
fi
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout ${BENCH_SECONDS:-400} python -m flashport bench --suite workloads \
  --peers ${PEERS:-flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex} --out "$OUT" 2>&1 \
  | grep -v "sdp_utils\|warnings.warn" > "$OUT/bench_workloads.log"
echo "bench rc=${PIPESTATUS[0]}"; python tools/gpu/ratio_summary.py "$OUT/bench_workloads.json"
if [ "${AVB_SECONDS:-0}" -gt 0 ]; then
  timeout $AVB_SECONDS python -m flashport bench --suite workloads --auto-vs-best --rounds ${ROUNDS:-2} --out "$OUT" 2>&1 \
    | grep -v sdp_utils > "$OUT/autobest_workloads.log"; grep "min ratio" "$OUT/autobest_workloads.log"
fi
rm -rf "$OUT/cache"
