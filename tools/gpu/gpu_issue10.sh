#!/usr/bin/env bash
# Issue [10] on the GPU (jax with its CUDA plugin preinstalled there; nothing is pip-installed), results under $OUT:
#   card.txt, jax_version.txt           the card (name, driver, memory) and jax's devices
#   info.log                            `flashport info`: torch backends, then jax's version/platform and the JAX backends
#   check_jax.log                       `flashport check --frontend jax`: cudnn, xla, blockwise against the float64
#                                       reference (out, lse, dq, dk, dv; bf16 and fp16; 17 cases), PASS/FAIL/SKIP per backend
#   bench_standard_jax_<card>.json/.png/.log
#                                       `flashport bench --suite standard --frontend jax`: the JAX backends on the
#                                       standard suite beside the torch frontend's backend=None (TFLOP/s, FA convention)
# About 5-6 minutes on an H100 / H200 with the defaults (estimates: this version has not run on a GPU yet): check
# ~1.5-2.5 min (102 cases; its log prints each verdict as it ends), bench up to BENCH_SECONDS=240.  The whole
# standard suite (36 shapes x cudnn/blockwise/xla/torch, each JAX cell compiled twice) is estimated at 5-6 min:
# the bench JSON is rewritten after every shape and marked "partial" when cut, and the shapes run S = 4096 and
# 16384 first (every head dim and mask), then 1024, 8192, 2048, 512.  BENCH_SECONDS=400 for the whole suite.
# JAX_CHECK=1 also runs tools/gpu/jax_check.py (the earlier one-file check + bench, JSON to $OUT/jax_gpu.json).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/card.txt"
CARD=$(head -1 "$OUT/card.txt" | cut -d, -f1 | tr 'A-Z' 'a-z' | sed 's/nvidia //; s/[^a-z0-9]\+/_/g; s/_$//')
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/jax_version.txt"
timeout ${INFO_SECONDS:-60} python -m flashport info > "$OUT/info.log" 2>&1
echo "info rc=$?"; grep -A12 "^JAX" "$OUT/info.log" | grep -v "^    "
timeout ${CHECK_SECONDS:-170} python -m flashport check --frontend jax > "$OUT/check_jax.log" 2>&1
echo "check --frontend jax rc=$?"; tail -9 "$OUT/check_jax.log"
timeout ${BENCH_SECONDS:-240} python -m flashport bench --suite standard --frontend jax --out "$OUT" --tag "$CARD" \
  > "$OUT/bench_standard_jax_$CARD.log" 2>&1
echo "bench --frontend jax rc=$?"; tr '\r' '\n' < "$OUT/bench_standard_jax_$CARD.log" | grep -v "run/s\]\|s/run\]" | tail -48
if [ "${JAX_CHECK:-0}" = 1 ]; then
  timeout ${JAX_SECONDS:-300} python tools/gpu/jax_check.py > "$OUT/jax_check.log" 2>&1
  echo "jax_check rc=$?"; tail -25 "$OUT/jax_check.log"
fi
rm -rf "$OUT/cache"
