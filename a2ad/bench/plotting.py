"""``--plot``: latency and bandwidth against tokens per rank (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from .common import IMPL_LABELS, IMPLS
from .results import ce_per_gpu_gbps, comparisons


PLOT_HINT = "pip install 'a2ad[bench]' for --plot"


def plot_unavailable() -> str | None:
    """Why --plot cannot work here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"--plot needs matplotlib, which is not installed ({exc}): {PLOT_HINT}"
    return None


def plot(result: dict, path) -> str | None:
    """PNG: per hidden size, latency (total solid, dispatch dashed, combine dotted) and remote GB/s
    vs tokens per rank, one colour per implementation, log axes. Returns None or why it could not."""
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
            for key, style, lw in (("total_us", "-", 2.0), ("dispatch_us", "--", 1.0), ("combine_us", ":", 1.0)):
                pts = [(r["tokens"], r[key]["median"]) for r in rs if r.get(key)]
                if pts:
                    ax_l.plot(*zip(*pts), style, color=colors.get(impl), lw=lw, marker="o", ms=3,
                              label=IMPL_LABELS.get(impl, impl) if key == "total_us" else None)
            for key, style, lw in (("total", "-", 2.0), ("dispatch", "--", 1.0), ("combine", ":", 1.0)):
                pts = [(r["tokens"], r["remote_gbps"][key]) for r in rs if r["remote_gbps"].get(key)]
                if pts:
                    ax_b.plot(*zip(*pts), style, color=colors.get(impl), lw=lw, marker="o", ms=3,
                              label=IMPL_LABELS.get(impl, impl) if key == "total" else None)
        if ce:
            ax_b.axhline(ce, color="gray", ls="-.", lw=1, label=f"copy engine two-way ({ce:.0f} GB/s per GPU)")
        if sm:
            ax_b.axhline(sm, color="black", ls=(0, (1, 3)), lw=1, label=f"SM peer store two-way ({sm:.0f} GB/s per GPU)")
        for ax, ylab in ((ax_l, "latency, us (median)"), (ax_b, "remote GB/s per GPU")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel(ylab)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        ax_l.set_title(f"hidden {h}: latency (solid: dispatch+combine, dashed: dispatch, dotted: combine)", fontsize=9)
        ax_b.set_title(f"hidden {h}: remote bandwidth (same line styles)", fontsize=9)
    hw = result.get("hardware") or {}
    fig.suptitle(f"a2ad-bench: ep={result['config'].get('ep')} x {hw.get('device_name', '?')}, "
                 f"top_k={result['config'].get('top_k')}, {result['config'].get('num_experts')} experts, "
                 f"{result['config'].get('routing')} routing", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
