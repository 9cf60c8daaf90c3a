"""The report: the results table (plain and markdown), the comparison tables, the ceilings and
targets lines, the text report on stdout, JSON and the PERF.md document."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .common import IMPL_MODE, IMPL_NOTES, IMPLS
from .results import capture_summary, comparisons


# --- tables ------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}", none="-") -> str:
    return none if x is None else fmt.format(x)


def _bw(x) -> str:
    """A bandwidth with 3-4 significant digits (CPU dry runs give tiny figures)."""
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


TABLE_COLUMNS = ("impl", "mode", "T", "hidden", "disp us", "comb us", "total us", "total p10-p90",
                 "remote GB/s d/c", "logical GB/s d/c", "vs NCCL*", "check", "note")
#: Footnote of every table with the "vs NCCL*" column.
VS_NCCL_NOTE = ("* vs NCCL: NCCL's median dispatch+combine over this row's, same T and hidden. NCCL's Megatron "
                "path cannot be captured (its splits need a host sync), so for graph rows this compares a CUDA "
                "graph with an eager baseline; the eager-vs-eager table compares like with like.")


#: The mode column of a CPU run's would-be graph rows: no CUDA graph exists there, the stand-in
#: records the calls once and runs them again on every replay.
CPU_REPLAY = "cpu-replay"


def table_cells(r: dict) -> list[str]:
    med = lambda k: r[k]["median"] if r.get(k) else None  # noqa: E731
    t = r.get("total_us")
    chk = r.get("check") or {}
    check = "ok" if chk.get("ok") else ("FAIL" if chk.get("ok") is False else "-")
    note = IMPL_NOTES.get(r["impl"], "")
    if r["impl"] == "a2ad" and r.get("capture"):
        note = f"{r['capture']} capture" + (" (fallback)" if r.get("capture_fallback") or
                                            "failed" in (r.get("capture_why") or "") else "")
    mode = r.get("mode") or IMPL_MODE.get(r["impl"], "-")
    if mode == "graph" and str(r.get("timing", "")).startswith("cpu stand-in"):
        mode = CPU_REPLAY  # a CPU run has no CUDA graphs: the captured calls were run again
    return [
        r["impl"],
        mode,
        str(r["tokens"]),
        str(r["hidden"]),
        _f(med("dispatch_us"), "{:.2f}"),
        _f(med("combine_us"), "{:.2f}"),
        _f(med("total_us"), "{:.2f}"),
        f"{t['p10']:.1f}-{t['p90']:.1f}" if t else "-",
        f"{_bw(r['remote_gbps']['dispatch'])}/{_bw(r['remote_gbps']['combine'])}",
        f"{_bw(r['logical_gbps']['dispatch'])}/{_bw(r['logical_gbps']['combine'])}",
        _f(r.get("speedup_vs_nccl"), "{:.2f}x"),
        check,
        note,
    ]


def sort_rows(rows: list[dict]) -> list[dict]:
    order = {k: i for i, k in enumerate(IMPLS)}
    return sorted(rows, key=lambda r: (-r["hidden"], r["tokens"], order.get(r["impl"], 99), r["impl"]))


def _grid(headers, body: list[list[str]], left: int, md: bool) -> str:
    """A table: aligned plain text, or markdown; the first ``left`` columns are left-aligned."""
    if md:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" if i < left or h == "note" else "--:" for i, h in enumerate(headers)) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
    lefts = {i for i, h in enumerate(headers) if i < left or h == "note"}
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i in lefts else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    ).rstrip()
    lines = [fmt(list(headers)), fmt(["-" * w for w in widths])]
    lines += [fmt(b) for b in body]
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """Aligned plain-text table, one row per implementation x tokens x hidden."""
    return _grid(TABLE_COLUMNS, [table_cells(r) for r in sort_rows(rows)], 2, md=False)


def format_markdown_table(rows: list[dict]) -> str:
    return _grid(TABLE_COLUMNS, [table_cells(r) for r in sort_rows(rows)], 2, md=True)


GRAPH_COLUMNS = ("T", "hidden", "a2ad disp", "a2ad comb", "a2ad pair", "FI disp", "FI comb", "FI pair",
                 "FI/a2ad disp", "FI/a2ad comb", "FI/a2ad pair")
EAGER_COLUMNS = ("T", "hidden", "a2ad-eager pair", "FI-eager pair", "FI/a2ad", "nccl pair", "nccl/a2ad",
                 "agrs pair", "agrs/a2ad", "a2ad eager-graph", "FI eager-graph")


def _us(x) -> str:
    return _f(x, "{:.2f}")


def _x(x) -> str:
    return _f(x, "{:.2f}")


def format_graph_comparison(comp: dict, md: bool = False) -> str:
    """Graph vs graph: a2ad and FlashInfer from CUDA graphs of their public API (us, medians)."""
    body = []
    for e in comp.get("graph_vs_graph") or []:
        a, f, q = e.get("a2ad") or {}, e.get("flashinfer") or {}, e.get("fi_over_a2ad") or {}
        body.append([str(e["tokens"]), str(e["hidden"]),
                     *(_us(a.get(k)) for k in ("dispatch", "combine", "total")),
                     *(_us(f.get(k)) for k in ("dispatch", "combine", "total")),
                     *(_x(q.get(k)) for k in ("dispatch", "combine", "total"))])
    return _grid(GRAPH_COLUMNS, body, 0, md) if body else "(no graph rows)"


def format_eager_comparison(comp: dict, md: bool = False) -> str:
    """Eager vs eager: every eager implementation's pair (us, medians), its ratio over a2ad-eager,
    and the eager overhead (eager pair - graph pair) of a2ad and FlashInfer."""
    body = []
    for e in comp.get("eager_vs_eager") or []:
        over = e.get("over_a2ad_eager") or {}
        pair = lambda i: (e.get(i) or {}).get("total")  # noqa: E731
        body.append([str(e["tokens"]), str(e["hidden"]), _us(pair("a2ad-eager")), _us(pair("flashinfer-eager")),
                     _x(over.get("flashinfer-eager")), _us(pair("nccl")), _x(over.get("nccl")),
                     _us(pair("agrs")), _x(over.get("agrs")),
                     _f(e.get("a2ad_eager_overhead_us"), "{:+.2f}"), _f(e.get("fi_eager_overhead_us"), "{:+.2f}")])
    return _grid(EAGER_COLUMNS, body, 0, md) if body else "(no eager rows)"


# --- lines -------------------------------------------------------------------------------
def format_capture(summary: dict, cpu: bool = False) -> str:
    n_api, n_plane = summary.get("api_points", 0), summary.get("plane_points", 0)
    if not n_api and not n_plane:
        return "a2ad graphs: none built in this run"
    if cpu:
        what = "public API (MoeAlltoAll.dispatch/combine)" if not n_plane else "calls"
        return (f"a2ad graphs: none (a CPU run has no CUDA graphs); the {CPU_REPLAY} rows run the {what} "
                f"again on every replay, at {n_api + n_plane} point(s), to check the pipeline")
    if n_plane == 0:
        head = f"a2ad graphs: the public API (MoeAlltoAll.dispatch/combine) captured at all {n_api} point(s)"
    elif n_api == 0:
        head = f"a2ad graphs: MoeAlltoAll's CUDA-plane kernels (plane capture) at all {n_plane} point(s)"
    else:
        head = (f"a2ad graphs: the public API captured at {n_api} point(s), the CUDA-plane kernels at "
                f"{n_plane} point(s)")
    lines = [head + f" (--capture {summary.get('requested')})"]
    for f in summary.get("fallbacks") or []:
        lines.append(f"  capturing the API failed at T={f['tokens']} hidden={f['hidden']}, fell back to the plane: "
                     f"{f['exception']}")
    for w in summary.get("why") or []:
        lines.append(f"  - {w}")
    return "\n".join(lines)


def format_ceilings(ceilings: dict) -> str:
    lines = []
    ce = (ceilings or {}).get("ce_two_way")
    if ce:
        lines.append(
            f"copy engine, two-way GPU{ce['devices'][0]}<->GPU{ce['devices'][1]} ({ce['bytes'] / 2**30:.2f} GiB each way): "
            f"{ce['per_gpu_gbps']:.1f} GB/s per GPU each way, {ce['aggregate_gbps']:.1f} GB/s aggregate"
        )
    ce1 = (ceilings or {}).get("ce_one_way")
    if ce1:
        lines.append(f"copy engine, one-way GPU{ce1['devices'][0]}->GPU{ce1['devices'][1]}: {ce1['per_gpu_gbps']:.1f} GB/s")
    sm = (ceilings or {}).get("sm_store_two_way")
    if sm:
        lines.append(
            f"SM peer store, two-way into the a2ad workspace ({sm['bytes'] / 2**30:.2f} GiB per rank, {sm['how']}): "
            f"{sm['per_gpu_gbps']:.1f} GB/s per GPU, {sm['aggregate_gbps']:.1f} GB/s aggregate"
        )
    for k, v in sorted((ceilings or {}).items()):
        if k.endswith("_error"):
            lines.append(f"{k}: {v}")
    return "\n".join(lines) if lines else "(no ceilings measured)"


def format_targets(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        m = t["measured"]
        if m is None:
            ms = "-"
        elif "remote GB/s /" in t["name"]:
            ms = f"{m:.0%}"
        elif "speedup" in t["name"] or "FI/a2ad" in t["name"]:
            ms = f"{m:.2f}x"
        else:
            ms = f"{m:.2f}"
        detail = f"  ({t['detail']})" if t.get("detail") else ""
        lines.append(f"  [{t['status']:>4}] hidden={t['hidden']}: {t['name']}: {ms} (target {t['target']}){detail}")
    return "\n".join(lines) if lines else "  (not evaluated: no GPU rows of a2ad in this run)"


def _skip_what(s: dict) -> str:
    if s.get("tokens") is None and s.get("impl"):
        return f"{s['impl']} (every point)"
    return f"T={s.get('tokens')} hidden={s.get('hidden')}" + (f" {s['impl']}" if s.get("impl") else "")


def _graph_caveat(result: dict) -> str:
    """Said next to the graph-vs-graph table when a2ad's graphs did not capture its API everywhere."""
    cap = result.get("capture") or capture_summary(result["rows"], None)
    n = cap.get("plane_points", 0)
    if not n:
        return ""
    return (f" NOTE: at {n} point(s) a2ad's graphs hold its CUDA-plane kernels, not its public API "
            "(see how the a2ad graphs were built).")


