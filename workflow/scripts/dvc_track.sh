#!/usr/bin/env bash
# Version an experiment with DVC: raw data, shards and per-cell results go to the DVC
# cache and the default remote; the small summaries stay in git (dvc metrics/plots read
# them across commits).
#   bash workflow/scripts/dvc_track.sh [experiment]        (default: default)
#   git add results && git commit -m "results of <experiment>"
set -euo pipefail
cd "$(dirname "$0")/../.."
exp=${1:-default}
DVC=${DVC:-.venv/bin/dvc}
[ -f "results/$exp/summary.json" ] || { echo "no results/$exp/summary.json: run the experiment first" >&2; exit 1; }
targets=()
for d in results/raw/*/; do targets+=("${d%/}"); done
targets+=(results/shards "results/$exp/runs" "results/$exp/plots" "results/$exp/tables")
[ -d "results/$exp/report" ] && targets+=("results/$exp/report")  # the report's landing page (rule report_page)
"$DVC" add "${targets[@]}"
"$DVC" push
git add -f "results/$exp/summary.json" "results/$exp/summary.csv" "results/$exp/curves.csv"
# dvc.yaml is generated: the tracked experiment joins the metrics and plots dvc diffs compare
"$(dirname "$DVC")/python" workflow/scripts/dvc_yaml.py "$exp"
git add results dvc.yaml
echo "tracked: ${targets[*]}; commit with: git commit -m 'results of $exp'"
