#!/usr/bin/env bash
# The 16th session's second pair of device calls (one warm machine; each part returns $OUT/<part>.tgz).
#   PART=a (carry .fa4a): FA4 step 1; issue [15]'s programmable GPU tier again (flex with one-stage 64-row tiles
#          when a score_mod reads a captured tensor requiring grad), and the mods fuzz on `triton` when that
#          backend declares score_mod
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; issue [14]: `flashport tune` of the standard suite with FA4
#          among the eligible backends (merged into the shipped H200 table), then the auto-vs-best check with it
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s16_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
case "$PART" in
a)
  mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-200} timeout ${PROG_SECONDS:-150} python -m pytest -q -p no:logging -p no:cacheprovider \
      --tb=short tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "PASS|passed|failed|^FAILED|^E " "$R/programmable_gpu.log" | head -20
  if python -c "import sys, flashport.dispatch as d; sys.exit('score_mod' not in d.get('triton').caps.mods)" 2>/dev/null; then
    timeout ${TRITON_MODS_SECONDS:-120} python -m flashport.fuzz.mods --n ${TRITON_MODS_N:-300} --backend triton \
        --device cuda > "$R/triton_mods_fuzz.log" 2>&1; echo "triton mods fuzz rc=$?"; tail -8 "$R/triton_mods_fuzz.log"
  fi
  ;;
b)
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  python -m flashport info 2>&1 | grep -E "fa4|flash-attn" | head -3
  T=flashport/configs/selection-nvidia-h200.json
  timeout ${TUNE_SECONDS:-300} python -m flashport tune --suite standard --rounds ${ROUNDS:-2} --out $T 2>&1 \
      | grep -v "sdp_utils\|warnings.warn\|aux_data\|exe_args" > "$R/tune.log"
  echo "tune rc=${PIPESTATUS[0]}"; grep -c "fa4" "$R/tune.log"; tail -3 "$R/tune.log"; cp $T "$R/"
  timeout ${AVB_SECONDS:-220} python -m flashport bench --suite standard --auto-vs-best --rounds ${ROUNDS:-2} \
      --out "$R" 2>&1 | grep -v "sdp_utils\|aux_data\|exe_args\|Warning" > "$R/autobest_standard.log"
  echo "autobest rc=${PIPESTATUS[0]}"; grep -E "min ratio" "$R/autobest_standard.log"
  awk '/ratio/ && ($NF+0 < 0.97 || $(NF-2)+0 < 0.97)' "$R/autobest_standard.log" | head -20
  ;;
esac
tar -C /tmp -czf "$OUT/$PART.tgz" "s16_$PART" && ls -la "$OUT"
