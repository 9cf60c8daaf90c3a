#!/usr/bin/env bash
# Set up, then run the test suite: the fast tier by default, the full tier with --full.
#
# The fast tier: unit and in-process tests, and real-process smoke tests of every feature (a
# real daemon, real sockets, real shared memory). --full adds the long real-process runs, the
# tests marked `full` (README.md, "The two commands", says which). GPU tests run where CUDA
# GPUs are visible and are skipped (and reported as skipped) elsewhere. Other arguments go to
# pytest (a test file named there runs whole, its `full` tests included).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
full=0
for a in "$@"; do
    if [ "$a" = "--full" ]; then full=1; fi
done
bash scripts/setup.sh
if [ "$full" = 1 ]; then
    tier="the full tier (every test; about half an hour on a quiet 2-core machine, up to an hour under load)"
else
    tier="the fast tier (unit, in-process and real-process smoke tests; about 10 minutes on a quiet 2-core machine, 20 under load; the long runs marked 'full' are deselected: --full runs them)"
fi
if [ $# -eq 0 ] || { [ $# -eq 1 ] && [ "$full" = 1 ]; }; then
    echo "[a2ad test] running $tier; GPU tests skip without a GPU ..." >&2
else
    echo "[a2ad test] running pytest $* in $tier ..." >&2
fi
exec "${A2AD_PYTHON:-python3}" -m pytest "$@"
