#!/usr/bin/env bash
# Set up, then run the whole test suite. GPU tests run where CUDA GPUs are visible and
# are skipped (and reported as skipped) elsewhere. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
    echo "[a2ad test] running the whole test suite (about 12 minutes on a quiet 2-core machine, up to half an hour under load;" \
         "GPU tests skip without a GPU) ..." >&2
else
    echo "[a2ad test] running pytest $* ..." >&2
fi
exec "${A2AD_PYTHON:-python3}" -m pytest "$@"
