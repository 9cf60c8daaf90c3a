#!/usr/bin/env bash
# Set up, then run the whole test suite. GPU tests run where CUDA GPUs are visible and
# are skipped (and reported as skipped) elsewhere. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${A2AD_PYTHON:-python3}" -m pytest "$@"
