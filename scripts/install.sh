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
