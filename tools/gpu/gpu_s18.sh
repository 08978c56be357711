#!/usr/bin/env bash
# The next session's device calls, queued at the end of the 17th (one warm machine; each part returns
# $OUT/<part>.tgz, rewritten after every step, so a call cut at its limit still brings back what finished):
#   PART=a (carry .fa4a): FA4 step 1; issue [15]: the programmable suite without the FA4 columns (the Triton kernels'
#          table gradients and attn_bias timed against Flex for the first time), the programmable GPU tier with a
#          longer limit (the 17th session's run failed a flex test, its name cut off), the mods fuzz on triton with
#          attn_bias; issue [8]: the kvcache probe re-run on the 128-query threshold and the paged split rule, the
#          host time per eager call with the launch-plan cache (tools/gpu/host_stages.py)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; the programmable suite's FA4 columns; the workloads rows the
#          17th session's run did not reach (MLA, packed varlen, chunked prefill, decode) with FA4; the GPU tier's
#          decode / triton / operability files
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s18_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
save() { tar -C /tmp -czf "$OUT/$PART.tgz" "s18_$PART"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
case "$PART" in
a)
  mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"
  mkdir -p "$R/programmable"
  timeout ${SUITE_SECONDS:-220} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport-triton,flashport,flex,sdpa-mask > "$R/programmable/bench.log" 2>&1
  echo "programmable suite rc=$?"; grep -v "Warning\|warn\|run/s" "$R/programmable/bench.log" | tail -24; save
  timeout ${PROG_SECONDS:-120} python -m pytest -q -p no:logging -p no:cacheprovider --tb=short -k "flex" \
      tests/gpu/test_programmable_gpu.py > "$R/programmable_flex.log" 2>&1
  echo "flex tier rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/programmable_flex.log" | head -20; save
  timeout ${MODS_SECONDS:-70} python -m flashport.fuzz.mods --n 40 --backend triton --device cuda \
      --log "$R/mods_triton.jsonl" > "$R/mods_triton.log" 2>&1
  echo "mods fuzz rc=$?"; tail -3 "$R/mods_triton.log"; save
  timeout ${PROBE_SECONDS:-90} python tools/gpu/kvcache_probe.py --out "$R/kvcache.json" > "$R/kvcache.log" 2>&1
  echo "kvcache probe rc=$?"; grep -v "Warning\|warn\|return F" "$R/kvcache.log" | cut -c1-300; save
  timeout ${HOST_SECONDS:-40} python tools/gpu/host_stages.py --d 128 --out "$R/host_stages.json" > "$R/host_stages.log" 2>&1
  echo "host stages rc=$?"; head -30 "$R/host_stages.log"
  ;;
b)
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
  mkdir -p "$R/programmable" "$R/workloads"
  timeout ${FLASH_SECONDS:-150} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flex-flash,fa4,builtin 2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable FA4 columns rc=${PIPESTATUS[0]}"; tail -20 "$R/programmable/bench.log"; save
  timeout ${BENCH_SECONDS:-220} python -m flashport bench --suite workloads --match "mla|hdim256|packed|chunked|verify|decode" \
      --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex --out "$R/workloads" > "$R/workloads/bench.log" 2>&1
  echo "workloads rc=$?"; python tools/gpu/ratio_summary.py "$R/workloads/bench_workloads.json"; save
  timeout ${TIER_SECONDS:-120} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
      tests/gpu/test_decode_gpu.py tests/gpu/test_operability_gpu.py tests/gpu/test_triton_gpu.py > "$R/gpu_tier.log" 2>&1
  echo "gpu tier rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/gpu_tier.log" | head -20
  ;;
esac
save; ls -la "$OUT"
