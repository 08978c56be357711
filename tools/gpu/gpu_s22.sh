#!/usr/bin/env bash
# The next session's device calls, on one warm machine; each part returns $OUT/<part>.tgz (rewritten after every
# step and every 20 s, so a call cut at its limit still brings back what finished):
#   PART=a (carry .fa4a): FA4 step 1; tools/gpu/probe_sinks.py (PERFLOG rows 74, 76, 77: the window + sinks case with
#          each of the 21st session's changes switched off in turn, its pieces, cross-attention over 77 keys, a
#          profile, the first failing flex fuzz cases named); the programmable GPU tier, one limit per test
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; the programmable suite, every case and peer
#   PART=c (FA4 still installed from b): on an H200 `flashport tune --suite models` with FA4 (its models buckets
#          predate FA4); on an H100, whose table holds only the models shapes (21st session), the standard suite;
#          then that suite's auto-vs-best
#   PART=d, e (no carry): the GPU tier outside the programmable tests, file by file, with the limits a fresh machine
#          needed in the 21st session (compile 50 s, hopper_fwd 50, hopper_bwd 47, operability 51, triton 76)
SESSION=s22; . "$(dirname "$0")/session.sh"
TABLE=$(python -c "import torch; from flashport import table; print(table.shipped_path(torch.device('cuda')))")
case "$PART" in
a)
  fa4_step1
  timeout ${PROBE_SECONDS:-170} python tools/gpu/probe_sinks.py --out "$R/probe_sinks.jsonl" --flex-seconds 45 2>&1 \
      | grep -v "Warning\|warn(\|AOTAutograd" | tail -40; save
  programmable_tier ${PROG_SECONDS:-300}
  ;;
b)
  fa4_step2
  mkdir -p "$R/programmable"
  timeout ${MASK_SECONDS:-400} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin 2>&1 \
      | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110
  ;;
c)
  fa4_env
  mkdir -p "$R/autobest"
  SUITE=models; grep -q "H100" "$R/card.txt" && SUITE=standard
  cp "$TABLE" "$R/table_before.json" 2>/dev/null
  timeout ${TUNE_SECONDS:-240} python -m flashport tune --suite $SUITE --rounds 2 --out "$TABLE" > "$R/tune.log" 2>&1
  echo "tune $SUITE rc=$?"; grep -v "Warning\|warn" "$R/tune.log" | tail -10
  cp "$TABLE" "$R/table_after.json"; save
  timeout ${AUTO_SECONDS:-200} python -m flashport bench --suite $SUITE --auto-vs-best --rounds 3 \
      --out "$R/autobest" > "$R/autobest/bench.log" 2>&1
  echo "auto-vs-best rc=$?"; grep -v "Warning\|warn" "$R/autobest/bench.log" | tail -4
  ;;
d) tier contents:40 decode:50 compile:100 hopper_fwd:110 hopper_bwd:110 operability:100 ;;
e) tier triton:150 fuzz:200 ;;
esac
save; ls -la "$OUT"
