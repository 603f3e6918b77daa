#!/usr/bin/env bash
# All the tests: installs what they need (once), then runs pytest. With arguments, one pytest
# runs with them; without, the whole suite runs in parallel, then the serial tests (below).
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
[ -x /usr/sbin/haproxy ] || apt_missing+=(haproxy)  # two collectors behind it: tests/e2e/test_scale_out.py
command -v g++ >/dev/null || apt_missing+=(g++)  # DeepSpeed JIT-builds its CPU comm op (scripts/install.sh)
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
if [ $# -gt 0 ]; then  # a selection of one's own: one pytest, as asked
  exec .venv/bin/python -m pytest "$@"
fi
# The whole suite: most of its time is end-to-end drills waiting on real timers and
# processes, so it runs on TRAINWARDEN_TEST_WORKERS pytest-xdist workers (3 by default, on
# 2 cores: with 2 the cores were idle a quarter of the time, waiting with the drills; a
# test file stays on one worker, with its module fixtures). The tests marked `serial`
# measure what a second worker would distort (the comm split's timings; the ranks table's
# page use, which a CREATE DATABASE anywhere on the server changes): they run afterwards,
# alone. Both parts always run; the exit status is the first failure's. The
# slowest 30 tests are listed after each run's summary (keep the suite well under 15 minutes).
workers="${TRAINWARDEN_TEST_WORKERS:-3}"
rc=0
if [ "$workers" -gt 1 ]; then
  .venv/bin/python -m pytest -n "$workers" --dist loadfile -m "not serial" --durations=30 || rc=$?
else
  .venv/bin/python -m pytest -m "not serial" --durations=30 || rc=$?
fi
echo "trainwarden: the serial tests, alone"
.venv/bin/python -m pytest -m serial || { s=$?; [ "$rc" -ne 0 ] || rc=$s; }
if [ "$rc" -ne 0 ]; then
  echo "trainwarden: TESTS FAILED (see both summaries above)" >&2
fi
exit "$rc"
