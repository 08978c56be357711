#!/usr/bin/env bash
# The 25th session's device calls.  What decides whether the Gluon variants behind switches go on by default: the
# 24th session's H100 calls passed 80 of the 95 variant GPU-tier cases (both dtypes; none failed) and the GPU fuzz
# with their switches on (400 cases, 37 Gluon hits); the rule is hundreds of fuzz hits, which the fuzz's Hopper focus
# (--entries hopper: ~350 of 400 cases on a Gluon regime) gives in one call.  Each part returns $OUT/<part>.tgz.
#   PART=f (one call, ~430 s, any sm_90 card, no FA4): the Hopper-focused fuzz with the window / ALiBi / split
#          switches on (per-variant hits in the summary: gluon_fwd:window, gluon_bwd:split, ...); the 15 variant
#          cases the 24th session did not reach (the forward's ALiBi cases, one fp16 split case); the SDXL
#          cross-attention cell taken apart (tools/gpu/probe_cell.py, PERFLOG row 92); ragged paged decode with
#          FLASHPORT_DECODE_FIXED_CHUNKS 0 / 1 alternating (row 93)
#   PART=a (carry .fa4a, results/ moved out of the tree) then PART=b (carry .fa4b, within 30 s), on an H200: FA4's
#          two steps, then the workloads suite with FA4's column; PART=c on the same warm machine: the programmable
#          suite.  The variant switches as flashport/env.py has them (on by default once part f passes: then also
#          `flashport tune --suite workloads` on the H200 for their buckets; tune refuses another card's table)
SESSION=s25; . "$(dirname "$0")/session.sh"
variants_on() { export FLASHPORT_HOPPER_FWD_WINDOW=1 FLASHPORT_HOPPER_BWD_WINDOW=1 FLASHPORT_HOPPER_FWD_SPLIT=1 \
    FLASHPORT_HOPPER_BWD_SPLIT=1 FLASHPORT_HOPPER_FWD_ALIBI=1 FLASHPORT_HOPPER_BWD_ALIBI=1; }
case "$PART" in
g) mkdir -p "$R/tier"; export FLASHPORT_TRITON_DIRECT=1   # one call, any sm_90 card, no FA4: the direct launches of the Triton kernels (row 96) checked
   #   and timed, the Gluon variants (on by default now) fuzzed again (~420 s)
   tier triton:${TRITON_SECONDS:-100}
   grep -E "^FAILED|Error" "$R/tier/triton.log" | cut -c1-240 | head -8
   timeout ${FUZZ_TRITON_SECONDS:-80} python -m flashport.fuzz --backend triton --n ${FUZZ_TRITON_N:-1000} --seed 2503 \
       --dtype bfloat16,float16,float32 --device cuda --max-seconds $(( ${FUZZ_TRITON_SECONDS:-80} - 25 )) \
       --log "$R/fuzz_triton.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_triton.log"
   echo "fuzz triton rc=${PIPESTATUS[0]}"; grep -E "status:|cases in|^attention|^attention_" "$R/fuzz_triton.log" | head -8; save
   timeout ${AB_SECONDS:-90} python tools/gpu/host_ab_direct.py --out "$R/host_ab_direct.json" 2>&1 | grep -v Warning
   save
   timeout ${FUZZ_SECONDS:-80} python -m flashport.fuzz --entries hopper --n ${FUZZ_N:-1800} --seed 2502 \
       --dtype bfloat16,float16 --device cuda --max-seconds $(( ${FUZZ_SECONDS:-80} - 30 )) \
       --log "$R/fuzz_hopper.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_hopper.log"
   echo "fuzz hopper rc=${PIPESTATUS[0]}"; grep -E "status:|gluon_(fwd|bwd)" "$R/fuzz_hopper.log" | head -12; save
   for fixed in 1 0; do   # PERFLOG row 93 (decode is timed for flashport-triton: bench/peers.DECODE)
     FLASHPORT_DECODE_FIXED_CHUNKS=$fixed timeout 40 python -m flashport bench --suite workloads --match "ragged" \
         --peers flashport-triton --out "$R/decode_fixed$fixed" --tag "r$RANDOM" 2>&1 | grep -E "ragged" | tail -1 | cut -c1-200
   done ;;
