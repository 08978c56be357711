#!/usr/bin/env bash
# The 28th session's device calls.  Each part returns $OUT/<part>.tgz (results under /tmp/s28_<part>).
#   PART=g (one call, ~500 s, any sm_90 card, no FA4): an auto fuzz with FLASHPORT_CUDNN_FIRST=1 (row 97: cuDNN
#          first where no table bucket fits, counted by its backend:sdpa-cudnn line); the triton GPU tier and a triton
#          fuzz (direct launches, row 96); the SDXL cell's backend=None vs backend='triton' host time with the order
#          reversed per round (row 92: a first-measured penalty?); ragged paged decode with
#          FLASHPORT_DECODE_FIXED_CHUNKS 1 / 0 (row 93)
#   PART=t1 / t2 (~550 / ~450 s, any sm_90): the GPU tier files this session's limits cut (hopper_fwd, hopper_bwd;
#          triton, compile, operability), with limits a fresh machine's compiles fit in
#   The 28th session had no device: its parts are the 27th's, with new fuzz seeds; part k's fuzz and part b's
#   programmable tier now also cover the 28th session's mod_state memo (stateful lambda cases of the mods fuzz).
#   PART=k (~320 s, any sm_90): after cuDNN-first's flip, the fixed q_chunks test, the operability tier (the leak test
#          runs the shipped defaults), an auto fuzz with every default, and probe_static_mla.py
#   PART=i (the same warm card after g, ~150 s, any sm_90): row 97's rule measured where it acts -- backend=None with
#          the table off, FLASHPORT_CUDNN_FIRST 0 / 1 alternating, beside cuDNN, on shapes no table bucket holds
#          (tools/gpu/static_ab.py)
#   PART=h (the same warm card if an H200, ~580 s): the table's buckets the Gluon variants changed re-tuned, with the
#          SDXL cell's, then the workloads suite with every peer but FA4 (FLASHPORT_CUDNN_FIRST as the caller sets)
#   PART=a (carry .fa4a, results/ moved out of the tree; ahead of g in the same call) then PART=b (carry .fa4b, within
#          30 s), on an H200: FA4's two steps, the programmable suite with every peer and the programmable GPU tier
#          (issue [15]); PART=c on the same warm machine: the workloads suite with FA4's column (issues [8], [14])
SESSION=s28; . "$(dirname "$0")/session.sh"
case "$PART" in
g) export FLASHPORT_TRITON_DIRECT=1   # the cuDNN-first fuzz first: the flip of row 97's default waits on it
   FLASHPORT_CUDNN_FIRST=1 FLASHPORT_TABLE=off timeout ${FUZZ_SECONDS:-150} python -m flashport.fuzz --n ${FUZZ_N:-3000} \
       --entries hopper,attention --seed 2805 --dtype bfloat16,float16 --device cuda --max-seconds $(( ${FUZZ_SECONDS:-150} - 25 )) \
       --log "$R/fuzz_cudnn_first.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_cudnn_first.log"
   echo "fuzz cudnn-first rc=${PIPESTATUS[0]}"; grep -E "status:|cases in|backend:" "$R/fuzz_cudnn_first.log" | head -12; save
   tier triton:${TRITON_SECONDS:-100}
   grep -E "^FAILED|Error" "$R/tier/triton.log" | cut -c1-240 | head -8
   timeout ${FUZZ_TRITON_SECONDS:-60} python -m flashport.fuzz --backend triton --n ${FUZZ_TRITON_N:-1000} --seed 2803 \
       --dtype bfloat16,float16,float32 --device cuda --max-seconds $(( ${FUZZ_TRITON_SECONDS:-60} - 20 )) \
       --log "$R/fuzz_triton.jsonl" 2>&1 | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_triton.log"
   echo "fuzz triton rc=${PIPESTATUS[0]}"; grep -E "status:|cases in" "$R/fuzz_triton.log" | head -4; save
   timeout ${CELL_SECONDS:-50} python tools/gpu/probe_cell.py --rounds 3 --out "$R/cell_sdxl_rounds.json" 2>&1 \
       | grep -E "^round|plan="; save
   for fixed in 1 0; do   # decode rows time flashport-triton (bench/peers.DECODE)
     FLASHPORT_DECODE_FIXED_CHUNKS=$fixed timeout 40 python -m flashport bench --suite workloads --match "ragged" \
         --peers flashport-triton --out "$R/decode_fixed$fixed" --tag "r$RANDOM" 2>&1 | grep -E "ragged" | tail -1 | cut -c1-200
   done ;;
