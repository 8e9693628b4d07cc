# Sourced by benchmarks/gpu_session.sh and benchmarks/gpu_launch.sh before PFLlib runs on the device
# (docs/throughput.md, "Preparing .pfllib"), given REPO, PYTHON and LOGS: PFLlib's two extra
# imports, cvxpy (serverpac) and calmsize (mem_utils), installed from the carried .pfllib/whl into
# /tmp/site (on PYTHONPATH); an empty cvxpy stub where cvxpy does not import.
if compgen -G "$REPO/.pfllib/whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.pfllib/whl/*.whl
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
fi
if ! "$PYTHON" -c 'import cvxpy' 2>"$LOGS/cvxpy.log"; then
  # only PFLlib's serverpac.py (FedPAC, not run here) uses cvxpy; main.py imports it for every algorithm
  mkdir -p /tmp/stub/cvxpy && : >/tmp/stub/cvxpy/__init__.py && export PYTHONPATH=$PYTHONPATH:/tmp/stub
  echo "[gpu_pfllib_env] cvxpy does not import (logs/cvxpy.log): an empty stub module stands in for it"
fi
