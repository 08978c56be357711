#!/usr/bin/env bash
# The 17th session's own GPU checks (one call, results in $OUT/c.tgz): issue [8]'s chunked prefill on the prefill
# kernel (tools/gpu/kvcache_probe.py: it against the decode kernel, SDPA and FA4 where part b installed it, outputs
# checked), the GPU tier's KV-cache, Triton and operability tests, the fuzz tier on triton with the new kvcache
# query lengths, and the host time per eager call with the launch-plan cache (tools/gpu/host_stages.py); the probe
# also sweeps the decode kernel's split count on ragged and uniform lengths (issue [8]'s ragged paged decode).
# Issue [15]: the learnable relative-position table with its gradient on the Triton kernels (atomics) against Flex,
# and the mods fuzz tier on triton (captured tables with gradients now served).
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s17_c; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
if [ -d /tmp/fa4site ]; then   # left by gpu_s17.sh part b on this warm machine
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
fi
timeout ${PROBE_SECONDS:-180} python tools/gpu/kvcache_probe.py --out "$R/kvcache.json" 2>&1 \
  | grep -v "Warning\|warn" > "$R/kvcache.log"
echo "kvcache probe rc=${PIPESTATUS[0]}"; cat "$R/kvcache.log" | cut -c1-400
mkdir -p "$R/programmable"
timeout ${PROG_SECONDS:-100} python -m flashport bench --suite programmable --match "rel-table" \
  --peers flashport-triton,flashport,flex --out "$R/programmable" > "$R/programmable/bench.log" 2>&1
echo "programmable rel-table rc=$?"; grep -v "Warning\|warn\|run/s" "$R/programmable/bench.log" | tail -8
timeout ${MODS_SECONDS:-60} python -m flashport.fuzz.mods --n 100 --backend triton --device cuda \
  > "$R/fuzz_mods_triton.log" 2>&1
echo "mods fuzz rc=$?"; tail -8 "$R/fuzz_mods_triton.log"
timeout ${FUZZ_SECONDS:-110} python -m flashport.fuzz --backend triton --device cuda --entries kvcache \
  --n ${FUZZ_N:-600} --size full --dtype bfloat16,float16 --max-seconds $(( ${FUZZ_SECONDS:-110} - 15 )) \
  --log "$R/fuzz_kvcache.jsonl" > "$R/fuzz_kvcache.log" 2>&1
echo "fuzz rc=$?"; tail -22 "$R/fuzz_kvcache.log"
timeout ${TIER_SECONDS:-150} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
  tests/gpu/test_decode_gpu.py tests/gpu/test_operability_gpu.py tests/gpu/test_triton_gpu.py > "$R/gpu_tier.log" 2>&1
echo "gpu tier rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/gpu_tier.log" | head -20
timeout ${HOST_SECONDS:-90} python tools/gpu/host_stages.py --out "$R/host_stages.json" > "$R/host_stages.log" 2>&1
echo "host stages rc=$?"; head -40 "$R/host_stages.log"
tar -C /tmp -czf "$OUT/c.tgz" s17_c && ls -la "$OUT"
