#!/usr/bin/env bash
# The 18th session's second pair of device calls (one warm machine; each part returns $OUT/<part>.tgz, rewritten
# after every step, so a call cut at its limit still brings back what finished):
#   PART=c1 (carry .fa4a): FA4 step 1; the GQA dK/dV schedules timed (tools/gpu/gqa_loop_probe.py); the programmable
#           GPU tier's selection test (auto serves a compilable mod on the Triton kernels)
#   PART=c2 (carry .fa4b, within 30 s of c1): FA4 step 2; `flashport tune --suite workloads` with FA4 installed,
#           merged into the shipped H200 table (fa4 is measured_only: auto takes it only where the table measured
#           it); then the workloads suite's dense cells with --auto-vs-best against that table
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s18_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
save() { tar -C /tmp -czf "$OUT/$PART.tgz" "s18_$PART"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
case "$PART" in
c1)
  mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"
  timeout ${GQA_SECONDS:-150} python tools/gpu/gqa_loop_probe.py --out "$R/gqa_loop.json" > "$R/gqa_loop.log" 2>&1
  echo "gqa probe rc=$?"
  python - "$R/gqa_loop.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print("no json:", e); sys.exit(0)
for r in rows:
    err = max(r.get("err_vs_fp32") or [float("nan")])
    print(f"{r['cell']:12} {r['variant']:18} {r.get('ms', float('nan')):8.3f} ms {r.get('tflops', 0):6.1f} TF "
          f"x{r.get('speedup_vs_partials', 1):.3f} err {err:.2e} {r.get('error', '')[:80]}")
EOF
  save
  timeout ${PROG_SECONDS:-60} python -m pytest -q -p no:logging -p no:cacheprovider --tb=short -k "auto_serves" \
      tests/gpu/test_programmable_gpu.py > "$R/programmable_auto.log" 2>&1
  echo "programmable auto rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/programmable_auto.log" | head -20
  ;;
c2)
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
  cp flashport/configs/selection-nvidia-h200.json "$R/table_before.json"
  timeout ${TUNE_SECONDS:-300} python -m flashport tune --suite workloads --rounds 2 \
      --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
  echo "tune rc=$?"; grep -v "Warning\|warn" "$R/tune.log" | tail -24
  cp flashport/configs/selection-nvidia-h200.json "$R/table_after.json"; save
  mkdir -p "$R/autobest"
  timeout ${AUTO_SECONDS:-200} python -m flashport bench --suite workloads --auto-vs-best --rounds 3 \
      --match "train|swa|gemma|phi3|vit|dit|mla|hdim256" --out "$R/autobest" > "$R/autobest/bench.log" 2>&1
  echo "auto-vs-best rc=$?"; grep -v "Warning\|warn" "$R/autobest/bench.log" | tail -30
  ;;
esac
save; ls -la "$OUT"