def _fi_line(result: dict) -> str:
    fi = result.get("flashinfer") or {}
    archive = (result.get("config") or {}).get("flashinfer_archive")
    where = f"--flashinfer-archive {Path(archive).name}" if archive else "the installed package"
    if fi.get("available"):
        return f"{fi.get('version') or '?'} ({where})"
    return f"not run: {fi.get('reason', '?')}"


def _eager_how(result: dict) -> str:
    cfg = result.get("config") or {}
    return (f"{cfg.get('eager_pairs', '?')} dispatch+combine pairs back to back, one synchronize, per sample; "
            f"median of {cfg.get('eager_batches', '?')} samples")


# --- the text report, JSON and PERF.md ---------------------------------------------------
def make_report(result: dict) -> str:
    parts = [f"a2ad-bench: {result['config'].get('mode', '?')} run ({result.get('wall_s', '?')} s), "
             f"ep={result['config'].get('ep')}, "
             f"routing={result['config'].get('routing')}, top_k={result['config'].get('top_k')}, "
             f"experts={result['config'].get('num_experts')}"]
    hw = result.get("hardware") or {}
    if hw:
        parts.append(f"hardware: {hw.get('device_count')} x {hw.get('device_name')}, torch {hw.get('torch')}, "
                     f"CUDA {hw.get('cuda')}, NCCL {hw.get('nccl')}, driver {hw.get('driver')}")
    if result.get("flashinfer"):
        parts.append(f"flashinfer: {_fi_line(result)}")
    parts += ["", "ceilings:", format_ceilings(result.get("ceilings") or {}), "", format_table(result["rows"]),
              VS_NCCL_NOTE, ""]
    comp = result.get("comparisons") or comparisons(result["rows"])
    cpu = result["config"].get("mode") == "cpu"
    parts += [format_capture(result.get("capture") or capture_summary(result["rows"], None), cpu), ""]
    if cpu:
        parts += [f"{CPU_REPLAY} vs {CPU_REPLAY} (us, medians; a CPU run, no CUDA graphs: the figures check the "
                  "pipeline, they are not performance; FI/a2ad > 1: a2ad faster):", format_graph_comparison(comp), ""]
    else:
        parts += ["graph vs graph (us, medians; CUDA graphs of each public API; FI/a2ad > 1: a2ad faster):"
                  + _graph_caveat(result), format_graph_comparison(comp), ""]
    parts += [f"eager vs eager (us, medians of the pair; {_eager_how(result)}; x/a2ad > 1: a2ad faster; "
              "eager-graph = eager pair - graph pair):", format_eager_comparison(comp), ""]
    parts += ["targets (a2ad rows; the eager ones from the eager rows):", format_targets(result.get("targets") or [])]
    for s in result.get("skipped") or []:
        parts.append(f"skipped: {_skip_what(s)}: {s['reason']}")
    for n in result.get("notes") or []:
        parts.append(f"note: {n}")
    for e in result.get("errors") or []:
        parts.append(f"ERROR: {e}")
    return "\n".join(parts)


