"""``--plot``: latency and bandwidth against tokens per rank (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from .common import IMPL_LABELS, IMPLS
from .results import ce_per_gpu_gbps, comparisons
from .workload import gbps


PLOT_HINT = "pip install matplotlib for --plot (a2ad's bench extra: pip install '.[bench]' in a clone of a2ad)"


def plot_unavailable() -> str | None:
    """Why --plot cannot work here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"--plot needs matplotlib, which is not installed ({exc}): {PLOT_HINT}"
    return None


#: Per phase: line style, line width, and the opacity of its p10-p90 band.
PHASE_STYLES = (("total", "-", 2.0, 0.18), ("dispatch", "--", 1.0, 0.08), ("combine", ":", 1.0, 0.08))


def _spread(row: dict, phase: str) -> tuple:
    """``(p10, p90)`` of a phase's latency in us, or ``(None, None)`` where the row has none."""
    s = row.get(f"{phase}_us") or {}
    return s.get("p10"), s.get("p90")


def _gbps_spread(row: dict, phase: str) -> tuple:
    """The remote bandwidth over the p10-p90 latencies of a phase: ``(low, high)`` GB/s per GPU."""
    rb = row.get("remote_bytes") or {}
    d, c = rb.get("dispatch"), rb.get("combine")
    nbytes = (d + c if d is not None and c is not None else None) if phase == "total" else rb.get(phase)
    p10, p90 = _spread(row, phase)
    return gbps(nbytes, p90), gbps(nbytes, p10)


def _band(ax, pts, color, alpha: float) -> None:
    """Shade ``(x, low, high)`` points (those with both bounds): a band, or a bar for one point."""
    pts = [(x, lo, hi) for x, lo, hi in pts if lo is not None and hi is not None and 0 < lo <= hi]
    if len(pts) > 1:
        xs, lo, hi = zip(*pts)
        ax.fill_between(xs, lo, hi, color=color, alpha=alpha, lw=0)
    elif pts:
        x, lo, hi = pts[0]
        ax.vlines(x, lo, hi, color=color, alpha=min(1.0, 3 * alpha), lw=4)


def _ceilings(ax, ce: float | None, sm: float | None) -> None:
    """The NVLink ceilings as labelled horizontal lines, with room above them on the axis."""
    lines = sorted(((v, label, ls) for v, label, ls in ((ce, "copy engine two-way", "-."),
                                                        (sm, "SM peer store two-way", (0, (4, 2)))) if v),
                   key=lambda x: -x[0])
    if not lines:
        return
    for i, (v, label, ls) in enumerate(lines):
        ax.axhline(v, color="black", ls=ls, lw=1.6, zorder=3)
        value = f"{v:.0f}" if v >= 100 else f"{v:.3g}"  # CPU dry runs give tiny figures
        # the highest label above its line, the other below its own: close ceilings stay readable
        ax.text(0.01, v, f" {label}: {value} GB/s per GPU", transform=ax.get_yaxis_transform(), fontsize=7,
                ha="left", va="bottom" if i == 0 else "top", zorder=4)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, max(hi, lines[0][0] * 4))


