#!/usr/bin/env bash
# Install a2ad and what it needs into the current Python (torch only if none is there).
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${A2AD_PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[a2ad setup] installing torch 2.13.0 (none found; a large download, this may take a few minutes) ..." >&2
    "$PY" -m pip install -q "torch==2.13.0"
    echo "[a2ad setup] torch installed" >&2
fi
# tests/test_operations.py checks systemd/a2ad.service with `systemd-analyze verify`:
# on a bare Debian/Ubuntu machine (CI runs as root) install it; best-effort, the test
# skips with a reason where it is still missing.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[a2ad setup] installing systemd with apt-get (for systemd-analyze verify of the unit file; this may take a minute) ..." >&2
        if ! (export DEBIAN_FRONTEND=noninteractive
              apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends systemd >/dev/null); then
            echo "[a2ad setup] could not install systemd; the unit-file test will be skipped" >&2
        fi
    else
        echo "[a2ad setup] no systemd-analyze (needs root and apt-get to install); the unit-file test will be skipped" >&2
    fi
fi
# A machine with an NVIDIA driver also gets the cuda extra (NVIDIA's cuda-bindings), which the
# cuda backend and the client's CUDA mappings need; without it the daemon falls back to host.
EXTRAS=test
if command -v nvidia-smi > /dev/null 2>&1; then EXTRAS=test,cuda; fi
echo "[a2ad setup] installing a2ad (editable) with its $EXTRAS extras and missing dependencies; this may take a minute ..." >&2
"$PY" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
echo "[a2ad setup] a2ad $("$PY" -c 'import a2ad; print(a2ad.__version__)') installed; the CUDA extension builds on first GPU use (or now: a2ad build-ext)" >&2
