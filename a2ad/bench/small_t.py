"""The small-T table against FlashInfer, from the logs of the two one-GPU timing harnesses.

    python -m a2ad.bench.small_t A2AD_LOG [A2AD_LOG ...] --flashinfer FI_LOG [FI_LOG ...]

A2AD_LOG is what ``python -m a2ad.bench.kernel_timing --one-gpu --no-diags --low-precision
--hidden H --tokens ...`` printed, FI_LOG what ``python -m a2ad.bench.fi_timing --low-precision
both --hidden H[,H...] --tokens ...`` printed, on the same GPU. For every (hidden, T) that both
sides measured it prints a2ad's and FlashInfer's dispatch, bf16 combine and FP8 combine (the
medians, us) and FlashInfer / a2ad for each (above 1: a2ad faster; each side's dispatch is the
one of its bf16 run), then the lowest ratio. A point measured in several logs of one side
(runs of one build, repeated) counts as the mean of them; the table says how many. Logs of
another build must not be given together: nothing here can tell builds apart.

Reads text only (no GPU, no torch): the figures come from the harnesses' markdown tables.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

FP8_LABEL = "fp8 combine (low_precision)"  # kernel_timing's label of its FP8 rows
_A2AD_JOB = re.compile(r"^hidden (\d+), top_k (\d+), (\d+) experts, (\d+) ranks (.*)$")
_A2AD_ROW = re.compile(r"^\| (default|fp8 combine \(low_precision\)) \| (\d+) \| (\d+) \| (yes|no) \| "
                       r"([0-9.]+) \([^)]*\) \| ([0-9.]+) \(")
_FI_JOB = re.compile(r"^top_k (\d+), (\d+) experts, 2 ranks both on cuda:0")
_FI_ROW = re.compile(r"^\| flashinfer combine=(bf16|fp8) \| (\d+) \| (\d+) \| ([0-9.]+) \([^)]*\) \| ([0-9.]+) \(")
# (kinds of figures per point)
DISPATCH, BF16, FP8 = "dispatch", "bf16 combine", "FP8 combine"
KINDS = (DISPATCH, BF16, FP8)


class LogError(ValueError):
    """A log that is not what the table needs (named in the message)."""


def _add(points: dict, key: tuple[int, int], kind: str, value: float) -> None:
    points.setdefault(key, {}).setdefault(kind, []).append(value)


def parse_a2ad(text: str, name: str = "a2ad log", *, like_flashinfer: bool = True) -> tuple[dict, tuple[int, int, bool]]:
    """{(hidden, T): {kind: [us, ...]}} of one kernel_timing log, and its (top_k, experts, flush).
    Only its diag-0 rows count (the kernels as they serve). With ``like_flashinfer`` it must be
    a run FlashInfer's figures compare with: one GPU, two ranks, no degraded mode."""
    points: dict = {}
    job = None
    flush = None
    for line in text.splitlines():
        m = _A2AD_JOB.match(line.strip())
        if m:
            hidden, top_k, experts, ranks, where = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
            if like_flashinfer and ("--one-gpu" not in where or ranks != 2):
                raise LogError(f"{name}: a run of {ranks} ranks {where}; FlashInfer's figures are of two ranks "
                               "on one GPU, so only a kernel_timing --one-gpu run of two ranks compares with them")
            if like_flashinfer and "degrade" in where:
                raise LogError(f"{name}: a degrade job's run; FlashInfer's job has no degraded mode")
            job = (hidden, top_k, experts)
            continue
        m = _A2AD_ROW.match(line.strip())
        if not m:
            continue
        if job is None:
            raise LogError(f"{name}: a table row before the line naming the job (hidden ..., top_k ...)")
        label, T, diag, fl, d, c = m[1], int(m[2]), int(m[3]), m[4] == "yes", float(m[5]), float(m[6])
        if flush is not None and fl != flush:
            raise LogError(f"{name}: rows with and without the L2 flush")
        flush = fl
        if diag != 0:
            continue  # a diagnostic: not the kernels as they serve
        key = (job[0], T)
        if label == FP8_LABEL:
            _add(points, key, FP8, c)
        else:
            _add(points, key, DISPATCH, d)
            _add(points, key, BF16, c)
    if not points:
        raise LogError(f"{name}: no table rows of kernel_timing (run it with --no-diags --low-precision)")
    return points, (job[1], job[2], bool(flush))


