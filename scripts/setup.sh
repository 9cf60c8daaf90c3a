#!/usr/bin/env bash
# Install a2ad and what it needs into the current Python (torch only if none is there).
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${A2AD_PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[a2ad setup] installing torch (none found)" >&2
    "$PY" -m pip install -q "torch==2.13.0"
fi
echo "[a2ad setup] installing a2ad with its test extra" >&2
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'
