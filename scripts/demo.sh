#!/usr/bin/env bash
# The live demo: installs (once), then `trainwarden demo` — the collector on the embedded
# SQLite default plus a 2-rank CPU training run (gloo). Extra arguments go to `trainwarden demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
exec .venv/bin/trainwarden demo "$@"
