#!/usr/bin/env bash
# The next session's device calls (the 20th session's left-overs), on one warm machine; each part returns
# $OUT/<part>.tgz (rewritten after every step and every 20 s, so a call cut at its limit still brings back what
# finished):
#   PART=a (carry .fa4a): FA4 step 1; the GPU tier outside the programmable tests, file by file, each with its own
#          time limit and log, so a slow file cannot hide the verdicts of the others (one 330 s run was cut at 43%)
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; the programmable mask cases with every peer (served_by shows
#          each cell's plan; PERFLOG row 73's merge); `flashport tune --suite models` with FA4 eligible, merged into
#          the shipped table, and the models suite's auto-vs-best (PERFLOG row 71)
#   PART=c (no carry, FA4 still installed from b): the programmable GPU tier (each failing fuzz case printed as it
#          happens); the long and decode suites with the FA4 column
#   PART=d (no carry): Nsight Compute of the D=256 backwards against FA4 (tools/gpu/ncu_cells.py)
#   PART=f (any machine): the sinks' dense backward A/B and profile, the sinks case beside Flex, flex with
#          retain_graph, the first failing flex fuzz cases named
SESSION=s21; . "$(dirname "$0")/session.sh"
TABLE=$(python -c "import torch; from flashport import table; print(table.shipped_path(torch.device('cuda')))")
case "$PART" in
a)
  fa4_step1
  tier compile:40 contents:40 decode:40 hopper_fwd:60 hopper_bwd:60 operability:60 triton:100 fuzz:110
  ;;
b)
  fa4_step2
  mkdir -p "$R/programmable" "$R/autobest"
  timeout ${MASK_SECONDS:-260} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport,flex,flex-flash,fa4,builtin --match "document|prefix|sinks|alibi|plain" \
      2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable masks rc=${PIPESTATUS[0]}"; tail -12 "$R/programmable/bench.log"; save
  cp "$TABLE" "$R/table_before.json" 2>/dev/null
  timeout ${TUNE_SECONDS:-170} python -m flashport tune --suite models --rounds 2 --out "$TABLE" > "$R/tune.log" 2>&1
  echo "tune rc=$?"; grep -v "Warning\|warn" "$R/tune.log" | tail -10
  cp "$TABLE" "$R/table_after.json"; save
  timeout ${AUTO_SECONDS:-140} python -m flashport bench --suite models --auto-vs-best --rounds 3 \
      --out "$R/autobest" > "$R/autobest/bench.log" 2>&1
  echo "auto-vs-best rc=$?"; grep -v "Warning\|warn" "$R/autobest/bench.log" | tail -12
  ;;
c)
  fa4_env
  mkdir -p "$R/long" "$R/decode"
  programmable_tier ${PROG_SECONDS:-220}
  save
  timeout ${LONG_SECONDS:-170} python -m flashport bench --suite long --out "$R/long" > "$R/long/bench.log" 2>&1
  echo "long rc=$?"; grep -v "Warning\|warn" "$R/long/bench.log" | tail -10; save
  timeout ${DECODE_SECONDS:-170} python -m flashport bench --suite decode --out "$R/decode" > "$R/decode/bench.log" 2>&1
  echo "decode rc=$?"; grep -v "Warning\|warn" "$R/decode/bench.log" | tail -16
  ;;
d)
  fa4_env
  mkdir -p "$R/ncu"
  for cell in "fa3-hdim256:bwd" "gemma2-9b b:bwd"; do
    for impl in flashport-triton fa4; do
      name=$(echo "${cell%%:*}_${cell##*:}_$impl" | tr -c 'a-z0-9_\n-' '_')
      timeout ${NCU_SECONDS:-70} ncu --profile-from-start off --clock-control none --csv --page details \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          python tools/gpu/ncu_cells.py --cell "${cell%%:*}" --impl $impl --mode "${cell##*:}" > "$R/ncu/$name.csv" 2>&1
      echo "$name rc=$? $(grep -c '"Duration"' "$R/ncu/$name.csv") kernels"; save
    done
  done
  ;;
f)  # (a fresh machine, no FA4) the 21st session's last call: the sinks' dense backward A/B and profile (PERFLOG
   # row 74), the sinks case with Flex beside it, flex with retain_graph, and the first failing flex fuzz cases named
  mkdir -p "$R/programmable"
  timeout 100 python tools/gpu/probe_sinks.py --out "$R/probe_sinks.jsonl" --flex-seconds 45 2>&1 \
      | grep -v "Warning\|warn(\|AOTAutograd" | tail -40; save
  timeout 70 python -m flashport bench --suite programmable --out "$R/programmable" --peers flashport,flex \
      --match "sinks" 2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "sinks suite rc=${PIPESTATUS[0]}"; grep -E " ok | failed " "$R/programmable/bench.log" | cut -c1-110; save
  timeout 60 python -m pytest -q -s -p no:cacheprovider -p no:logging --tb=short -rfE \
      tests/gpu/test_programmable_gpu.py -k "retain_graph or recompile" > "$R/flex_tests.log" 2>&1
  echo "flex tests rc=$? $(grep -E '[0-9]+ (passed|failed)' "$R/flex_tests.log" | tail -1)"
  ;;
esac
save; ls -la "$OUT"
