#!/usr/bin/env bash
# Installs the MLflow tracking server that bench/ingest.py's peer (c) measures, into its own
# virtual environment (bench/.mlflow-venv): mlflow's pins conflict with the project's.
#
#     bench/install_mlflow.sh            # then: python bench/peer_mlflow.py
#
# PYTHON picks the interpreter (default python3). The versions are the ones the figures in
# the README were measured with.
set -euo pipefail

MLFLOW_VERSION=3.17.2
PSYCOPG2_VERSION=2.9.13

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.mlflow-venv"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "mlflow==$MLFLOW_VERSION" "psycopg2-binary==$PSYCOPG2_VERSION"
"$venv/bin/mlflow" --version
echo "installed: $venv/bin/mlflow"
