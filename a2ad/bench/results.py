"""Result rows and what is derived from them: latency statistics and bandwidths per row, speedups
over NCCL, graph-vs-graph and eager-vs-eager comparisons, how the a2ad graphs were built, and
the targets."""

from __future__ import annotations

from .common import EAGER_OF, IMPL_MODE, IMPLS
from .timing import summarize
from .workload import combine_bytes_per_token, dispatch_bytes_per_token, gbps, logical_bytes


def build_row(impl: str, tokens: int, hidden: int, ep: int, top_k: int, num_experts: int,
              dispatch_us: list[float] | None, combine_us: list[float] | None, total_us: list[float] | None,
              remote: dict, **extra) -> dict:
    """One result row: latency statistics and the derived bandwidths (per GPU)."""
    d, c, t = summarize(dispatch_us or []), summarize(combine_us or []), summarize(total_us or [])
    dbpt, cbpt = dispatch_bytes_per_token(hidden, top_k), combine_bytes_per_token(hidden)
    rd, rc = remote.get("dispatch_bytes"), remote.get("combine_bytes")
    ld, lc = logical_bytes(tokens, ep, top_k, dbpt), logical_bytes(tokens, ep, top_k, cbpt)
    med = lambda s: s["median"] if s else None  # noqa: E731
    row = {
        "impl": impl,
        "tokens": tokens,
        "hidden": hidden,
        "ep": ep,
        "top_k": top_k,
        "num_experts": num_experts,
        "dispatch_us": d,
        "combine_us": c,
        "total_us": t,
        "bytes_per_token": {"dispatch": dbpt, "combine": cbpt},
        "remote_bytes": {"dispatch": rd, "combine": rc, "pairs_per_token": remote.get("pairs_per_token")},
        "logical_bytes": {"dispatch": ld, "combine": lc},
        "remote_gbps": {
            "dispatch": gbps(rd, med(d)),
            "combine": gbps(rc, med(c)),
            "total": gbps((rd or 0) + (rc or 0), med(t)) if rd is not None and rc is not None else None,
        },
        "logical_gbps": {"dispatch": gbps(ld, med(d)), "combine": gbps(lc, med(c)), "total": gbps(ld + lc, med(t))},
    }
    row.update(extra)
    return row


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_nccl`` = NCCL's median total / this row's, same tokens and hidden, same run."""
    base = {(r["tokens"], r["hidden"]): r for r in rows if r["impl"] == "nccl" and r.get("total_us")}
    for r in rows:
        b = base.get((r["tokens"], r["hidden"]))
        if b is not None and r.get("total_us") and r["total_us"]["median"] > 0:
            r["speedup_vs_nccl"] = b["total_us"]["median"] / r["total_us"]["median"]
        else:
            r["speedup_vs_nccl"] = None


def _med(row: dict | None, key: str = "total_us") -> float | None:
    if not row or not row.get(key):
        return None
    return row[key].get("median")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def _index(rows: list[dict]) -> dict:
    return {(r["impl"], r["tokens"], r["hidden"]): r for r in rows}


def add_comparisons(rows: list[dict]) -> None:
    """Per row, its timing ``mode`` (graph or eager) and, where the counterpart ran at the same
    point: ``ratio_vs_a2ad`` (this row's median over a2ad's of the same mode: a graph row over
    ``a2ad``, an eager row over ``a2ad-eager``; above 1 means a2ad is faster) and, on the eager
    rows of a2ad and FlashInfer, ``eager_overhead_us`` (eager median - graph median)."""
    idx = _index(rows)
    for r in rows:
        mode = IMPL_MODE.get(r["impl"], "eager")
        r["mode"] = mode
        base_impl = "a2ad" if mode == "graph" else "a2ad-eager"
        r["ratio_vs_a2ad"] = None
        if r["impl"] != base_impl:
            b = idx.get((base_impl, r["tokens"], r["hidden"]))
            if b is not None:
                r["ratio_vs_a2ad"] = {"baseline": base_impl, **{
                    ph: _ratio(_med(r, f"{ph}_us"), _med(b, f"{ph}_us")) for ph in ("dispatch", "combine", "total")}}
        if r["impl"] in EAGER_OF:
            g = idx.get((EAGER_OF[r["impl"]], r["tokens"], r["hidden"]))
            r["eager_overhead_us"] = None if g is None else {
                "graph": g["impl"],
                **{ph: (_med(r, f"{ph}_us") - _med(g, f"{ph}_us")
                        if _med(r, f"{ph}_us") is not None and _med(g, f"{ph}_us") is not None else None)
                   for ph in ("dispatch", "combine", "total")}}


def _phases(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {ph: _med(row, f"{ph}_us") for ph in ("dispatch", "combine", "total")}


def comparisons(rows: list[dict]) -> dict:
    """Like-for-like comparisons per point (T, hidden): ``graph_vs_graph`` (a2ad and FlashInfer
    from CUDA graphs, FI/a2ad per phase) and ``eager_vs_eager`` (every eager implementation's
    medians, its pair over a2ad-eager's, and the eager overhead of a2ad and FlashInfer)."""
    idx = _index(rows)
    points = sorted({(r["tokens"], r["hidden"]) for r in rows}, key=lambda p: (-p[1], p[0]))
    graph, eager = [], []
    for T, H in points:
        a, f = idx.get(("a2ad", T, H)), idx.get(("flashinfer", T, H))
        if a is not None or f is not None:
            pa, pf = _phases(a), _phases(f)
            graph.append({"tokens": T, "hidden": H, "a2ad": pa, "flashinfer": pf,
                          "fi_over_a2ad": {ph: _ratio(pf[ph], pa[ph]) for ph in pa} if pa and pf else None})
        er = {i: idx.get((i, T, H)) for i in IMPLS if IMPL_MODE[i] == "eager"}
        if not any(er.values()):
            continue
        ae = er.get("a2ad-eager")
        entry = {"tokens": T, "hidden": H, **{i: _phases(v) for i, v in er.items()}}
        entry["over_a2ad_eager"] = {i: _ratio(_med(v), _med(ae)) for i, v in er.items()
                                    if i != "a2ad-eager" and v is not None} if ae is not None else {}
        fe = er.get("flashinfer-eager")
        entry["fi_over_a2ad"] = ({ph: _ratio(_med(fe, f"{ph}_us"), _med(ae, f"{ph}_us"))
                                  for ph in ("dispatch", "combine", "total")} if ae and fe else None)
        for impl, key in (("a2ad-eager", "a2ad_eager_overhead_us"), ("flashinfer-eager", "fi_eager_overhead_us")):
            g = idx.get((EAGER_OF[impl], T, H))
            entry[key] = (_med(er[impl]) - _med(g)) if _med(er.get(impl)) is not None and _med(g) is not None else None
        eager.append(entry)
    return {"graph_vs_graph": graph, "eager_vs_eager": eager}


def capture_summary(rows: list[dict], requested: str | None) -> dict:
    """How the a2ad graphs were built over the run: through the public API or the plane, and why."""
    a = [r for r in rows if r["impl"] == "a2ad"]
    out = {"requested": requested, "api_points": sum(1 for r in a if r.get("capture") == "api"),
           "plane_points": sum(1 for r in a if r.get("capture") == "plane"), "fallbacks": [], "why": []}
    for r in a:
        if r.get("capture_fallback"):
            out["fallbacks"].append({"tokens": r["tokens"], "hidden": r["hidden"], "exception": r["capture_fallback"]})
        w = r.get("capture_why")
        if w and w not in out["why"]:
            out["why"].append(w)
    return out


def ce_per_gpu_gbps(ceilings: dict) -> float | None:
    ce = (ceilings or {}).get("ce_two_way")
    return ce.get("per_gpu_gbps") if ce else None


# --- targets -----------------------------------------------------------------------------
#: The targets.
TARGET_DISPATCH_CE_FRACTION = 0.90
TARGET_COMBINE_CE_FRACTION = 0.85
TARGET_T1_DISPATCH_US = 10.0
TARGET_T1_COMBINE_US = 10.0
TARGET_VS_FLASHINFER = 1.05  # FI/a2ad, graph vs graph, dispatch and combine each, every T
TARGET_SPEEDUP_SMALL = 2.0  # T <= 1024
TARGET_SPEEDUP_4096 = 1.4
TARGET_EAGER_OVERHEAD_T1_US = 30.0  # a2ad eager pair - a2ad graph pair at T=1


def evaluate_targets(rows: list[dict], ceilings: dict) -> list[dict]:
    """The targets, per hidden size: the project's against the a2ad (CUDA graph) rows of this run,
    and the eager ones (a2ad's eager overhead at T=1; a2ad's eager pair against FlashInfer's)."""
    out = []
    ce = ce_per_gpu_gbps(ceilings)
    hiddens = sorted({r["hidden"] for r in rows}, reverse=True)
    for h in hiddens:
        a = {r["tokens"]: r for r in rows if r["impl"] == "a2ad" and r["hidden"] == h and r.get("dispatch_us")}

        def item(name, target, measured, passed, detail=""):
            status = "n/a" if measured is None else ("PASS" if passed else "MISS")
            out.append({"hidden": h, "name": name, "target": target, "measured": measured, "status": status,
                        "detail": detail})

        r = a.get(4096)
        for phase, frac in (("dispatch", TARGET_DISPATCH_CE_FRACTION), ("combine", TARGET_COMBINE_CE_FRACTION)):
            bw = r["remote_gbps"][phase] if r else None
            m = bw / ce if (bw is not None and ce) else None
            item(f"T=4096 {phase} remote GB/s / copy-engine two-way", f">= {frac:.0%}", m,
                 m is not None and m >= frac,
                 f"{bw:.1f} GB/s vs {ce:.1f} GB/s per GPU" if m is not None else "needs T=4096 and the CE ceiling")
        r1 = a.get(1)
        for phase, lim in (("dispatch", TARGET_T1_DISPATCH_US), ("combine", TARGET_T1_COMBINE_US)):
            m = r1[f"{phase}_us"]["median"] if r1 and r1.get(f"{phase}_us") else None
            item(f"T=1 {phase} latency (us)", f"<= {lim:g}", m, m is not None and m <= lim)
        # graph vs graph against FlashInfer, each phase at every T of the run
        fi = {r["tokens"]: r for r in rows if r["impl"] == "flashinfer" and r["hidden"] == h and r.get("dispatch_us")}
        for phase in ("dispatch", "combine"):
            pts = [(t, _ratio(_med(fi[t], f"{phase}_us"), _med(a[t], f"{phase}_us"))) for t in sorted(set(a) & set(fi))]
            pts = [(t, x) for t, x in pts if x is not None]
            m = min(x for _, x in pts) if pts else None
            item(f"{phase} vs FlashInfer, graph vs graph, every T (min FI/a2ad)", f">= {TARGET_VS_FLASHINFER:g}x", m,
                 m is not None and m >= TARGET_VS_FLASHINFER,
                 ", ".join(f"T={t}: {x:.2f}x" for t, x in pts) if pts else "needs flashinfer rows")
        small = [(t, a[t].get("speedup_vs_nccl")) for t in sorted(a) if t <= 1024]
        small = [(t, s) for t, s in small if s is not None]
        m = min(s for _, s in small) if small else None
        item("dispatch+combine speedup vs NCCL, T<=1024 (min)", f">= {TARGET_SPEEDUP_SMALL:g}x", m,
             m is not None and m >= TARGET_SPEEDUP_SMALL,
             ", ".join(f"T={t}: {s:.2f}x" for t, s in small) + (" (a2ad graph vs NCCL eager)" if small else ""))
        s4 = a[4096].get("speedup_vs_nccl") if 4096 in a else None
        item("dispatch+combine speedup vs NCCL, T=4096", f">= {TARGET_SPEEDUP_4096:g}x", s4,
             s4 is not None and s4 >= TARGET_SPEEDUP_4096, "a2ad graph vs NCCL eager (NCCL's path cannot be captured)")
        # eager figures: the public API as a user calls it
        ae = {r["tokens"]: r for r in rows if r["impl"] == "a2ad-eager" and r["hidden"] == h and r.get("total_us")}
        fe = {r["tokens"]: r for r in rows if r["impl"] == "flashinfer-eager" and r["hidden"] == h
              and r.get("total_us")}
        m, detail = None, "needs the a2ad and a2ad-eager rows at T=1"
        if 1 in ae and 1 in a and a[1].get("total_us"):
            g, e = _med(a[1]), _med(ae[1])
            m, detail = e - g, f"eager pair {e:.2f} us, graph pair {g:.2f} us"
        item("T=1 a2ad eager pair - graph pair (us)", f"<= {TARGET_EAGER_OVERHEAD_T1_US:g}", m,
             m is not None and m <= TARGET_EAGER_OVERHEAD_T1_US, detail)
        both = [(t, _ratio(_med(fe[t]), _med(ae[t]))) for t in sorted(set(ae) & set(fe))]
        both = [(t, x) for t, x in both if x is not None]
        m = min(x for _, x in both) if both else None
        item("a2ad eager pair faster than FlashInfer's eager pair, every T (min FI/a2ad)", "> 1x", m,
             m is not None and m > 1.0,
             ", ".join(f"T={t}: {x:.2f}x" for t, x in both) if both else "needs flashinfer-eager rows")
    return out
