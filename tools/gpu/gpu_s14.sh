#!/usr/bin/env bash
# The 14th session's device calls, on one warm H200, in two parts (the FA4 wheels travel in two carries of
# under 64 MiB each: ../shared/tools/fa4-wheels):
#   PART=a (carry .fa4a): FA4 step 1; issue [10]'s JAX check and bench rows (tools/gpu/gpu_issue10.sh); issue [15]'s
#          GPU tier (flex and blockwise under the mods fuzzer, recompiles, auto)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; issue [14]'s fa4 check and fuzz (tools/gpu/fa4_check.sh);
#          the programmable probe (flashport vs Flex); GPU tier files as a regression check of this session's
#          dispatch changes
# Everything lands in $OUT/<part>.tgz (a call returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
R=/tmp/s14_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
if [ "$PART" = a ] || [ "$PART" = c ]; then
  # c: part a without FA4, plus the programmable probe (one call when the device time left allows no pair)
  [ "$PART" = a ] && mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"
  OUT=$R/jax INFO_SECONDS=40 CHECK_SECONDS=${CHECK_SECONDS:-170} BENCH_SECONDS=${BENCH_SECONDS:-180} timeout 400 \
      bash tools/gpu/gpu_issue10.sh > "$R/jax_run.log" 2>&1; echo "jax rc=$?"; tail -30 "$R/jax_run.log"
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-300} timeout ${PROG_SECONDS:-140} python -m pytest -q -s -p no:cacheprovider \
      tests/gpu/test_programmable_gpu.py 2>&1 | tail -40 | tee "$R/programmable_gpu.log"
  [ "$PART" = c ] && timeout ${PROBE_SECONDS:-90} python tools/gpu/programmable_probe.py \
      --out "$R/programmable_probe.json" 2>&1 | grep -v Warning | tee "$R/programmable_probe.log"
else
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  OUT=$R/fa4 timeout ${FA4_SECONDS:-290} bash tools/gpu/fa4_check.sh > "$R/fa4_run.log" 2>&1; echo "fa4 rc=$?"
  tail -20 "$R/fa4_run.log"
  timeout ${PROBE_SECONDS:-90} python tools/gpu/programmable_probe.py --out "$R/programmable_probe.json" \
      2>&1 | grep -v Warning | tee "$R/programmable_probe.log"
  timeout ${TIER_SECONDS:-140} python -m pytest -q -x -p no:cacheprovider tests/gpu/test_triton_gpu.py \
      tests/gpu/test_hopper_fwd_gpu.py tests/gpu/test_hopper_bwd_gpu.py tests/gpu/test_operability_gpu.py \
      2>&1 | tail -30 | tee "$R/gpu_tier_subset.log"
fi
tar -C /tmp -czf "$OUT/$PART.tgz" "s14_$PART" && ls -la "$OUT"
