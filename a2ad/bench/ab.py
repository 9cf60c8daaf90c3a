"""Builds of the kernels side by side, from kernel_timing logs: each build's means, and how
often and by how much each build is faster than the first, run by run.

    python -m a2ad.bench.ab --build main LOG [LOG ...] --build new LOG [LOG ...] [--build ...]

A LOG is what ``A2AD_KERNEL_TIMING=1 A2AD_CSRC=<tree>/csrc python -m a2ad.bench.kernel_timing
--no-diags --low-precision --hidden H --tokens ...`` printed for one build. The logs of a
build are its runs. Give every build's logs in the same order, pass by pass (run i of every
build from pass i, the passes in alternating build orders), so that a build's i-th run of a
point pairs with the first build's i-th run of it (where the counts differ, only the first
runs of the longer side pair up): drift during a call then falls on both sides of a pair. Every log must be of one job shape (top_k, experts, the L2 flush).

For each (hidden, T) it prints each build's mean dispatch, bf16 combine and FP8 combine (us;
a log that printed a point twice counts once, as the mean of the two), then, for each later
build and each figure, the mean of its run-pair differences against the first build (us;
negative: faster) and in how many of the pairs it was faster. Reads text only (no GPU, no
torch). docs/PERF.md's before/after tables are of this form.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import fmean as _mean

from a2ad.bench.small_t import KINDS, LogError, parse_a2ad


def runs(logs: list[tuple[str, str]]) -> tuple[dict, tuple]:
    """{(hidden, T): {kind: [one value per log that has the point, in log order]}} of one
    build's logs (name, text), and their job shape."""
    out: dict = {}
    shape = None
    for name, text in logs:
        points, job = parse_a2ad(text, name, like_flashinfer=False)
        if shape is not None and job != shape:
            raise LogError(f"{name}: another job shape than the build's earlier logs: {job} against {shape} "
                           "(top_k, experts, L2 flush)")
        shape = job
        for key, kinds in points.items():
            for kind, values in kinds.items():
                out.setdefault(key, {}).setdefault(kind, []).append(_mean(values))
    return out, shape


def compare(builds: list[tuple[str, dict]]) -> list[str]:
    """The markdown lines of the means table and of the run-pair table (builds after the first
    against the first)."""
    names = [n for n, _ in builds]
    keys = sorted({k for _, pts in builds for k in pts}, key=lambda k: (k[0], k[1]))
    head = "| T | hidden | " + " | ".join(f"{kind} {n}" if i == 0 else n for kind in KINDS
                                             for i, n in enumerate(names)) + " |"
    lines = ["means, us (runs of each build: the count in brackets where builds differ)", "", head,
             "|--:|--:|" + "--:|" * (len(KINDS) * len(names))]
    for hidden, T in keys:
        cells = []
        for kind in KINDS:
            counts = {len(pts.get((hidden, T), {}).get(kind, [])) for _, pts in builds}
            for _, pts in builds:
                vs = pts.get((hidden, T), {}).get(kind, [])
                cell = f"{_mean(vs):.2f}" if vs else "-"
                if vs and len(counts) > 1:
                    cell += f" ({len(vs)})"
                cells.append(cell)
        lines.append(f"| {T} | {hidden} | " + " | ".join(cells) + " |")
    base_name, base = builds[0]
    for name, pts in builds[1:]:
        lines += ["", f"{name} against {base_name}, run by run: the mean difference (us; negative: {name} faster) "
                  "and the pairs where it was faster", "",
                  "| T | hidden | " + " | ".join(KINDS) + " |", "|--:|--:|" + "--:|" * len(KINDS)]
        for hidden, T in keys:
            cells = []
            for kind in KINDS:
                mine = pts.get((hidden, T), {}).get(kind, [])
                theirs = base.get((hidden, T), {}).get(kind, [])
                pairs = list(zip(mine, theirs))
                if not pairs:
                    cells.append("-")
                    continue
                diffs = [a - b for a, b in pairs]
                cells.append(f"{_mean(diffs):+.2f} ({sum(d < 0 for d in diffs)} of {len(diffs)})")
            lines.append(f"| {T} | {hidden} | " + " | ".join(cells) + " |")
    return lines


def _builds(argv: list[str]) -> list[tuple[str, list[Path]]]:
    """--build NAME LOG [LOG ...] groups, in order."""
    builds: list[tuple[str, list[Path]]] = []
    i = 0
    while i < len(argv):
        if argv[i] != "--build":
            raise LogError(f"expected --build NAME LOG [LOG ...], got {argv[i]!r}")
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise LogError("--build needs a name")
        name, logs = argv[i + 1], []
        i += 2
        while i < len(argv) and argv[i] != "--build":
            logs.append(Path(argv[i]))
            i += 1
        if not logs:
            raise LogError(f"build {name!r}: no logs")
        if name in (n for n, _ in builds):
            raise LogError(f"build {name!r} named twice")
        builds.append((name, logs))
    if len(builds) < 2:
        raise LogError("at least two builds (--build NAME LOG ... --build NAME LOG ...)")
    return builds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        parsed = []
        shape = None
        for name, paths in _builds(argv):
            pts, job = runs([(str(p), p.read_text()) for p in paths])
            if shape is not None and job != shape:
                raise LogError(f"build {name!r}: another job shape than the first build's: {job} against {shape}")
            shape = job
            parsed.append((name, pts))
    except (OSError, LogError) as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    flush = "L2 flushed before each round" if shape[2] else "no L2 flush"
    print(f"top_k {shape[0]}, {shape[1]} experts, {flush}; kernel_timing medians, us\n")
    print("\n".join(compare(parsed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
