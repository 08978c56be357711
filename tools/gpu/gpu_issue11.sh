#!/usr/bin/env bash
# Issue [11] on one GPU, results under $OUT: ring attention on NCCL (a world of one, no torchrun) checked against
# single-device attention under the tolerance rule (ring_check.log), and examples/long_document.py: 1,048,576
# tokens forward, 131,072 and 262,144 tokens forward and backward (long_document.log, long_document/*.json,
# *.png).  The card is named in card.txt and at the top of each log.  About 2-3 minutes on an H100 / H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASHPORT_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/card.txt"
timeout ${RING_SECONDS:-150} python tools/gpu/ring_check.py > "$OUT/ring_check.log" 2>&1
echo "ring_check rc=$?"; cat "$OUT/ring_check.log" | tail -12
timeout ${DOC_SECONDS:-240} python examples/long_document.py --device cuda --out "$OUT/long_document" \
  > "$OUT/long_document.log" 2>&1
echo "long_document rc=$?"; tr '\r' '\n' < "$OUT/long_document.log" | grep -v "it/s\]\|s/it\]\|?it/s\]" | tail -8
rm -rf "$OUT/cache"
