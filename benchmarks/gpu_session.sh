#!/usr/bin/env bash
# One device call for issues 29 and 30 (docs/gpu.md, docs/throughput.md), at most ~9.5 minutes:
#   1. benchmarks/gpu_check.sh (issue 29) with lower stage limits;
#   2. issue 30, alone on the GPU:
#      throughput_pfllib: benchmarks/gpu_throughput.py at PFLlib's protocol (20 clients, batch 10
#        and 64; sequential, vectorized, compiled; centralized beside them), every client cut to a
#        quarter of its data (samples/s and the time split do not depend on it) -> $OUT/throughput_pfllib.json;
#      pfllib: benchmarks/parity_pfllib.py --device cuda: PFLlib (unchanged, carried in
#        .pfllib/PFLlib/system, its extra wheels in .pfllib/whl) and fedrepro's engine on the same
#        GPU, same data, evaluation every round, FedAvg and FedPer, 2 rounds, full data;
#      pfllib_vectorized: the same fedrepro rows with training.vectorize (PFLlib's side cached);
#      -> $OUT/parity.tar.gz (the parity tables/JSON and PFLlib's logs).
# The device tool's run: command `bash benchmarks/gpu_session.sh`, carry [".whl", ".fmnist", ".pfllib"].
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:?gpu_session.sh: set OUT}
START=$(date +%s)
DEADLINE=${GPU_SESSION_DEADLINE:-575}  # seconds after START by which everything has been written

# measured on an H100 (2026-11-26): cuda tests 127 s beside the workflows (48 s and 53 s)
GPU_CHECK_T_TESTS=${GPU_CHECK_T_TESTS:-200} GPU_CHECK_T_WF_TEST=${GPU_CHECK_T_WF_TEST:-80} \
  GPU_CHECK_T_WF_DEFAULT=${GPU_CHECK_T_WF_DEFAULT:-120} GPU_CHECK_T_THROUGHPUT=${GPU_CHECK_T_THROUGHPUT:-90} \
  bash benchmarks/gpu_check.sh
check_rc=$?
echo "[gpu_session] gpu_check.sh exit $check_rc after $(($(date +%s) - START)) s"

export PYTHONPATH=$REPO/src:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
[ -d "$REPO/.fmnist" ] && export FEDREPRO_FMNIST_DEBIAN_DIR=$REPO/.fmnist
W=/tmp/gpu30
LOGS=$W/logs
mkdir -p "$LOGS"

# The stages (benchmarks/gpu_stage.sh) end by DEADLINE; each prints its log's tail.
STAGE_DIR=$W STAGE_TAG=gpu_session STAGE_DEADLINE=$((START + DEADLINE))
: >"$W/stages.tsv"
# shellcheck source=benchmarks/gpu_stage.sh
source "$REPO/benchmarks/gpu_stage.sh"
run() {
  stage "$@"
  tail -n 25 "$LOGS/$1.log" 2>/dev/null || true
}

run throughput_pfllib 120 python3 benchmarks/gpu_throughput.py --clients 20 --batch 10 64 --rounds 1 --fraction 0.25 \
  --paths sequential vectorized compiled --work "$W" --json "$OUT/throughput_pfllib.json"
# shellcheck source=benchmarks/gpu_pfllib_env.sh
PYTHON=python3
source "$REPO/benchmarks/gpu_pfllib_env.sh"
PARITY=(python3 benchmarks/parity_pfllib.py --pfllib "$REPO/.pfllib/PFLlib" --pfllib-python python3 --work "$W"
  --device cuda --seeds 0 --rounds 2 --fraction 1)
mkdir -p "$W/tables"
for method in FedAvg FedPer; do  # one method at a time: FedAvg's pair is complete before FedPer starts
  run "pfllib_$method" 120 "${PARITY[@]}" --methods "$method"
  for f in "$W"/parity_f*_r2.*; do [ -e "$f" ] && cp "$f" "$W/tables/${method}_sequential_$(basename "$f")"; done
  run "pfllib_${method}_vectorized" 30 "${PARITY[@]}" --methods "$method" --only fedrepro \
    --fedrepro-training '{"vectorize": true}'
  for f in "$W"/parity_f*_r2.*; do [ -e "$f" ] && cp "$f" "$W/tables/${method}_vectorized_$(basename "$f")"; done
done
(cd "$W" && tar -czf "$OUT/parity.tar.gz" stages.tsv tables logs cache 2>/dev/null)
echo "[gpu_session] done after $(($(date +%s) - START)) s; gpu_check.sh exit $check_rc"
exit $check_rc
