#!/usr/bin/env bash
# The 20th session's device calls, on one warm machine; each part returns $OUT/<part>.tgz (rewritten after every
# step and every 20 s, so a call cut at its limit still brings back what finished).  a + b hold issue [15]'s evidence:
#   PART=a (carry .fa4a): FA4 step 1; the programmable GPU tier (mods fuzz on blockwise, flex and triton, block
#          masks, table gradients); the learnable table and the dense bias at D = 64, 128, 256 against Flex on
#          Triton; the table's gradient element by element (FLASHPORT_CAP_GRAD_SUMS=0) for the A/B
#   PART=b (carry .fa4b, within 30 s of a): FA4 step 2; the programmable suite's mask cases with every peer in one
#          process; `flashport tune` of the packed-varlen workloads (FA4's varlen a candidate), merged into the
#          shipped table of this card, and their auto-vs-best
#   PART=c (no carry, FA4 still installed from b): the rest of the GPU tier (fuzz counts capped); the models suite
#          with the FA4 column
# Ran in the 20th session: a, b, c, then two Nsight Compute calls by hand (results/INDEX.md); the long and decode
# suites and the other ncu cells moved to tools/gpu/gpu_s21.sh.
SESSION=s20; . "$(dirname "$0")/session.sh"
TABLE=$(python -c "import torch; from flashport import table; print(table.shipped_path(torch.device('cuda')))")
case "$PART" in
a)
  fa4_step1
  mkdir -p "$R/learnable" "$R/elementwise"
  programmable_tier ${PROG_SECONDS:-190}
  save
  timeout ${LEARN_SECONDS:-240} python -m flashport bench --suite programmable --out "$R/learnable" \
      --peers flashport,flashport-triton,flex --match "rel-table|dense-bias" \
      2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/learnable/bench.log"
  echo "learnable rc=${PIPESTATUS[0]}"; tail -14 "$R/learnable/bench.log"; save
  FLASHPORT_CAP_GRAD_SUMS=0 timeout ${ELEM_SECONDS:-70} python -m flashport bench --suite programmable \
      --out "$R/elementwise" --peers flashport-triton --match "rel-table.*d64" > "$R/elementwise/bench.log" 2>&1
  echo "element-by-element rc=$?"; tail -4 "$R/elementwise/bench.log"
  ;;
b)
  fa4_step2
  mkdir -p "$R/programmable" "$R/autobest"
  timeout ${MASK_SECONDS:-320} python -m flashport bench --suite programmable --out "$R/programmable" \
      --peers flashport,flashport-triton,flex,flex-flash,fa4,builtin --match "document|prefix|sinks|alibi|plain" \
      2>&1 | grep -v "aux_data\|exe_args\|Warning" > "$R/programmable/bench.log"
  echo "programmable masks rc=${PIPESTATUS[0]}"; tail -12 "$R/programmable/bench.log"; save
  cp "$TABLE" "$R/table_before.json" 2>/dev/null
  timeout ${TUNE_SECONDS:-120} python -m flashport tune --suite workloads --match packed-docs --rounds 2 \
      --out "$TABLE" > "$R/tune.log" 2>&1
  echo "tune rc=$?"; grep -v "Warning\|warn" "$R/tune.log" | tail -8
  cp "$TABLE" "$R/table_after.json"; save
  timeout ${AUTO_SECONDS:-100} python -m flashport bench --suite workloads --auto-vs-best --rounds 3 \
      --match "packed-docs" --out "$R/autobest" > "$R/autobest/bench.log" 2>&1
  echo "auto-vs-best rc=$?"; grep -v "Warning\|warn" "$R/autobest/bench.log" | tail -10
  ;;
c)
  fa4_env
  mkdir -p "$R/models"
  FLASHPORT_FUZZ_N=${FUZZ_N:-150} FLASHPORT_COMPILED_FUZZ_N=${COMPILED_N:-60} \
      timeout ${REST_SECONDS:-330} python -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE \
      --durations=15 tests/gpu --ignore=tests/gpu/test_programmable_gpu.py > "$R/gpu_tier.log" 2>&1
  echo "gpu tier rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^E " "$R/gpu_tier.log" | cut -c1-300 | head -30
  save
  timeout ${MODELS_SECONDS:-220} python -m flashport bench --suite models --out "$R/models" > "$R/models/bench.log" 2>&1
  echo "models rc=$?"; grep -v "Warning\|warn" "$R/models/bench.log" | tail -16
  ;;
esac
save; ls -la "$OUT"
