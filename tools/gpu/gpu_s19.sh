#!/usr/bin/env bash
# The 19th session's device calls (the 18th session's plan, which got no machine, and part c), on one warm machine; each
# part returns $OUT/<part>.tgz, rewritten after every step and every 20 s,
# so that a call cut at its limit still brings back what finished:
#   PART=a (carry .fa4a): FA4 step 1; issue [15]: the programmable suite without the FA4 columns (the Triton kernels'
#          table gradients and attn_bias timed against Flex; `flashport` = backend=None: the compiled mods, or the
#          built-in call a block mask equals), the programmable GPU tier with capped fuzz counts; issue [8]: the GQA
#          dK/dV schedules (tools/gpu/gqa_loop_probe.py)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; the programmable suite's FA4 columns (Flex FLASH, FA4's
#          built-ins); `flashport tune --suite workloads` with FA4 eligible, merged into the shipped table, and the
#          workloads' dense cells with --auto-vs-best
#   PART=c: issue [15]'s programmable GPU tier (mods fuzz on blockwise, flex and triton, block masks, table
#          gradients), then the rest of the GPU tier with its fuzz counts capped to fit one call
SESSION=s19; . "$(dirname "$0")/session.sh"
case "$PART" in
a)
  fa4_step1
  mkdir -p "$R/programmable"
  timeout ${SUITE_SECONDS:-170} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport-triton,flashport,flex,sdpa-mask > "$R/programmable/bench.log" 2>&1
  echo "programmable suite rc=$?"; grep -v "Warning\|warn\|run/s" "$R/programmable/bench.log" | tail -24; save
  # the programmable GPU tier (blockwise, flex and triton mods fuzz, block masks, table gradients, auto's choice and
  # the rewrites of block masks into built-in calls), its fuzz counts capped to fit
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-60} FLASHPORT_MODS_FUZZ_N_FLEX=${FLEX_N:-30} FLASHPORT_MODS_FUZZ_N_TRITON=${TRITON_N:-40} \
      timeout ${TIER_SECONDS:-150} python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
      --durations=10 tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$R/programmable_gpu.log" | cut -c1-300 | head -20
  save
  [ "${GQA_SECONDS:-90}" = 0 ] || timeout ${GQA_SECONDS:-90} python tools/gpu/gqa_loop_probe.py --out "$R/gqa_loop.json" > "$R/gqa_loop.log" 2>&1
  echo "gqa probe rc=$?"
  python - "$R/gqa_loop.json" <<'EOF2'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print("no json:", e); sys.exit(0)
for r in rows:
    err = max(r.get("err_vs_fp32") or [float("nan")])
    print(f"{r['cell']:12} {r['variant']:18} {r.get('ms', float('nan')):8.3f} ms {r.get('tflops', 0):6.1f} TF "
          f"x{r.get('speedup_vs_partials', 1):.3f} err {err:.2e} {r.get('error', '')[:80]}")
EOF2
  save
  ;;
b)
  fa4_step2
  mkdir -p "$R/programmable" "$R/autobest"
  timeout ${FLASH_SECONDS:-200} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport,flex-flash,fa4,builtin 2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable FA4 columns rc=${PIPESTATUS[0]}"; tail -20 "$R/programmable/bench.log"; save
  cp flashport/configs/selection-nvidia-h200.json "$R/table_before.json"
  timeout ${TUNE_SECONDS:-180} python -m flashport tune --suite workloads --rounds 2 \
      --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
  echo "tune rc=$?"; grep -v "Warning\|warn" "$R/tune.log" | tail -14
  cp flashport/configs/selection-nvidia-h200.json "$R/table_after.json"; save
  timeout ${AUTO_SECONDS:-150} python -m flashport bench --suite workloads --auto-vs-best --rounds 3 \
      --match "train|swa|gemma|phi3|vit|dit|mla|hdim256" --out "$R/autobest" > "$R/autobest/bench.log" 2>&1
  echo "auto-vs-best rc=$?"; grep -v "Warning\|warn" "$R/autobest/bench.log" | tail -24
  ;;
c)
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-100} FLASHPORT_MODS_FUZZ_N_FLEX=${FLEX_N:-40} FLASHPORT_MODS_FUZZ_N_TRITON=${TRITON_N:-100} \
      timeout ${PROG_SECONDS:-200} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
      --durations=10 tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$R/programmable_gpu.log" | cut -c1-300 | head -20
  save
  FLASHPORT_FUZZ_N=${FUZZ_N:-150} FLASHPORT_COMPILED_FUZZ_N=${COMPILED_N:-60} \
      timeout ${REST_SECONDS:-200} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
      --durations=15 tests/gpu --ignore=tests/gpu/test_programmable_gpu.py > "$R/gpu_tier.log" 2>&1
  echo "gpu tier rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$R/gpu_tier.log" | cut -c1-300 | head -30
  ;;
esac
save; ls -la "$OUT"
