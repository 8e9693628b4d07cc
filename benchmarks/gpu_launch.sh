#!/usr/bin/env bash
# The one device call of issue 36 (docs/gpu.md, "Issue 36: the launch-limit run"), at most ~9 minutes:
#   1. levers, alone on the GPU: benchmarks/gpu_throughput.py at PFLlib's protocol (Fashion-MNIST
#      Dir(0.1), 20 clients, full data, fedavg_cnn, batch 10, 1 epoch, evaluation every round),
#      FedAvg and FedPer, --paths cumulative (sequential, vectorized, then resident_batches,
#      fused_step, cuda_graph, device_losses, batched_eval added one at a time), one warm-up and one
#      timed round a row, each row's final accuracies; one more round of every lever row profiled;
#      centralized training of the same model at batch 10 beside them -> $OUT/levers.json;
#   2. pfllib_FedAvg, pfllib_FedPer, alone: PFLlib's s/round on the same GPU
#      (benchmarks/parity_pfllib.py --only pfllib; PFLlib unchanged, carried in .pfllib/);
#   3. at once: the cuda tests (pytest -m cuda, JUnit XML) and cells_per_hour:
#      config/experiments/baselines_fmnist_quick.yaml (seed 0) through Snakemake with packing
#      (local profile, gpu_slots) and training.vectorize with every lever (beside the tests, so
#      its cells per GPU-hour are a lower bound);
#   4. levers_ditto: Ditto's rows, in the time left -> $OUT/levers_ditto.json;
#   5. $OUT/summary.json and $OUT/levers.md (benchmarks/gpu_launch.py: the issue's goals as checks,
#      the lever table, the profile split), $OUT/cuda_tests.xml, every log in $OUT/logs.tar.gz.
# Each stage has a time limit, all end by a deadline (GPU_LAUNCH_DEADLINE seconds, default 530);
# one that fails or runs out of time is recorded and the rest still run.
# The CPU mode (--cpu, or GPU_LAUNCH_MODE=cpu; CI runs it, tests/test_gpu_launch.py) runs the same
# stages small: digits, 10 clients, the cuda tests collected and skipped, the workflow on
# benchmarks/gpu_check_cpu.yaml; PFLlib's stages run only where .pfllib/ is carried (else they are
# recorded as skipped: no .pfllib).
#   OUT=/tmp/out bash benchmarks/gpu_launch.sh [--cpu]
# The device tool's run: command `bash benchmarks/gpu_launch.sh`, carry [".whl", ".fmnist", ".pfllib"],
# timeout_s 600. Exit status 0 when every check of the summary holds.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

GPU_LAUNCH_START=$(date +%s)
export GPU_LAUNCH_START  # the summary's wall time
# shellcheck source=benchmarks/gpu_stage.sh
source "$REPO/benchmarks/gpu_stage.sh"  # device_mode, stage
device_mode gpu_launch.sh GPU_LAUNCH_MODE "$@"
OUT=${OUT:?gpu_launch.sh: set OUT to the folder for the summary and logs}
WORK=${GPU_LAUNCH_WORK:-/tmp/gpu_launch}
PYTHON=${PYTHON:-python3}
DEADLINE=${GPU_LAUNCH_DEADLINE:-530}  # seconds after the start by which everything has been written
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK/logs"
: >"$WORK/stages.tsv"

METHODS=(fedavg fedper)  # every lever row of these must run; Ditto's take the time left
if [ "$MODE" = gpu ]; then
  # measured on an H100 (2026-11-26, docs/throughput.md): PFLlib 20.6 s a round, fedrepro 12.9 s
  # sequential and 4.3 s vectorized, cuda tests 120-130 s beside two workflows
  DATASET=fmnist CLIENTS=20 FRACTION=1 CORES=$(nproc) SLOTS=8
  # expected: levers ~150 s (import and partition 20 s, centralized 2 epochs 20 s, per method the
  # sequential row 2 x 13 s, vectorized 2 x 4.5 s, five lever rows with their profiled rounds),
  # each PFLlib stage ~55 s (2 iterations of 20.6 s and its start), the cuda tests ~130 s
  T_LEVERS=200 T_PFLLIB=70 T_TESTS=160 T_CELLS=160
  CELLS_CONFIG=config/experiments/baselines_fmnist_quick.yaml CELLS_SEEDS="seeds=[0] "
  PARITY_ARGS=(--device cuda --fraction 1)
  THREADS=() CELLS_THREADS=()
else
  DATASET=digits CLIENTS=10 FRACTION=1 CORES=2 SLOTS=2
  T_LEVERS=90 T_PFLLIB=120 T_TESTS=60 T_CELLS=90
  CELLS_CONFIG=benchmarks/gpu_check_cpu.yaml CELLS_SEEDS=""
  PARITY_ARGS=(--device cpu --fraction 0.05)
  THREADS=(--threads 1) CELLS_THREADS=(--set-threads train=1)  # two cells side by side on two cores
fi

