#!/usr/bin/env bash
# Idempotent setup: .venv with the locked versions and fedrepro itself, plus Debian's
# Fashion-MNIST package where apt is available and permitted. Re-running it does
# nothing unless the lock or pyproject.toml changed.
#   bash workflow/scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
LOCK=workflow/envs/requirements.lock
STAMP=.venv/.fedrepro-installed

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi

want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import fedrepro" 2>/dev/null; then
  echo "[setup] installing $LOCK and fedrepro into .venv"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$LOCK"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
  .venv/bin/python -m pip check
  echo "$want" > "$STAMP"
else
  echo "[setup] .venv is up to date"
fi

# Fashion-MNIST offline: Debian's dataset-fashion-mnist installs the IDX files that
# fedrepro's fmnist loader picks up. Optional: without it, torchvision downloads them.
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Debian's dataset-fashion-mnist"
    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
      || echo "[setup] note: could not install dataset-fashion-mnist; fmnist will be downloaded by torchvision"
  else
    echo "[setup] note: apt not available or not root; fmnist will be downloaded by torchvision on first use"
  fi
fi
echo "[setup] done: activate with 'source .venv/bin/activate'"