def parse_flashinfer(text: str, name: str = "FlashInfer log") -> tuple[dict, tuple[int, int]]:
    """{(hidden, T): {kind: [us, ...]}} of one fi_timing log, and its (top_k, experts). A point
    that did not finish (a note instead of figures) is left out."""
    points: dict = {}
    job = None
    for line in text.splitlines():
        m = _FI_JOB.match(line.strip())
        if m:
            job = (int(m[1]), int(m[2]))
            continue
        m = _FI_ROW.match(line.strip())
        if not m:
            continue
        mode, T, hidden, d, c = m[1], int(m[2]), int(m[3]), float(m[4]), float(m[5])
        if mode == "fp8":
            _add(points, (hidden, T), FP8, c)
        else:
            _add(points, (hidden, T), DISPATCH, d)
            _add(points, (hidden, T), BF16, c)
    if not points or job is None:
        raise LogError(f"{name}: no table of fi_timing (its last lines: 'top_k ..., FlashInfer's kernels' and the table)")
    return points, job


def merge(logs: list[tuple[dict, tuple]]) -> tuple[dict, tuple]:
    """One side's logs together: the points' figures pooled; every log of one job shape."""
    pooled: dict = {}
    shape = None
    for points, job in logs:
        if shape is not None and job != shape:
            raise LogError(f"logs of different jobs on one side: {shape} and {job} (top_k, experts[, flush])")
        shape = job
        for key, kinds in points.items():
            for kind, values in kinds.items():
                for v in values:
                    _add(pooled, key, kind, v)
    return pooled, shape


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(a2ad: dict, fi: dict) -> tuple[list[str], dict]:
    """The markdown lines and {"lowest": (ratio, kind, hidden, T), "points": n, "t1": {...}}."""
    keys = sorted(set(a2ad) & set(fi), key=lambda k: (-k[0], k[1]))
    lines = ["| T | hidden | a2ad (dispatch / bf16 combine / FP8 combine) | FlashInfer (same) "
             "| dispatch | bf16 combine | FP8 combine | runs (a2ad / FI) |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    lowest = None
    t1: dict = {}

    def fmt(side: dict, kind: str) -> str:
        return f"{_mean(side[kind]):.2f}" if side.get(kind) else "-"

    for hidden, T in keys:
        a, f = a2ad[(hidden, T)], fi[(hidden, T)]
        ratios = []
        for kind in KINDS:
            if a.get(kind) and f.get(kind):
                r = _mean(f[kind]) / _mean(a[kind])
                ratios.append(f"{r:.2f}")
                if lowest is None or r < lowest[0]:
                    lowest = (r, kind, hidden, T)
            else:
                ratios.append("-")
        if T == 1:
            t1[hidden] = {kind: _mean(a[kind]) for kind in KINDS if a.get(kind)}
        runs = f"{len(a.get(DISPATCH, a.get(FP8, [])))} / {len(f.get(DISPATCH, f.get(FP8, [])))}"
        lines.append(f"| {T} | {hidden} | {' / '.join(fmt(a, k) for k in KINDS)} | "
                     f"{' / '.join(fmt(f, k) for k in KINDS)} | {' | '.join(ratios)} | {runs} |")
    return lines, {"lowest": lowest, "points": len(keys), "t1": t1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m a2ad.bench.small_t", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a2ad_logs", nargs="+", type=Path, metavar="A2AD_LOG", help="kernel_timing output")
    ap.add_argument("--flashinfer", nargs="+", type=Path, required=True, metavar="FI_LOG", help="fi_timing output")
    args = ap.parse_args(argv)
    try:
        a2ad, a_job = merge([parse_a2ad(p.read_text(), str(p)) for p in args.a2ad_logs])
        fi, f_job = merge([parse_flashinfer(p.read_text(), str(p)) for p in args.flashinfer])
    except (OSError, LogError) as exc:
        print(f"small_t: {exc}", file=sys.stderr)
        return 2
    if a_job[:2] != f_job:
        print(f"small_t: a2ad's runs are of top_k {a_job[0]}, {a_job[1]} experts, FlashInfer's of top_k "
              f"{f_job[0]}, {f_job[1]} experts: not the same job", file=sys.stderr)
        return 2
    lines, summary = table(a2ad, fi)
    if summary["points"] == 0:
        print(f"small_t: no (hidden, T) measured by both sides (a2ad: {sorted(a2ad)}, FlashInfer: {sorted(fi)})",
              file=sys.stderr)
        return 2
    flush = "L2 flushed before each round" if a_job[2] else "no L2 flush on a2ad's side"
    print(f"top_k {a_job[0]}, {a_job[1]} experts, two ranks on one GPU, {flush}; us (medians), "
          "FlashInfer / a2ad (above 1: a2ad faster)\n")
    print("\n".join(lines))
    r, kind, hidden, T = summary["lowest"]
    print(f"\nlowest FlashInfer / a2ad: {r:.2f} ({kind}, hidden {hidden}, T={T})")
    for hidden, figs in sorted(summary["t1"].items(), reverse=True):
        print(f"T=1, hidden {hidden}: " + ", ".join(f"{k} {v:.2f} us" for k, v in figs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
