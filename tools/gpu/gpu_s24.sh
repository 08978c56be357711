#!/usr/bin/env bash
# The 24th session's first device calls: what decides whether the Gluon variants behind switches go on by default
# (the 23rd session's H100 call passed their bf16 GPU-tier cases that ran and timed them once, PERFLOG rows 78-89).
# Each part returns $OUT/<part>.tgz (session.sh):
#   PART=t: the variant cases of the Hopper GPU tiers in both dtypes (window, split, ALiBi; ~95 cases, each new
#          variant a compile), then the GPU fuzz with those switches on (FUZZ_N, default 300: "hundreds of hits")
#   PART=u: tools/gpu/probe_hopper_variants.py in alternating rounds (the card drifts ~10% as it warms: row 87), the
#          pin / ping-pong / dQ-first cases first (rows 87-89 were inconclusive or negative), then the rest
# FA4 and the programmable suite: `SESSION=s24 PART=a|b|... bash tools/gpu/gpu_s23.sh` (two calls for FA4).
# Switches that pass t and win in u go on by default in flashport/env.py (PERFLOG rows 78, 79, 81-83, 86).
SESSION=s24; . "$(dirname "$0")/session.sh"
case "$PART" in
t) mkdir -p "$R/tier"
   timeout ${VARIANT_SECONDS:-330} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_bwd_gpu.py tests/gpu/test_hopper_fwd_gpu.py -k "window or split or alibi" -W ignore \
       > "$R/tier/variants.log" 2>&1
   echo "variants rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/variants.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/variants.log" | cut -c1-240 | head -12; save
   FUZZ_N=${FUZZ_N:-300} FLASHPORT_HOPPER_FWD_WINDOW=1 FLASHPORT_HOPPER_BWD_WINDOW=1 FLASHPORT_HOPPER_FWD_SPLIT=1 \
       FLASHPORT_HOPPER_BWD_SPLIT=1 FLASHPORT_HOPPER_FWD_ALIBI=1 FLASHPORT_HOPPER_BWD_ALIBI=1 tier fuzz:${FUZZ_SECONDS:-240}
   grep -E "FAIL|gluon" "$R/tier/fuzz.log" | cut -c1-200 | tail -14 ;;
u) timeout ${PROBE_SECONDS:-540} python tools/gpu/probe_hopper_variants.py --rounds 3 --out "$R/probe_hopper_variants.jsonl" \
       --only pin "dq first" window ALiBi "D=96" "D=80" 2>&1 | grep -v "Warning\|warn(" | tail -40 ;;
esac
save; ls -la "$OUT"