# -- 1. environment (benchmarks/gpu_env.sh) ---------------------------------------------------------
# shellcheck source=benchmarks/gpu_env.sh
source "$REPO/benchmarks/gpu_env.sh"
STAGE_DIR=$WORK STAGE_TAG=gpu_launch STAGE_DEADLINE=$((GPU_LAUNCH_START + DEADLINE - 15))  # 15 s for the summary
skip() {  # NAME WHY: a stage not run on purpose, with the reason the summary shows
  printf '%s\t-1\t0\t%s\n' "$1" "$2" >>"$WORK/stages.tsv"
  echo "[gpu_launch] $1: skipped ($2)"
}
# the engine paths, and every lever (the last path's) for the workflow: gpu_throughput.py's own list
mapfile -t PATHS < <("$PYTHON" -c 'import sys; sys.path.insert(0, "benchmarks")
from gpu_throughput import cumulative_paths; print("\n".join(cumulative_paths()))')
if [ "${#PATHS[@]}" -lt 3 ]; then
  echo "[gpu_launch] benchmarks/gpu_throughput.py does not import: see the error above" >&2
  exit 1
fi
LEVERS=${PATHS[-1]#vectorized+}
if [ "$MODE" = gpu ]; then
  PROFILED=("${PATHS[@]:2}")  # every row with levers: the summary shows the split of each method's fastest
else
  PROFILED=("${PATHS[-1]}")  # on the CPU the profiler's start costs seconds a row: the last row only
fi
CELLS_SET="${CELLS_SEEDS}training.vectorize=true training.levers=[${LEVERS//+/,}]"
THROUGHPUT=("$PYTHON" benchmarks/gpu_throughput.py --dataset "$DATASET" --clients "$CLIENTS" --batch 10 --rounds 1
  --eval-every 1 --fraction "$FRACTION" --paths "${PATHS[@]}" --profile "${PROFILED[@]}" --work "$WORK/throughput"
  "${THREADS[@]}")

# -- 2. the lever rows and centralized training, alone ------------------------------------------------
stage levers "$T_LEVERS" "${THROUGHPUT[@]}" --methods "${METHODS[@]}" --json "$OUT/levers.json"

# -- 3. PFLlib on the same device, alone ---------------------------------------------------------------
if [ -f "$REPO/.pfllib/PFLlib/system/main.py" ]; then
  LOGS=$WORK/logs
  # shellcheck source=benchmarks/gpu_pfllib_env.sh
  source "$REPO/benchmarks/gpu_pfllib_env.sh"
  for method in FedAvg FedPer; do  # PFLlib side only: the engine's rows are stage 2's
    stage "pfllib_$method" "$T_PFLLIB" "$PYTHON" benchmarks/parity_pfllib.py --pfllib "$REPO/.pfllib/PFLlib" \
      --pfllib-python "$PYTHON" --work "$WORK/parity" --seeds 0 --rounds 1 --only pfllib --methods "$method" "${PARITY_ARGS[@]}"
    for f in "$WORK"/parity/parity_f*_r1.json; do [ -e "$f" ] && mv "$f" "$WORK/pfllib_$method.json"; done
  done
else
  skip pfllib_FedAvg "no .pfllib"
  skip pfllib_FedPer "no .pfllib"
fi

# -- 4. the cuda tests beside the cells-per-hour workflow --------------------------------------------
stage cuda_tests "$T_TESTS" "$PYTHON" -m pytest -m cuda -p no:cacheprovider "${PYTEST_ARGS[@]}" tests/test_cuda.py \
  --junitxml="$OUT/cuda_tests.xml" &
tests_pid=$!
# --scheduler greedy: the ILP scheduler's solver (pulp) is not carried
stage cells_per_hour "$T_CELLS" "$PYTHON" -m snakemake -s "$REPO/Snakefile" --workflow-profile "$REPO/workflow/profiles/local" \
  --cores "$CORES" --resources gpu_slots="$SLOTS" --scheduler greedy "${CELLS_THREADS[@]}" \
  --directory "$WORK/cells_per_hour" --configfile "$REPO/$CELLS_CONFIG" --config set="$CELLS_SET"
wait "$tests_pid"

# -- 5. Ditto's lever rows, in the time left ------------------------------------------------------------
stage levers_ditto 600 "${THROUGHPUT[@]}" --methods ditto --no-central --json "$OUT/levers_ditto.json"

# -- 6. summary and logs ----------------------------------------------------------------------------------
rc=0
"$PYTHON" benchmarks/gpu_launch.py --mode "$MODE" --work "$WORK" --out "$OUT" --methods "${METHODS[@]}" \
  --cells-config "$CELLS_CONFIG" --cells-set "$CELLS_SET" || rc=$?
# every log (the stages', Snakemake's, each job's, PFLlib's) and PFLlib's tables in one file: a device
# call returns at most 8 files
(cd "$WORK" && find . -name '*.log' -o -name 'stages.tsv' -o -name 'pfllib_*.json' -o -path '*/benchmarks/*.tsv' |
  tar -czf "$OUT/logs.tar.gz" -T -)
exit $rc
