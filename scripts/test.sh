#!/usr/bin/env bash
# All the tests: installs what they need (once), then runs pytest. Arguments go to pytest.
# PostgreSQL: TRAINWARDEN_TEST_DATABASE_URL, else 127.0.0.1:5432, else a throwaway cluster
# from the local PostgreSQL binaries (tests/conftest.py). Chromium: /usr/bin/chromium.
# promtool (Debian's prometheus), Alertmanager (prometheus-alertmanager), Slurm and munge
# (the eviction tests start a two-node cluster: tests/slurm.py). None is ever
# skipped: if one is missing, the tests that need it fail and say so.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
apt_missing=()
[ -x /usr/bin/chromium ] || apt_missing+=(chromium chromium-driver)
if ! command -v pg_ctlcluster >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt_missing+=(postgresql)
fi
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "trainwarden: installing ${apt_missing[*]} (apt-get)"
  if ! { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_missing[@]}" >/dev/null; }; then
    echo "trainwarden: WARNING: could not install ${apt_missing[*]}; the tests that need them will FAIL" >&2
  fi
fi

if ! command -v promtool >/dev/null; then  # promtool checks /metrics
  echo "trainwarden: installing prometheus for promtool (apt-get)"
  { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } ||
    echo "trainwarden: WARNING: could not install prometheus; the promtool test will FAIL" >&2
fi

if [ ! -x /usr/bin/prometheus-alertmanager ]; then  # the notifier tests run the real one
  echo "trainwarden: installing prometheus-alertmanager (apt-get)"
  { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null; } ||
    echo "trainwarden: WARNING: could not install prometheus-alertmanager; the Alertmanager test will FAIL" >&2
fi

if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/munged ] ||
   ! command -v sbatch >/dev/null; then  # the eviction tests run a real cluster (tests/slurm.py)
  echo "trainwarden: installing slurmctld slurmd slurm-client munge (apt-get)"
  { as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; } ||
    echo "trainwarden: WARNING: could not install Slurm; the eviction tests will FAIL" >&2
fi

./scripts/install.sh --dev
exec .venv/bin/python -m pytest "$@"
