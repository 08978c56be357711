#!/usr/bin/env bash
# The next session's device calls, on one warm machine; each part returns $OUT/<part>.tgz (rewritten after every
# step and every 20 s, so a call cut at its limit still brings back what finished):
#   PART=a (carry .fa4a): FA4 step 1; the Hopper forward's and backward's GPU tiers with the cases of the variants
#          built without a GPU (PERFLOG rows 78, 79, 81-83, 86: test_window_calls_conform, test_split_head_dims_conform
#          and test_alibi_calls_conform set their switches)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; tools/gpu/probe_hopper_variants.py (rows 78-83's timings,
#          switches off and on, one process); the programmable suite with every peer (builtin-fa4: row 80, FA4's
#          varlen through the backend), the new variants' switches on where part a found them green (NEW=1)
#   PART=c (FA4 still installed): the rest of the GPU tier, file by file, with a fresh machine's limits (the fuzz
#          with the new variants' switches on)
#   PART=d: the programmable GPU tier, one limit per test (mods fuzz counts 100 / 40 / 40)
#   PART=e: tools/gpu/hopper_fwd_ab.py at D = 80, 96 (row 81's length floors, a deeper ring, outputs vs Triton/cuDNN)
#   PART=s: one call where the device budget allows only one (no FA4): the GPU-tier tests of the variants behind
#          switches only (window, split, ALiBi, pin, ping-pong, dQ first; bf16), their timings
#          (probe_hopper_variants.py), then the fuzz tier with every switch on (~450 s in all)
# Call a carries .fa4a (48 MiB), and the working tree (~17 MiB, results/ ~15 of it) with it passes the device's
# 64 MiB: move results/ out of the tree for that call and back after (the 22nd session did), e.g.
#   mv results /tmp/results_hold  ...  mv /tmp/results_hold results
SESSION=${SESSION:-s23}; . "$(dirname "$0")/session.sh"
case "$PART" in
a)
  fa4_step1
  tier hopper_fwd:270 hopper_bwd:300   # ~55 more cases than in the 21st session, each new variant a compile
  ;;
b)
  fa4_step2
  timeout ${PROBE_SECONDS:-180} python tools/gpu/probe_hopper_variants.py --out "$R/probe_hopper_variants.jsonl" 2>&1 \
      | grep -v "Warning\|warn(" | tail -24; save
  mkdir -p "$R/programmable"
  FLASHPORT_HOPPER_FWD_WINDOW=${NEW:-0} FLASHPORT_HOPPER_BWD_WINDOW=${NEW:-0} FLASHPORT_HOPPER_FWD_ALIBI=${NEW:-0} \
      FLASHPORT_HOPPER_BWD_ALIBI=${NEW:-0} timeout ${MASK_SECONDS:-360} python -m flashport bench --suite programmable --out "$R/programmable" --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin,builtin-fa4 2>&1 \
      | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110
  ;;
e) # PERFLOG row 81's floors and ring depth: the two-part head dims against Triton and cuDNN in one process, the
   # table's rings against one stage deeper (D=96: 4 stages, 216 KiB; D=80: 5, 220 KiB), outputs compared per cell
   timeout ${AB_SECONDS:-300} python tools/gpu/hopper_fwd_ab.py --out "$R/hopper_fwd_ab_split.json" --d 80 96 \
       --variant 96:128:4:240 --variant 80:128:5:240 --budget-s 240 --suggest 2>&1 | tail -30 ;;
c) fa4_env   # the fuzz with the new variants' switches on, so its Gluon regimes reach them (rows 78, 79, 81-83)
   tier contents:40 decode:50 compile:100 operability:100 triton:150
   FLASHPORT_HOPPER_FWD_WINDOW=1 FLASHPORT_HOPPER_BWD_WINDOW=1 FLASHPORT_HOPPER_FWD_SPLIT=1 FLASHPORT_HOPPER_FWD_ALIBI=1 \
       FLASHPORT_HOPPER_BWD_ALIBI=1 FLASHPORT_HOPPER_BWD_SPLIT=1 tier fuzz:200 ;;
d) fa4_env; TRITON_N=${TRITON_N:-40} programmable_tier ${PROG_SECONDS:-500} ;;
s) mkdir -p "$R/tier"
   timeout ${VARIANT_SECONDS:-200} python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_bwd_gpu.py tests/gpu/test_hopper_fwd_gpu.py -k "(window or split or alibi or pin or pingpong or dq_first) and not torch.float16" \
       > "$R/tier/variants.log" 2>&1
   echo "variants rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/variants.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/variants.log" | cut -c1-240 | head -12; save
   timeout ${PROBE_SECONDS:-190} python tools/gpu/probe_hopper_variants.py --out "$R/probe_hopper_variants.jsonl" 2>&1 \
       | grep -v "Warning\|warn(" | tail -30; save
   FUZZ_N=${FUZZ_N:-80} FLASHPORT_HOPPER_FWD_WINDOW=1 FLASHPORT_HOPPER_BWD_WINDOW=1 FLASHPORT_HOPPER_FWD_SPLIT=1 \
       FLASHPORT_HOPPER_FWD_ALIBI=1 FLASHPORT_HOPPER_BWD_ALIBI=1 FLASHPORT_HOPPER_BWD_SPLIT=1 FLASHPORT_HOPPER_FWD_PIN=1 \
       FLASHPORT_HOPPER_FWD_PINGPONG=1 FLASHPORT_HOPPER_BWD_DQ_FIRST=1 tier fuzz:${FUZZ_SECONDS:-50}
   grep -E "PASS|FAIL|hits|gluon" "$R/tier/fuzz.log" | cut -c1-200 | tail -12 ;;
esac
save; ls -la "$OUT"
