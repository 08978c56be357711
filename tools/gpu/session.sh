# Sourced by a session's device script (tools/gpu/gpu_sNN.sh) after `SESSION=sNN`, with PART set and $OUT the
# device's return folder: runs from the repository root on the image's packages, results under $R, and
#   save        rewrites $OUT/$PART.tgz from $R (after every step, every 20 s, and at exit)
#   fa4_step1   FA4's first half (carried as .fa4a): the compiled IR library, unpacked into /tmp/fa4
#   fa4_step2   its second half (.fa4b, within 30 s on the same warm machine): installs it and puts it on PYTHONPATH
#   fa4_env     a later call on that machine: puts the installed FA4 on PYTHONPATH again
#   programmable_tier SECONDS   issue [15]'s GPU tier (tests/gpu/test_programmable_gpu.py, fuzz counts MODS_N /
#               FLEX_N / TRITON_N), its log in $R/programmable_gpu.log, each failing fuzz case printed as it happens
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
R=/tmp/${SESSION}_$PART; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
save() { tar -C /tmp -czf "$OUT/$PART.tgz.tmp" "${SESSION}_$PART" 2>/dev/null && mv -f "$OUT/$PART.tgz.tmp" "$OUT/$PART.tgz"; }
# also every 20 s in the background: a call cut at its limit (or at the session's device budget) mid-step keeps
# that step's partial JSON (the suites, tune and auto-vs-best write theirs after every shape)
( while sleep 20; do save; done ) >/dev/null 2>&1 </dev/null &
SAVER=$!
trap 'kill $SAVER 2>/dev/null; save' EXIT
fa4_step1() { mkdir -p /tmp/fa4 && xz -dc .fa4a/ir.so.xz > /tmp/fa4/ir.so && echo "fa4 step 1 done"; }
fa4_env() {   # a later call on the same warm machine: FA4 is still unpacked under /tmp
  [ -d /tmp/fa4site ] || { echo "fa4 not installed on this machine (a fresh one)"; return 0; }
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_kernel_cache
}
fa4_step2() {
  bash .fa4b/install.sh 2>&1 | tail -3 | tee "$R/fa4_install.log"
  fa4_env
}
programmable_tier() {
  FLASHPORT_MODS_FUZZ_N=${MODS_N:-100} FLASHPORT_MODS_FUZZ_N_FLEX=${FLEX_N:-40} FLASHPORT_MODS_FUZZ_N_TRITON=${TRITON_N:-100} \
      timeout "$1" python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
      --durations=10 tests/gpu/test_programmable_gpu.py > "$R/programmable_gpu.log" 2>&1
  echo "programmable tier rc=$?"; grep -E "passed|failed|^FAIL|^ERROR|^E " "$R/programmable_gpu.log" | cut -c1-300 | head -20
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
