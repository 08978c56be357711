#!/usr/bin/env bash
# Issue [14]'s optional `fa4` backend (FlashAttention-4) on the GPU: its info line, FA4's first-call compile time,
# probes of FA4 on NaN-padded KV-cache / varlen layouts, the grid of `flashport check --backend fa4` (streamed, one
# line per case), then the GPU fuzz tier restricted to it (`python -m flashport.fuzz --backend fa4`).  Logs under
# $OUT.  About 4 minutes (each part has its own timeout; FA4 compiles every new kernel variant at first call).
# flash-attn-4 must already be importable: the caller exports PYTHONPATH (e.g. after ../shared/tools/fa4-wheels's
# two steps on the GPU machine); this script only prepends the repository.
#   bash tools/gpu/fa4_check.sh            # CHECK_DTYPES, CHECK_SECONDS, FUZZ_N, FUZZ_SECONDS override the defaults
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/flashport_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FLASHPORT_CACHE_DIR=$OUT/cache
# FA4 keeps compiled kernels on disk when asked: the fuzz workers (separate processes) then reuse the check's.
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4_kernel_cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/card.txt"
timeout 120 python -m flashport info 2>&1 | tee "$OUT/fa4_info.log" | grep -E "^flashport|^  fa4 "
timeout ${PROBE_SECONDS:-75} python tools/gpu/fa4_check.py compile probes 2>&1 | tee "$OUT/fa4_probe.log"
echo "compile+probes rc=${PIPESTATUS[0]}"
timeout ${CHECK_SECONDS:-100} python tools/gpu/fa4_check.py check --dtype "${CHECK_DTYPES:-bfloat16}" 2>&1 | tee "$OUT/fa4_check.log"
echo "check (flashport check --backend fa4 grid) rc=${PIPESTATUS[0]}"
timeout ${FUZZ_SECONDS:-60} python -m flashport.fuzz --backend fa4 --n "${FUZZ_N:-300}" --dtype bfloat16,float16 \
    --entries attention,varlen --workers 4 --max-seconds $(( ${FUZZ_SECONDS:-60} - 25 )) \
    --log "$OUT/fa4_fuzz.jsonl" 2>&1 | tail -60 | tee "$OUT/fa4_fuzz.log"
echo "fuzz rc=${PIPESTATUS[0]}"
rm -rf "$OUT/cache"
