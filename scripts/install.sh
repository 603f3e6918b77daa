#!/usr/bin/env bash
# Install trainwarden into ./.venv (idempotent). Used by scripts/demo.sh and scripts/test.sh.
#   scripts/install.sh          the package with its agent and server extras
#   scripts/install.sh --dev    plus the test tools
# PyTorch goes in first, pinned to the CPU build when none is installed, so that pip
# does not pull several GB of CUDA packages for the demo.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TRAINWARDEN_TORCH:-torch==2.13.0}
extras="all"
[ "${1:-}" = "--dev" ] && extras="all,dev"

if [ ! -x .venv/bin/python ]; then
  echo "trainwarden: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "trainwarden: installing $TORCH_SPEC"
  .venv/bin/pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
fi
stamp=".venv/.trainwarden-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "trainwarden: installing the project (.[${extras}])"
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[${extras}]"
  touch "$stamp"
fi
# DeepSpeed on a CPU (its tests run with DS_ACCELERATOR=cpu) JIT-builds its shared-memory
# comm op with g++ and ninja at first use (~135 s on 2 cores), then loads it from
# ~/.cache/torch_extensions: built here, so that no test's clock pays for it. Asked every
# time: torch rebuilds it only when its sources changed, and another checkout's venv (a
# CI clone) has them at another path, which counts as a change; else it loads in seconds.
if [ "$extras" = "all,dev" ]; then
  echo "trainwarden: DeepSpeed's CPU comm op (built the first time in this venv, ~2 minutes)"
  DS_ACCELERATOR=cpu .venv/bin/python -c \
    "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null ||
    echo "trainwarden: WARNING: DeepSpeed's CPU comm op did not build (g++?); scripts/test.sh installs g++ and tries again" >&2
fi
