#!/usr/bin/env bash
# The 24th session's first device calls: what decides whether the Gluon variants behind switches go on by default
# (the 23rd session's H100 call passed their bf16 GPU-tier cases that ran and timed them once, PERFLOG rows 78-89).
# Each part returns $OUT/<part>.tgz (session.sh):
#   PART=t: the variant cases of the Hopper GPU tiers in both dtypes (window, split, ALiBi; ~95 cases, each new
#          variant a compile), then the GPU fuzz with those switches on (FUZZ_N, default 300: "hundreds of hits")
#   PART=u: tools/gpu/probe_hopper_variants.py in alternating rounds (the card drifts ~10% as it warms: row 87), the
#          pin / ping-pong / dQ-first cases first (rows 87-89 were inconclusive or negative), then the rest
#   PART=A (carry .fa4a, results/ moved out of the tree): FA4 step 1, then what t does (shorter limits, the fuzz 200)
#   PART=B (carry .fa4b, within 30 s of A): FA4 step 2; the GQA group loop and the 128-row tile timed (rows 90,
#          91); with the window / ALiBi / split switches on, the workloads suite's window and D=80 / 96 buckets re-tuned into the shipped H200 table (copied back as
#          $R/selection-nvidia-h200.json), then the workloads suite and the programmable suite with FA4's column
#   PART=C: the D=64 backward's 128-row Q tile (variant m128_s2) against the default: gluon_bwd_probe.py (check and
#          timing, each variant's kernel alone), then its GPU-tier cases (test_m128_tile_conforms)
# Switches that pass t and win in u go on by default in flashport/env.py (PERFLOG rows 78, 79, 81-83, 86).
SESSION=s24; . "$(dirname "$0")/session.sh"
variants_on() { export FLASHPORT_HOPPER_FWD_WINDOW=1 FLASHPORT_HOPPER_BWD_WINDOW=1 FLASHPORT_HOPPER_FWD_SPLIT=1 \
    FLASHPORT_HOPPER_BWD_SPLIT=1 FLASHPORT_HOPPER_FWD_ALIBI=1 FLASHPORT_HOPPER_BWD_ALIBI=1; }
[ "$PART" = A ] && { fa4_step1; VARIANT_SECONDS=${VARIANT_SECONDS:-290} FUZZ_SECONDS=${FUZZ_SECONDS:-140} FUZZ_N=${FUZZ_N:-200}; }
case "$PART" in
B) fa4_step2
   timeout ${PROBE_SECONDS:-120} python tools/gpu/probe_hopper_variants.py --rounds 3 --out "$R/probe_new.jsonl" \
       --only "group loop" m128 2>&1 | grep -v "Warning\|warn(" | tail -16; save
   variants_on
   timeout ${TUNE_SECONDS:-120} python -m flashport tune --suite workloads --match "${TUNE_MATCH:-swa|phi3|vit}" \
       --rounds 2 --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
   echo "tune rc=$?"; tail -4 "$R/tune.log"; cp flashport/configs/selection-nvidia-h200.json "$R/"; save
   mkdir -p "$R/workloads" "$R/programmable"
   timeout ${WORK_SECONDS:-200} python -m flashport bench --suite workloads --out "$R/workloads" \
       --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(" > "$R/workloads/bench.log"
   echo "workloads rc=${PIPESTATUS[0]}"; tail -30 "$R/workloads/bench.log" | cut -c1-160; save
   timeout ${MASK_SECONDS:-110} python -m flashport bench --suite programmable --out "$R/programmable" \
       --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin,builtin-fa4 2>&1 \
       | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
   echo "programmable rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110 ;;
t|A) mkdir -p "$R/tier"
   timeout ${VARIANT_SECONDS:-330} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_bwd_gpu.py tests/gpu/test_hopper_fwd_gpu.py -k "(window or split or alibi) and not m128 and not group_loop" -W ignore \
       > "$R/tier/variants.log" 2>&1
   echo "variants rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/variants.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/variants.log" | cut -c1-240 | head -12; save
   timeout ${NEW_SECONDS:-100} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_bwd_gpu.py -k "(m128 or group_loop) and bfloat16" -W ignore > "$R/tier/new.log" 2>&1
   echo "m128 / group loop rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/new.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/new.log" | cut -c1-240 | head -12; save
   variants_on; FUZZ_N=${FUZZ_N:-300} tier fuzz:${FUZZ_SECONDS:-240}
   grep -E "FAIL|gluon" "$R/tier/fuzz.log" | cut -c1-200 | tail -14 ;;
C) timeout ${PROBE_SECONDS:-240} python tools/gpu/gluon_bwd_probe.py --variants s2_tma_lse m128_s2 --head-dims 64 \
       --budget 200 --rep 60 --out "$R/gluon_bwd_m128.json" 2>&1 | grep -E "^(check|time|ratio|NOTE)" | grep -v PASS | tail -40
   save; mkdir -p "$R/tier"
   timeout ${VARIANT_SECONDS:-200} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_bwd_gpu.py -k m128 -W ignore > "$R/tier/m128.log" 2>&1
   echo "m128 rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/m128.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/m128.log" | cut -c1-240 | head -12 ;;
u) timeout ${PROBE_SECONDS:-540} python tools/gpu/probe_hopper_variants.py --rounds 3 --out "$R/probe_hopper_variants.jsonl" \
       --only pin "dq first" window ALiBi "D=96" "D=80" 2>&1 | grep -v "Warning\|warn(" | tail -40 ;;
esac
save; ls -la "$OUT"
