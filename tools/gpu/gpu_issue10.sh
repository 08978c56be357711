#!/usr/bin/env bash
# Issue [10] on the GPU (jax with its CUDA plugin preinstalled there; nothing is pip-installed): flashport.jax's
# cudnn, blockwise and xla backends against the float64 reference, then TFLOP/s on standard-suite shapes
# beside the torch frontend's auto backend.  JSON and logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/jax_version.txt"
timeout ${JAX_SECONDS:-540} python tools/gpu/jax_check.py "$@" 2>&1 | tee "$OUT/jax_check.log"
echo "jax_check rc=${PIPESTATUS[0]}"
rm -rf "$OUT/cache"