def write_json(result: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (Path, torch.dtype, torch.device)):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _finite(o):
    """Replace non-finite floats (JSON has none) with None, recursively."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def perf_doc(result: dict, plot_rel: str | None) -> str:
    hw = result.get("hardware") or {}
    cfg = result["config"]
    comp = result.get("comparisons") or comparisons(result["rows"])
    lines = [
        "# a2ad performance",
        "",
        "Written by `a2ad-bench --write-perf-doc` (a2ad/bench/); benchmarks/README.md says how each",
        "figure is measured. Every number below comes from the one run described here.",
        "",
        f"- date: {result.get('finished', '?')}",
        f"- hardware: {hw.get('device_count', '?')} x {hw.get('device_name', '?')}"
        f" (driver {hw.get('driver', '?')}, CUDA {hw.get('cuda', '?')}, torch {hw.get('torch', '?')},"
        f" NCCL {hw.get('nccl', '?')})",
        f"- mode: {cfg.get('mode')}; ep={cfg.get('ep')}, top_k={cfg.get('top_k')}, {cfg.get('num_experts')} experts,"
        f" {cfg.get('routing')} routing; payloads bf16 hidden + int32 expert ids + fp32 scales",
        f"- graph replays per figure: {cfg.get('replays')} (after {cfg.get('warmup')} warm-up), "
        f"{cfg.get('input_sets')} rotating input sets, L2 flushed between replays: {cfg.get('l2_flush')}",
        f"- eager figures: {_eager_how(result)}",
        f"- FlashInfer: {_fi_line(result)}",
        "",
        "Command:",
        "",
        "```sh",
        result.get("command", "?"),
        "```",
        "",
        "## Targets",
        "",
        "```",
        format_targets(result.get("targets") or []),
        "```",
        "",
        "## NVLink ceilings (same run)",
        "",
        "```",
        format_ceilings(result.get("ceilings") or {}),
        "```",
        "",
        "## How the a2ad graphs were built",
        "",
        "```",
        format_capture(result.get("capture") or capture_summary(result["rows"], cfg.get("capture")),
                       cfg.get("mode") == "cpu"),
        "```",
        "",
        "## Graph vs graph",
        "",
        "a2ad and FlashInfer, each from CUDA graphs of its public `dispatch`/`combine` (same inputs,",
        "same checks); medians in us; FI/a2ad above 1 means a2ad is faster." + _graph_caveat(result),
        "",
        format_graph_comparison(comp, md=True),
        "",
        "## Eager vs eager",
        "",
        f"Every implementation called eagerly ({_eager_how(result)}); pair medians in us;",
        "`x/a2ad` is that implementation's pair over a2ad-eager's (above 1: a2ad is faster).",
        "`eager-graph` is the eager pair minus the graph pair of the same implementation: what calling the",
        "API eagerly costs over replaying it from a graph. NCCL's Megatron path cannot be captured (its",
        "splits need a host sync), so it appears here only.",
        "",
        format_eager_comparison(comp, md=True),
        "",
        "## All results",
        "",
        "Latency is the median over replays (graph rows) or samples (eager rows) of the slowest rank's",
        "time (us); p10-p90 of the total. `remote GB/s` counts per GPU only the bytes that crossed to",
        "another GPU; `logical GB/s` is TensorRT-LLM's convention (tokens x min(ep, top_k) x bytes per",
        "token / time).",
        "",
        format_markdown_table(result["rows"]),
        "",
        VS_NCCL_NOTE,
        "",
    ]
    if plot_rel:
        lines += [f"![latency and bandwidth vs tokens]({plot_rel})", ""]
    extra = [f"- skipped: {_skip_what(s)}: {s['reason']}" for s in result.get("skipped") or []]
    extra += [f"- note: {n}" for n in result.get("notes") or []]
    extra += [f"- ERROR: {e}" for e in result.get("errors") or []]
    if extra:
        lines += ["## Notes", ""] + extra + [""]
    hwx = hw.get("topology")
    if hwx:
        lines += ["## GPU topology (nvidia-smi topo -m)", "", "```", hwx.rstrip(), "```", ""]
    return "\n".join(lines)
