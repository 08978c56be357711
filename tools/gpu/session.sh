# Sourced by a session's device script (tools/gpu/gpu_sNN.sh) after `SESSION=sNN`, with PART set and $OUT the
# device's return folder: runs from the repository root on the image's packages, results under $R, and
#   save        rewrites $OUT/$PART.tgz from $R (after every step, every 20 s, and at exit)
#   fa4_step1   FA4's first half (carried as .fa4a): the compiled IR library, unpacked into /tmp/fa4
#   fa4_step2   its second half (.fa4b, within 30 s on the same warm machine): installs it and puts it on PYTHONPATH
#   fa4_env     a later call on that machine: puts the installed FA4 on PYTHONPATH again
#   tier NAME:SECONDS ...   GPU-tier files (tests/gpu/test_NAME_gpu.py), one limit and log each, in $R/tier
#   programmable_tier SECONDS   issue [15]'s GPU tier (tests/gpu/test_programmable_gpu.py, fuzz counts MODS_N /
#               FLEX_N / TRITON_N), one time limit and log per test in $R/programmable_gpu/, failing cases printed
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
tier() {   # GPU tier files "name:seconds ...", each with its own limit and log in $R/tier (fuzz counts FUZZ_N / COMPILED_N)
  mkdir -p "$R/tier"
  local spec f
  for spec in "$@"; do
    f=${spec%%:*}
    FLASHPORT_FUZZ_N=${FUZZ_N:-100} FLASHPORT_COMPILED_FUZZ_N=${COMPILED_N:-40} \
        timeout ${spec##*:} python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
        tests/gpu/test_${f}_gpu.py > "$R/tier/$f.log" 2>&1
    echo "$f rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/$f.log" | tail -1)"; save
  done
}
programmable_tier() {   # SECONDS for the whole tier, shared out per test (a slow one cannot hide the others' verdicts)
  local t=tests/gpu/test_programmable_gpu.py total=$1
  mkdir -p "$R/programmable_gpu"
  for spec in "blockwise:test_mods_fuzz_on_cuda[blockwise]:12" "flex:test_mods_fuzz_on_cuda[flex]:30" \
              "triton:test_mods_fuzz_on_cuda[triton]:30" "auto:test_mods_fuzz_on_cuda[auto]:18" \
              "rest:test_flex_does_not_recompile_for_new_lengths or retain_graph or declared_backend:10"; do
    local name=${spec%%:*} rest=${spec#*:}; local sel=${rest%:*} pct=${rest##*:}
    local args=("$t::$sel"); [[ "$sel" == *" or "* ]] && args=("$t" -k "$sel")
    FLASHPORT_MODS_FUZZ_N=${MODS_N:-100} FLASHPORT_MODS_FUZZ_N_FLEX=${FLEX_N:-40} FLASHPORT_MODS_FUZZ_N_TRITON=${TRITON_N:-40} \
        timeout $(( total * pct / 100 )) python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
        "${args[@]}" > "$R/programmable_gpu/$name.log" 2>&1
    echo "programmable $name rc=$? $(grep -E '[0-9]+ (passed|failed)|PASS, ' "$R/programmable_gpu/$name.log" | tr '\n' ' ' | cut -c1-200)"
    grep -E "^FAIL " "$R/programmable_gpu/$name.log" | cut -c1-300 | head -5
  done
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/card.txt"
