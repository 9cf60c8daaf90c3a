#!/usr/bin/env bash
# On a GPU machine: build the CUDA extension, run the GPU tests, the demo on CUDA and a quick
# benchmark, then print a summary (last, so it is what a truncated log still shows).
#
#   bash scripts/gpu-check.sh [OUTDIR]      # logs and figures go to OUTDIR (default ./gpu-check-out)
#
# Environment: A2AD_EXT_DIR (extension cache, default ./build/ext), GPU_CHECK_STEPS (a
# space-separated subset of: build tests demo bench table; default build tests demo bench;
# "table": the small-T table against FlashInfer, both ranks on this one GPU, kernel_timing
# and fi_timing at hidden 7168 and 2880 and T of GPU_CHECK_TABLE_TOKENS, default 1,8,32,128,
# then small_t's table into the summary; it needs FlashInfer, see GPU_CHECK_FLASHINFER),
# GPU_CHECK_PYTEST (extra
# pytest arguments), GPU_CHECK_TESTS_LIMIT (seconds for the tests step, default 900: the
# whole GPU suite took about 500 s on one H100), GPU_CHECK_PART (the tests step's half, for
# machines lent for less than the whole suite: "kernels", the four kernel test files, about
# 150 s of pytest on one H100, or "rest", everything else, about 290 s; default both).
# GPU_CHECK_FLASHINFER: a PYTHONPATH fragment (colon-separated folders) from which FlashInfer's
# MoeAlltoAll imports, e.g. an unpacked FlashInfer tree and its tvm-ffi package: the tests that
# compare a2ad with FlashInfer then run instead of skipping (the summary says which it was).
# GPU_CHECK_TESTS: test paths for the tests step instead of GPU_CHECK_PART's (e.g. one file).
# Python packages missing on the machine may be given as wheels in ./.whl.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUTDIR=${1:-${OUT:-$PWD/gpu-check-out}}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu-check.log"
SUMMARY="$OUTDIR/summary.txt"
: > "$LOG"
: > "$SUMMARY"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export A2AD_EXT_DIR=${A2AD_EXT_DIR:-$PWD/build/ext}
STEPS=${GPU_CHECK_STEPS:-build tests demo bench}
PY=${A2AD_PYTHON:-python3}
KERNEL_TESTS="tests/test_deep_ep.py tests/test_cuda_kernels.py tests/test_cuda_degraded.py tests/test_cuda_plane_features.py"
case ${GPU_CHECK_PART:-} in
    "") TEST_ARGS="tests/" ;;
    kernels) TEST_ARGS=$KERNEL_TESTS ;;
    rest) TEST_ARGS="tests/$(for f in $KERNEL_TESTS; do printf ' --ignore=%s' "$f"; done)" ;;
    *) echo "GPU_CHECK_PART must be kernels or rest, got '$GPU_CHECK_PART'" >&2; exit 2 ;;
esac
TEST_ARGS=${GPU_CHECK_TESTS:-$TEST_ARGS}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/a2ad-site .whl/*.whl \
        && export PYTHONPATH=/tmp/a2ad-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import a2ad.client" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || echo "install: pip install -e . failed" >>"$SUMMARY"
fi

if [ -n "${GPU_CHECK_FLASHINFER:-}" ]; then
    export PYTHONPATH=$GPU_CHECK_FLASHINFER${PYTHONPATH:+:$PYTHONPATH}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/a2ad-gpu-check-flashinfer}  # its JIT cache, not an output
    if [ -z "${FLASHINFER_CUDA_ARCH_LIST:-}" ]; then  # this GPU's, e.g. 9.0 (what its modules are built for)
        FLASHINFER_CUDA_ARCH_LIST=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
        [ -n "$FLASHINFER_CUDA_ARCH_LIST" ] && export FLASHINFER_CUDA_ARCH_LIST
    fi
fi

step() {  # step NAME LIMIT_SECONDS COMMAND...   (STEP_KEEP=FILE: the output also in FILE alone)
    local name=$1 limit=$2 keep=${STEP_KEEP:-}
    shift 2
    echo "===== $name: $*" >>"$LOG"
    local t0=$SECONDS
    if [ -n "$keep" ]; then
        timeout --kill-after=10 "$limit" "$@" >"$keep" 2>&1
    else
        timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    fi
    local rc=$?
    [ -n "$keep" ] && cat "$keep" >>"$LOG"
    printf '%-10s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >>"$SUMMARY"
    return $rc
}

{
    echo "host: $(hostname) $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
    if "$PY" -c "import flashinfer.comm.trtllm_moe_alltoall" >/dev/null 2>&1; then
        echo "flashinfer: importable (its comparison tests run)"
        FI_IMPORTS=1
    else
        echo "flashinfer: not importable (its comparison tests skip; GPU_CHECK_FLASHINFER names where it is)"
    fi
} >>"$SUMMARY" 2>&1

for s in $STEPS; do
    case $s in
        build) step build 300 "$PY" -c "import a2ad.client._ext as e; e.load(); print('extension ok')" ;;
        tests) step tests "${GPU_CHECK_TESTS_LIMIT:-900}" "$PY" -m pytest -q --full -m "gpu or gpu2" -p no:cacheprovider ${GPU_CHECK_PYTEST:-} $TEST_ARGS ;;
        demo)
            step demo-2 180 "$PY" -m a2ad.tools.cli demo --backend cuda --ranks 2 --rounds 30 --tokens 256 --hidden 7168 --top-k 8 --experts 256
            step demo-8 180 "$PY" -m a2ad.tools.cli demo --backend cuda --ranks 8 --rounds 10 --tokens 64 --hidden 2880 --top-k 4 --experts 128
            ;;
        table)
            TOKENS=${GPU_CHECK_TABLE_TOKENS:-1,8,32,128}
            for h in 7168 2880; do
                STEP_KEEP="$OUTDIR/timing-$h.log" step "timing-$h" 300 env A2AD_KERNEL_TIMING=1 \
                    "$PY" -m a2ad.bench.kernel_timing --one-gpu --no-diags --low-precision --hidden "$h" --tokens "$TOKENS"
            done
            if [ -n "${FI_IMPORTS:-}" ]; then
                STEP_KEEP="$OUTDIR/fi-timing.log" step fi-timing 300 \
                    "$PY" -m a2ad.bench.fi_timing --low-precision both --hidden 7168,2880 --tokens "$TOKENS" --limit 15
                STEP_KEEP="$OUTDIR/table.md" step table 60 "$PY" -m a2ad.bench.small_t \
                    "$OUTDIR/timing-7168.log" "$OUTDIR/timing-2880.log" --flashinfer "$OUTDIR/fi-timing.log"
                { echo "----- the small-T table (python -m a2ad.bench.small_t)"; cat "$OUTDIR/table.md"; } >>"$SUMMARY"
            else
                echo "table      rc=2   not made: FlashInfer does not import (GPU_CHECK_FLASHINFER names where it is)" >>"$SUMMARY"
            fi
            ;;
        bench) step bench 420 "$PY" -m a2ad.bench --quick --budget 360 --json "$OUTDIR/bench-quick.json" --plot "$OUTDIR/perf-quick.png" ;;
        *) echo "unknown step $s" >>"$SUMMARY" ;;
    esac
done

echo "----- failures (pytest short summary and errors)" >>"$SUMMARY"
grep -E "^(FAILED|ERROR)|passed|failed|Error:|error:" "$LOG" | tail -n 40 >>"$SUMMARY"
cat "$SUMMARY"
! grep -qE "rc=[1-9]" "$SUMMARY"