t1) tier hopper_fwd:${FWD_SECONDS:-250} hopper_bwd:${BWD_SECONDS:-300}   # the GPU tier whole, in two calls (a fresh
   grep -hE "^FAILED" "$R"/tier/*.log | cut -c1-250 | head -20 ;;      # machine compiles: 110-120 s cut them)
t2) tier triton:${TRITON_SECONDS:-150} compile:${COMPILE_SECONDS:-150} operability:${OPER_SECONDS:-150}
   grep -hE "^FAILED" "$R"/tier/*.log | cut -c1-250 | head -20 ;;
k) timeout 45 python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE tests/gpu/test_triton_gpu.py \
       -k "q_chunks_auto_split" > "$R/qchunks.log" 2>&1; echo "q_chunks rc=$? $(tail -1 "$R/qchunks.log")"; save
   tier operability:${OPER_SECONDS:-100}   # the leak test runs static priority as shipped: cuDNN first since row 97
   timeout ${FUZZ_SECONDS:-110} python -m flashport.fuzz --n 3000 --seed 2806 --dtype bfloat16,float16 --device cuda \
       --max-seconds $(( ${FUZZ_SECONDS:-110} - 25 )) --log "$R/fuzz_default.jsonl" 2>&1 \
       | grep -v "Warning\|^\[fuzz\]" > "$R/fuzz_default.log"   # as a user runs it: the shipped table, every default
   echo "fuzz default rc=${PIPESTATUS[0]}"; grep -E "status:|cases in|backend:" "$R/fuzz_default.log" | head -12; save
   timeout ${MLA_SECONDS:-60} python tools/gpu/probe_static_mla.py --out "$R/probe_static_mla.json" 2>&1 | grep -v Warn \
       | cut -c1-300 ;;
i) timeout ${AB_SECONDS:-170} python tools/gpu/static_ab.py --out "$R/static_ab.json" 2>&1 | grep -v Warning | cut -c1-220 ;;
h) mkdir -p "$R/workloads"
   echo "FLASHPORT_CUDNN_FIRST=${FLASHPORT_CUDNN_FIRST:-default} FLASHPORT_TRITON_DIRECT=${FLASHPORT_TRITON_DIRECT:-default}" \
       | tee "$R/switches.txt"
   cp flashport/configs/selection-nvidia-h200.json "$R/selection-before.json"
   [[ "$(cat "$R/card.txt")" == *H200* ]] && { timeout ${TUNE_SECONDS:-150} python -m flashport tune --suite workloads \
       --match "swa|phi3|vit|dit|sdxl" --rounds 2 --out flashport/configs/selection-nvidia-h200.json > "$R/tune.log" 2>&1
     echo "tune rc=$?"; tail -6 "$R/tune.log"; cp flashport/configs/selection-nvidia-h200.json "$R/"; save; }
   timeout ${WORK_SECONDS:-400} python -m flashport bench --suite workloads --out "$R/workloads" \
       --peers flashport,flashport-triton,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(" > "$R/workloads/bench.log"
   echo "workloads rc=${PIPESTATUS[0]}"; grep -E " ok " "$R/workloads/bench.log" | grep "flashport " | cut -c1-150 ;;
a) fa4_step1 ;;
b) fa4_step2   # issue [15]'s H200 evidence first: the programmable suite with every peer, then its GPU tier
   mkdir -p "$R/programmable"
   timeout ${MASK_SECONDS:-300} python -m flashport bench --suite programmable --out "$R/programmable" \
       --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin,builtin-fa4 2>&1 \
       | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
   echo "programmable rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110; save
   programmable_tier ${TIER_SECONDS:-240}; save ;;
c) fa4_env; mkdir -p "$R/workloads" "$R/workloads_rest"   # the same warm machine, after b
   timeout ${WORK_SECONDS:-400} python -m flashport bench --suite workloads --out "$R/workloads" \
       --match "llama3|mistral|gemma2|phi3|vit|dit|deepseek|fa3|sdxl" \
       --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(\|exe_args" \
       > "$R/workloads/bench.log"
   echo "workloads rc=${PIPESTATUS[0]}"; grep -E " ok | n/a " "$R/workloads/bench.log" | cut -c1-160 | head -40; save
   timeout ${REST_SECONDS:-150} python -m flashport bench --suite workloads --out "$R/workloads_rest" \
       --match "packed|chunked|spec|ragged" \
       --peers flashport,flashport-triton,fa4,sdpa-cudnn,sdpa-fa2,flex 2>&1 | grep -v "Warning\|warn(\|exe_args" \
       > "$R/workloads_rest/bench.log"
   echo "workloads rest rc=${PIPESTATUS[0]}"; grep -E " ok | n/a " "$R/workloads_rest/bench.log" | cut -c1-150 | head -30 ;;
esac
save; ls -la "$OUT"
