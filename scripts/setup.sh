#!/usr/bin/env bash
# Install a2ad and what it needs into the current Python (torch only if none is there).
# Run by scripts/test.sh and scripts/demo.sh; safe to run again: when this checkout is already
# installed (editable) with every dependency it declares, it says so and installs nothing.
#
# Environment: A2AD_PYTHON (the Python to install into, default python3), A2AD_TORCH_INDEX (the
# package index torch is installed from when none is installed; e.g. PyTorch's CPU wheel index on
# a machine without a GPU, which saves the multi-GB CUDA build), A2AD_SETUP_FORCE=1 (reinstall).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${A2AD_PYTHON:-python3}
if [[ $PY == */* ]]; then PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"; fi
TORCH_VERSION=2.13.0  # the torch the test suite runs with (pyproject.toml accepts >= 2.4)
say() { echo "[a2ad setup] $*" >&2; }
t0=$SECONDS

# A machine with an NVIDIA driver also gets the cuda extra (NVIDIA's cuda-bindings), which the
# cuda backend and the client's CUDA mappings need; without it the daemon falls back to host.
EXTRAS=test
if command -v nvidia-smi > /dev/null 2>&1; then EXTRAS=test,cuda; fi

# Fast check (well under a second, imports no torch): a2ad and a2ad.client resolve to this
# checkout from outside it (an editable install of it, not the current folder or PYTHONPATH),
# and every requirement of pyproject.toml (with the extras above) is installed in a version it
# accepts. Prints what is missing, if anything.
installed_check() {
    (cd / && env -u PYTHONPATH "$PY" - "$ROOT" "$EXTRAS" <<'EOF'
import importlib.metadata as md
import importlib.util
import os
import sys

root, extras = os.path.realpath(sys.argv[1]), set(sys.argv[2].split(","))
def inside(mod, sub):
    spec = importlib.util.find_spec(mod)
    return spec is not None and spec.origin is not None and \
        os.path.realpath(spec.origin).startswith(os.path.join(root, sub) + os.sep)
try:
    if not (inside("a2ad", "a2ad") and inside("a2ad.client", "client")):
        sys.exit("a2ad is not installed from this checkout")
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
except (ImportError, OSError, KeyError, ValueError) as exc:
    sys.exit(f"cannot check the installed packages ({type(exc).__name__}: {exc})")
wanted = list(project.get("dependencies", []))
for extra in sorted(extras):
    wanted += project.get("optional-dependencies", {}).get(extra, [])
missing = []
for text in wanted:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(f"{req.name} (not installed)")
        continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        missing.append(f"{req.name} {have} (wants {req.specifier})")
if missing:
    sys.exit("missing: " + ", ".join(missing))
EOF
    )
}

# tests/test_operations.py checks systemd/a2ad.service with `systemd-analyze verify`:
# on a bare Debian/Ubuntu machine (CI runs as root) install it; best-effort, the test
# skips with a reason where it is still missing.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing systemd with apt-get (for systemd-analyze verify of the unit file; this may take a minute) ..."
        if ! (export DEBIAN_FRONTEND=noninteractive
              apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends systemd >/dev/null); then
            say "could not install systemd; the unit-file test will be skipped"
        fi
    else
        say "no systemd-analyze (needs root and apt-get to install); the unit-file test will be skipped"
    fi
fi
if [ "${A2AD_SETUP_FORCE:-0}" != 1 ] && why=$(installed_check 2>&1); then
    say "a2ad is installed from this checkout (editable) with its $EXTRAS dependencies: nothing to install"
    exit 0
fi
[ -n "${why:-}" ] && say "${why##*$'\n'}"
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" >/dev/null 2>&1; then
    if [ -n "${A2AD_TORCH_INDEX:-}" ]; then
        say "installing torch $TORCH_VERSION from A2AD_TORCH_INDEX (none found; this may take a few minutes) ..."
        "$PY" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" --index-url "$A2AD_TORCH_INDEX"
    else
        if [ "$EXTRAS" = test ]; then
            say "no torch and no NVIDIA driver here: the default torch wheel brings the whole CUDA stack (several GB);" \
                "for the CPU build, stop now (Ctrl-C) and install it first from PyTorch's CPU wheel index (README.md," \
                "\"Install\"), or set A2AD_TORCH_INDEX to that index"
        fi
        say "installing torch $TORCH_VERSION (none found; a large download, this may take a few minutes) ..."
        "$PY" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
    fi
    say "torch installed ($((SECONDS - t0)) s)"
fi
t1=$SECONDS
say "installing a2ad from this checkout (editable) with its $EXTRAS extras and missing dependencies; this may take a minute ..."
"$PY" -m pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
say "a2ad $("$PY" -c 'import a2ad; print(a2ad.__version__)') installed ($((SECONDS - t1)) s); the CUDA extension builds on first GPU use (or now: a2ad build-ext)"
