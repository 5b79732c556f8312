#!/usr/bin/env bash
# The acceptance run on a lent GPU box (no network; docs/gpu-lease.md), as the device tool runs it in the repository with
# the wheels folder carried (python scripts/offline_wheels.py --out .whl, beforehand, on a networked machine):
#
#     ROWS="adamw-8bit,long,zero3-offload" BUDGET=520 bash scripts/gpu_lease.sh
#     ROWS=long-8b LONG8B="sdpa:262144,flex_attention:262144" bash scripts/gpu_lease.sh   # long-8b rows at these lengths
#     ROWS=long-8b LONG8B_STEPS=1 bash scripts/gpu_lease.sh   # one step a long-8b row (a row at ~770K takes minutes)
#     ROWS="single-gpu-lora,adamw-8bit,long" ARGS="--exact --no-resume --long-tokens 16384,65536" bash scripts/gpu_lease.sh
#                                                  # speed rows: each plain row with its peers and profile, no resume
#     MASKROWS=32768,73728 ROWS=... bash scripts/gpu_lease.sh   # first, sdpa under a mask at these lengths
#                                                  # (benchmarks/mask_rows.py: seconds; mask_rows.txt in $OUT)
#
# Installs the wheels into /tmp/site (memrecipe itself from this working tree, over its wheel's: a lease never runs
# an older build), runs benchmarks/gpu_acceptance.py on ROWS (its --recipes) until BUDGET seconds
# have passed since the start (the lease's clock: the rows that ran are kept), and leaves in $OUT the table
# (acceptance.md, .json), the box's versions (env.txt), what the allocator held at the peak of each recorded
# history (snapshot_peak.txt) and one archive of every run's report.json and log (runs.tgz: the tool brings back
# only a few files).
set -uo pipefail
START=$(date +%s)
# RUNS: a folder of its own each call (a warm box keeps the last call's runs, whose output folders a row would
# refuse to overwrite)
OUT=${OUT:-/tmp/lease-out} BUDGET=${BUDGET:-520} ROWS=${ROWS:-adamw-8bit} RUNS=$(mktemp -d /tmp/acceptance.XXXX)
mkdir -p "$OUT"
python scripts/offline_wheels.py --out .whl --install /tmp/site > "$OUT/install.log" 2>&1 ||
  { echo "the install failed (a row would die on its imports):"; tail -5 "$OUT/install.log"; exit 1; }
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
{ echo "install: $(( $(date +%s) - START )) s"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nproc; python -c "import torch, transformers, accelerate, peft, datasets; print(torch.__version__, torch.version.cuda,
transformers.__version__, accelerate.__version__, peft.__version__, datasets.__version__)"; } > "$OUT/env.txt" 2>&1
if [ -n "${MASKROWS:-}" ]; then  # does masked sdpa read the mask's right rows past 2^32 / S (seconds)
  timeout 120 python benchmarks/mask_rows.py --tokens "$MASKROWS" --out "$OUT/mask_rows.json" > "$OUT/mask_rows.txt" 2>&1
fi

python benchmarks/gpu_acceptance.py --steps 6 --out "$RUNS" --recipes "$ROWS" ${LONG8B:+--long-8b-tokens "$LONG8B"} ${LONG8B_STEPS:+--long-8b-steps "$LONG8B_STEPS"} ${ARGS:-} \
  > "$OUT/acceptance.log" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  sleep 5
  if (( $(date +%s) - START > BUDGET )); then  # the lease's end: stop the row that runs, keep the table
    echo "stopped at the budget ($BUDGET s)" >> "$OUT/acceptance.log"
    pkill -TERM -P $pid; kill $pid; sleep 3  # (memrecipe run passes TERM on to its workers)
    pkill -9 -f 'memrecipe|recipes/(sft|dpo)\.py'; break  # the workers too, whatever is left
  fi
done
cp "$RUNS"/acceptance.md "$RUNS"/acceptance.json "$RUNS"/profile-*.txt "$OUT"/ 2>/dev/null
for pickle in "$RUNS"/*/memory_snapshot_rank*.pickle; do  # what the allocator held at its peak, in a few lines
  [ -f "$pickle" ] && { echo "== $pickle"; python benchmarks/snapshot_peak.py "$pickle"; } >> "$OUT/snapshot_peak.txt" 2>&1
done
(cd "$RUNS" && find . \( -name report.json -o -name '*.log' \) -not -path './models/*' -print0 |
  tar czf "$OUT/runs.tgz" --null -T -)
echo "total: $(( $(date +%s) - START )) s" >> "$OUT/env.txt"
