#!/usr/bin/env bash
# The 17th session's device calls (one warm machine; each part returns $OUT/<part>.tgz, rewritten after every step
# so that a call cut at its time limit still brings back what finished):
#   PART=a (carry .fa4a): FA4 step 1; issue [15]: the programmable GPU tier (blockwise, flex with its small tiles,
#          triton's compiled mods, block masks and captured-table gradients), the programmable suite without the FA4
#          columns; issue [8]: tools/gpu/kvcache_probe.py (chunked prefill on the prefill kernel against the decode
#          kernel and SDPA, the decode split sweep on ragged lengths), the GPU tier's decode / triton / operability
#          tests (the launch-plan cache)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; issue [14]: the fa4 fuzz tier re-run on the narrowed
#          capabilities, the kvcache fuzz tier on triton, the programmable suite's FA4 columns, and the workloads suite
#          with our kernels alone (flashport-triton) beside backend=None and FA4 (issue [8]'s cells too)
SESSION=s17; . "$(dirname "$0")/session.sh"
case "$PART" in
a)
  fa4_step1
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-150} timeout ${PROG_SECONDS:-150} python -m pytest -q -s -p no:logging \
      -p no:cacheprovider --tb=short tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "PASS|passed|failed|^FAILED|^E " "$R/programmable_gpu.log" | head -20; save
  mkdir -p "$R/programmable"
  timeout ${SUITE_SECONDS:-170} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport,flashport-triton,flex,builtin,sdpa-mask > "$R/programmable/bench.log" 2>&1
  echo "programmable suite rc=$?"; grep -v "Warning\|warn\|run/s" "$R/programmable/bench.log" | tail -24; save
  timeout ${PROBE_SECONDS:-140} python tools/gpu/kvcache_probe.py --out "$R/kvcache.json" 2>&1 \
      | grep -v "Warning\|warn" > "$R/kvcache.log"
  echo "kvcache probe rc=${PIPESTATUS[0]}"; cut -c1-400 "$R/kvcache.log"; save
  timeout ${TIER_SECONDS:-70} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
      tests/gpu/test_decode_gpu.py tests/gpu/test_operability_gpu.py tests/gpu/test_triton_gpu.py > "$R/gpu_tier.log" 2>&1
  echo "gpu tier rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/gpu_tier.log" | head -20
  ;;
b)
  fa4_step2
  timeout ${FUZZ_SECONDS:-100} python -m flashport.fuzz --backend fa4 --n ${FUZZ_N:-400} --dtype bfloat16,float16 \
      --device cuda --entries attention,varlen --max-seconds $(( ${FUZZ_SECONDS:-100} - 20 )) \
      --log "$R/fa4_fuzz.jsonl" 2>&1 | grep -v "aux_data\|exe_args" | tail -25 > "$R/fa4_fuzz.log"
  echo "fa4 fuzz rc=${PIPESTATUS[0]}"; head -14 "$R/fa4_fuzz.log"; save
  timeout ${KV_FUZZ_SECONDS:-70} python -m flashport.fuzz --backend triton --device cuda --entries kvcache \
      --n 600 --size full --dtype bfloat16,float16 --max-seconds $(( ${KV_FUZZ_SECONDS:-70} - 15 )) \
      --log "$R/fuzz_kvcache.jsonl" > "$R/fuzz_kvcache.log" 2>&1
  echo "kvcache fuzz rc=$?"; tail -22 "$R/fuzz_kvcache.log"; save
  mkdir -p "$R/programmable"
  timeout ${FLASH_SECONDS:-100} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport-triton,flex-flash,fa4 2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable FA4 columns rc=${PIPESTATUS[0]}"; tail -20 "$R/programmable/bench.log"; save
  OUT=$R/workloads BENCH_SECONDS=${BENCH_SECONDS:-200} PEERS=flashport,flashport-triton,fa4,sdpa-cudnn,flex \
      bash tools/gpu/gpu_issue8.sh > "$R/workloads_run.log" 2>&1
  echo "workloads rc=$?"; tail -30 "$R/workloads_run.log"
  ;;
esac
save; ls -la "$OUT"
