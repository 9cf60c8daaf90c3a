#!/usr/bin/env bash
# Set up, then run the demo: a daemon plus a group of client processes doing real
# dispatch/combine (CUDA where GPUs are visible, the host backend elsewhere).
# Extra arguments go to `a2ad demo` (see `bash scripts/demo.sh --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for arg in "$@"; do
    case $arg in  # the options need no set-up (and no torch): answer at once, from this checkout
        -h|--help) exec "${A2AD_PYTHON:-python3}" -m a2ad.tools.cli demo --help ;;
    esac
done
bash scripts/setup.sh
exec "${A2AD_PYTHON:-python3}" -m a2ad.tools.cli demo "$@"
