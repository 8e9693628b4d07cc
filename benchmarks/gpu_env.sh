# Sourced by benchmarks/gpu_check.sh and benchmarks/gpu_launch.sh: the environment of a device
# call (docs/gpu.md, "What the script does"), given REPO, MODE (gpu | cpu), WORK and PYTHON:
#   the carried wheels (.whl/, benchmarks/gpu_wheels.py) installed into /tmp/site in GPU mode,
#   PYTHONPATH=src[:/tmp/site], Fashion-MNIST from .fmnist/ where carried, a `fedrepro` command
#   in $WORK/bin for the workflow's jobs (the package is not installed on the device),
#   PYTEST_ARGS for the cuda tests, and $WORK/logs/environment.log (nvidia-smi, versions).
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
if [ "$MODE" = gpu ] && compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl
  export PYTHONPATH=$REPO/src:/tmp/site
elif [ "$MODE" = gpu ]; then
  echo "[gpu_env] no wheels in .whl/: Snakemake, kornia, lightly, jsonschema must be installed (docs/gpu.md: carry .whl)" >&2
fi
PYTEST_ARGS=(-v --durations=20)
if "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
  PYTEST_ARGS+=(--timeout=150)  # a hung test (a CUDA graph that never returns) fails alone, the stage goes on
fi
if [ -d "$REPO/.fmnist" ]; then
  export FEDREPRO_FMNIST_DEBIAN_DIR=$REPO/.fmnist  # the four .gz files of Debian's dataset-fashion-mnist
fi
mkdir -p "$WORK/bin" "$WORK/logs"
printf '#!/bin/sh\nexec "%s" -m fedrepro "$@"\n' "$(command -v "$PYTHON")" >"$WORK/bin/fedrepro"
chmod +x "$WORK/bin/fedrepro"
export PATH=$WORK/bin:$PATH
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
{
  date -u
  echo "mode $MODE"
  command -v nvidia-smi >/dev/null && nvidia-smi || echo "no nvidia-smi"
  "$PYTHON" -c 'import sys, torch, snakemake, jsonschema, kornia, lightly, timm, fedrepro.methods as m
print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("snakemake", snakemake.__version__, "kornia", kornia.__version__, "lightly", lightly.__version__, "timm", timm.__version__)
print(len(m.METHODS.names()), "methods")'
} >"$WORK/logs/environment.log" 2>&1 || echo "[gpu_env] environment check failed: see logs/environment.log" >&2
