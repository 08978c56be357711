#!/usr/bin/env bash
# The 15th session's device calls on one warm machine; each part returns $OUT/<part>.tgz (a call returns at most
# 8 files).  The FA4 wheels travel in two carries of under 64 MiB (../shared/tools/fa4-wheels):
#   PART=a (carry .fa4a): FA4 step 1; issue [15]'s flex diagnosis (graph breaks and recompiles, one case at a
#          time), its GPU tier (mods fuzz on blockwise and flex, recompiles, auto) and the programmable probe
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; issue [14]'s fa4 info, compile time, probes, check grid
#          and fuzz (tools/gpu/fa4_check.sh); the standard grid's long cells (WORKLOADS=1: the workloads suite)
#          with FA4 among the peers
#   PART=c (no carry, warm after b: FA4 stays installed under /tmp): the standard suite with FA4 among the peers
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s15_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$R/card.txt"
fa4_path() { export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages; }
case "$PART" in
a)
  mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"
  TORCH_LOGS=graph_breaks,recompiles timeout ${DIAG_SECONDS:-150} python tools/gpu/flex_diag.py > "$R/flex_diag.log" 2>&1
  echo "flex_diag rc=$?"; grep -E "^[a-z].*: (ok|FAILED)" "$R/flex_diag.log"
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-300} timeout ${PROG_SECONDS:-150} python -m pytest -q -p no:logging -p no:cacheprovider \
      --tb=short tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "passed|failed|^FAILED|^E " "$R/programmable_gpu.log" | head -20
  mkdir -p "$R/programmable"
  timeout ${PROBE_SECONDS:-150} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers ${PROG_PEERS:-flashport-flex,flex,builtin,sdpa-mask} > "$R/programmable/bench.log" 2>&1
  echo "programmable suite rc=$?"; grep -v "Warning\|warn" "$R/programmable/bench.log" | tail -40
  # blockwise's plain tiles now run through tile_steps (eager on a GPU): the fuzz tier on it
  timeout ${BW_SECONDS:-90} python -m flashport.fuzz --backend blockwise --device cuda --n ${BW_N:-200} \
      --dtype bfloat16,float16,float32 --max-seconds $(( ${BW_SECONDS:-90} - 20 )) --log "$R/blockwise_fuzz.jsonl" \
      2>&1 | tail -25 > "$R/blockwise_fuzz.log"; echo "blockwise fuzz rc=${PIPESTATUS[0]}"; head -12 "$R/blockwise_fuzz.log"
  ;;
b)
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"; fa4_path
  if [ "${SHORT:-0}" = 1 ]; then   # the re-check of the narrowed fa4 capabilities, then FA4's columns of the programmable suite
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
    timeout ${CHECK_SECONDS:-120} python tools/gpu/fa4_check.py check --dtype bfloat16 2>&1 \
        | grep -v "aux_data\|exe_args\|UserWarning" > "$R/fa4_check.log"; echo "fa4 check rc=${PIPESTATUS[0]}"
    grep -E "PASS|FAIL" "$R/fa4_check.log" | grep -v "^fa4" | head -20; tail -4 "$R/fa4_check.log"
    mkdir -p "$R/programmable"
    timeout ${PROBE_SECONDS:-120} python -m flashport bench --suite programmable --out "$R/programmable" \
        --peers flashport-flex,flex-flash,fa4 2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
    echo "programmable (FA4 columns) rc=${PIPESTATUS[0]}"; tail -30 "$R/programmable/bench.log"
    tar -C /tmp -czf "$OUT/$PART.tgz" "s15_$PART" && ls -la "$OUT"; exit 0
  fi
  OUT=$R/fa4 PROBE_SECONDS=75 CHECK_SECONDS=${CHECK_SECONDS:-110} FUZZ_SECONDS=${FUZZ_SECONDS:-70} \
      timeout 330 bash tools/gpu/fa4_check.sh > "$R/fa4_run.log" 2>&1; echo "fa4 rc=$?"
  grep -E "rc=|compile|PASS|FAIL|summary|passed|failed" "$R/fa4_run.log" | head -40
  if [ "${WORKLOADS:-0}" = 1 ]; then
    OUT=$R/workloads BENCH_SECONDS=${BENCH_SECONDS:-190} bash tools/gpu/gpu_issue8.sh > "$R/workloads_run.log" 2>&1
    echo "workloads rc=$?"; tail -25 "$R/workloads_run.log"
  elif [ "${BENCH_SECONDS:-200}" -gt 0 ]; then   # the standard grid's long cells (S >= 4k), FA4 among the peers
    mkdir -p "$R/standard"; export FLASHPORT_CACHE_DIR=$R/cache
    timeout ${BENCH_SECONDS:-200} python -m flashport bench --suite standard --match "${MATCH:-s(4096|8192|16384)}" \
        --peers flashport,fa4,sdpa-cudnn,flex --out "$R/standard" 2>&1 \
        | grep -v "sdp_utils\|warnings.warn\|aux_data\|exe_args" > "$R/standard/bench_standard.log"
    echo "standard rc=${PIPESTATUS[0]}"; python tools/gpu/ratio_summary.py "$R/standard/bench_standard.json" | tail -30
    rm -rf "$R/cache"
  fi
  ;;
c)
  fa4_path; mkdir -p "$R/standard"; export FLASHPORT_CACHE_DIR=$R/cache
  timeout ${BENCH_SECONDS:-500} python -m flashport bench --suite standard \
      --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex --out "$R/standard" 2>&1 \
      | grep -v "sdp_utils\|warnings.warn" > "$R/standard/bench_standard.log"
  echo "standard rc=${PIPESTATUS[0]}"; python tools/gpu/ratio_summary.py "$R/standard/bench_standard.json" | tail -30
  rm -rf "$R/cache"
  ;;
esac
tar -C /tmp -czf "$OUT/$PART.tgz" "s15_$PART" && ls -la "$OUT"