def plot(result: dict, path) -> str | None:
    """PNG: per hidden size, latency (total solid, dispatch dashed, combine dotted) and remote GB/s
    vs tokens per rank, one colour per implementation, log axes; the p10-p90 range of every median
    shaded around its line, the NVLink ceilings as labelled horizontal lines on the bandwidth
    panels. Returns None or why it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc}); no plot ({PLOT_HINT})"
    rows = result["rows"]
    hiddens = sorted({r["hidden"] for r in rows}, reverse=True)
    if not hiddens:
        return "no rows to plot"
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    colors = {"a2ad": "tab:red", "a2ad-eager": "tab:orange", "flashinfer": "tab:purple",
              "flashinfer-eager": "tab:pink", "nccl": "tab:blue", "agrs": "tab:green"}
    comp = comparisons(rows)
    with_ratio = any(e.get("fi_over_a2ad") for k in ("graph_vs_graph", "eager_vs_eager") for e in comp[k])
    ncols = 3 if with_ratio else 2
    fig, axes = plt.subplots(len(hiddens), ncols, figsize=(6.5 * ncols, 4.2 * len(hiddens)), squeeze=False)
    ce = ce_per_gpu_gbps(result.get("ceilings") or {})
    sm = ((result.get("ceilings") or {}).get("sm_store_two_way") or {}).get("per_gpu_gbps")
    for row_i, h in enumerate(hiddens):
        ax_l, ax_b = axes[row_i][:2]
        if with_ratio:
            ax_r = axes[row_i][2]
            for key, label, color in (("graph_vs_graph", "graph vs graph", "tab:purple"),
                                      ("eager_vs_eager", "eager vs eager", "tab:pink")):
                pts = [(e["tokens"], e["fi_over_a2ad"]["total"]) for e in comp[key]
                       if e["hidden"] == h and e.get("fi_over_a2ad") and e["fi_over_a2ad"].get("total")]
                if pts:
                    ax_r.plot(*zip(*pts), "-", color=color, marker="o", ms=3, label=f"FI/a2ad pair, {label}")
            ax_r.axhline(1.0, color="gray", ls=":", lw=1)
            ax_r.set_xscale("log", base=2)
            ax_r.set_xlabel("tokens per rank")
            ax_r.set_ylabel("FlashInfer / a2ad (median pair)")
            ax_r.set_title(f"hidden {h}: FI/a2ad above 1 means a2ad is faster", fontsize=9)
            ax_r.grid(True, which="both", alpha=0.3)
            ax_r.legend(fontsize=7, loc="best")
        for impl in impls:
            rs = sorted((r for r in rows if r["impl"] == impl and r["hidden"] == h), key=lambda r: r["tokens"])
            color = colors.get(impl)
            for phase, style, lw, alpha in PHASE_STYLES:
                label = IMPL_LABELS.get(impl, impl) if phase == "total" else None
                pts = [(r["tokens"], r[f"{phase}_us"]["median"]) for r in rs if r.get(f"{phase}_us")]
                if pts:
                    ax_l.plot(*zip(*pts), style, color=color, lw=lw, marker="o", ms=3, label=label)
                _band(ax_l, [(r["tokens"], *_spread(r, phase)) for r in rs], color, alpha)
                pts = [(r["tokens"], r["remote_gbps"][phase]) for r in rs if r["remote_gbps"].get(phase)]
                if pts:
                    ax_b.plot(*zip(*pts), style, color=color, lw=lw, marker="o", ms=3, label=label)
                _band(ax_b, [(r["tokens"], *_gbps_spread(r, phase)) for r in rs], color, alpha)
        for ax, ylab in ((ax_l, "latency, us (median)"), (ax_b, "remote GB/s per GPU")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylab)
            ax.grid(True, which="both", alpha=0.3)
        ax_l.legend(fontsize=7, loc="best")
        ax_b.legend(fontsize=7, loc="lower right")
        _ceilings(ax_b, ce, sm)
        ax_l.set_title(f"hidden {h}: latency, medians, shaded p10-p90\n"
                       "(solid: dispatch+combine, dashed: dispatch, dotted: combine)", fontsize=9)
        ax_b.set_title(f"hidden {h}: remote bandwidth, medians, shaded p10-p90\n"
                       "(same line styles; black lines: the NVLink ceilings)", fontsize=9)
    hw = result.get("hardware") or {}
    fig.suptitle(f"a2ad-bench: ep={result['config'].get('ep')} x {hw.get('device_name', '?')}, "
                 f"top_k={result['config'].get('top_k')}, {result['config'].get('num_experts')} experts, "
                 f"{result['config'].get('routing')} routing", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