h) mkdir -p "$R/workloads"; export FLASHPORT_TRITON_DIRECT=${FLASHPORT_TRITON_DIRECT:-1}   # the same card after g: the buckets the variants changed re-tuned, then the workloads suite
   cp flashport/configs/selection-nvidia-h200.json "$R/selection-before.json"
   [[ "$(cat "$R/card.txt")" == *H200* ]] && { timeout ${TUNE_SECONDS:-150} python -m flashport tune --suite workloads \
       --match "swa|phi3|vit|dit" --rounds 2 --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
     echo "tune rc=$?"; tail -6 "$R/tune.log"; cp flashport/configs/selection-nvidia-h200.json "$R/"; save; }
   timeout ${WORK_SECONDS:-420} python -m flashport bench --suite workloads --out "$R/workloads" \
       --peers flashport,flashport-triton,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(" > "$R/workloads/bench.log"
   echo "workloads rc=${PIPESTATUS[0]}"; grep -E " ok " "$R/workloads/bench.log" | grep "flashport " | cut -c1-150 ;;
f) ( variants_on
     timeout ${FUZZ_SECONDS:-230} python -m flashport.fuzz --entries hopper --n ${FUZZ_N:-900} --seed 25 \
         --dtype bfloat16,float16 --device cuda --max-seconds $(( ${FUZZ_SECONDS:-230} - 40 )) \
         --log "$R/fuzz_hopper.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_hopper.log"
     echo "fuzz rc=${PIPESTATUS[0]}"; grep -E "status:|gluon" "$R/fuzz_hopper.log" | head -24 ); save
   mkdir -p "$R/tier"
   timeout ${VARIANT_SECONDS:-110} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
       tests/gpu/test_hopper_fwd_gpu.py -k "alibi_calls or (split_head and torch.float16)" -W ignore > "$R/tier/fwd_rest.log" 2>&1
   echo "fwd rest rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/tier/fwd_rest.log" | tail -1)"
   grep -E "^FAILED|Error" "$R/tier/fwd_rest.log" | cut -c1-240 | head -12; save
   timeout ${CELL_SECONDS:-70} python tools/gpu/probe_cell.py --out "$R/cell_sdxl.json" 2>&1 | grep -v "Warning" \
       | head -60; save
   for fixed in 0 1 0 1; do   # PERFLOG row 93: ragged paged decode with the fixed key chunks, alternating
     FLASHPORT_DECODE_FIXED_CHUNKS=$fixed timeout 60 python -m flashport bench --suite workloads --match "ragged|spec-verify" \
         --peers flashport-triton,sdpa-cudnn --out "$R/decode_fixed$fixed" --tag "r$RANDOM" 2>&1 | grep -E "ragged|verify" | tail -4
   done ;;
a) fa4_step1 ;;
b) fa4_step2; variants_on   # the switches as part f's verdict turns them on by default
   timeout ${FUZZ_SECONDS:-150} python -m flashport.fuzz --entries hopper --n ${FUZZ_N:-2400} --seed 2501 \
       --dtype bfloat16,float16 --device cuda --max-seconds $(( ${FUZZ_SECONDS:-150} - 40 )) \
       --log "$R/fuzz_hopper_h200.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_hopper_h200.log"
   echo "fuzz rc=${PIPESTATUS[0]}"; grep -E "status:|gluon" "$R/fuzz_hopper_h200.log" | head -24; save
   mkdir -p "$R/workloads"   # the dense shapes (9 of 17 x 6 peers; the 24th session's H100 ran 11 in ~430 s)
   timeout ${WORK_SECONDS:-400} python -m flashport bench --suite workloads --out "$R/workloads" \
       --match "llama3|mistral|gemma2|phi3|vit|dit|deepseek|fa3|sdxl" \
       --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(\|exe_args" \
       > "$R/workloads/bench.log"
   echo "workloads rc=${PIPESTATUS[0]}"; tail -30 "$R/workloads/bench.log" | cut -c1-160 ;;
c) fa4_env; variants_on; mkdir -p "$R/workloads" "$R/programmable"   # the same warm machine, after b
   timeout ${WORK_SECONDS:-150} python -m flashport bench --suite workloads --out "$R/workloads" \
       --match "packed|chunked|spec|ragged" \
       --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(\|exe_args" \
       > "$R/workloads/bench.log"
   echo "workloads rest rc=${PIPESTATUS[0]}"; grep -E " ok | n/a " "$R/workloads/bench.log" | cut -c1-150 | head -30; save
   timeout ${MASK_SECONDS:-300} python -m flashport bench --suite programmable --out "$R/programmable" \
       --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin,builtin-fa4 2>&1 \
       | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
   echo "programmable rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110; save
   for fixed in 1 0 1; do   # PERFLOG row 93 (decode is timed for flashport-triton: bench/peers.DECODE)
     FLASHPORT_DECODE_FIXED_CHUNKS=$fixed timeout 40 python -m flashport bench --suite workloads --match "ragged" \
         --peers flashport-triton --out "$R/decode_fixed$fixed" --tag "r$RANDOM" 2>&1 | grep -E "ragged" | tail -2
   done; save
   cp flashport/configs/selection-nvidia-h200.json "$R/selection-before.json"   # the buckets the switches changed
   timeout ${TUNE_SECONDS:-90} python -m flashport tune --suite workloads --match "swa|phi3|vit|dit" \
       --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
   echo "tune rc=$?"; tail -8 "$R/tune.log"; cp flashport/configs/selection-nvidia-h200.json "$R/" ;;
esac
save; ls -la "$OUT"
