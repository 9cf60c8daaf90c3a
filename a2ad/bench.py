"""a2ad-bench: dispatch/combine latency and bandwidth of a2ad against FlashInfer and NCCL baselines.

One process per rank, one rank per GPU (``torch.multiprocessing`` spawn). The
launcher starts an a2ad daemon (``a2ad serve --backend cuda``, through a2ad.tools.launcher) on a
private runtime folder unless ``--runtime-dir`` names a running one, then every
rank attaches through ``MoeAlltoAll(job=...)`` and, in the same run, on the same
GPUs, runs:

- ``a2ad``: the public ``MoeAlltoAll.dispatch``/``combine`` captured in CUDA graphs
  (dispatch, combine, and dispatch + no-op expert + combine, each in its own graph);
  when capturing the API raises, the graphs fall back to MoeAlltoAll's CUDA-plane
  kernels (``--capture plane`` forces that) and the report says so and why;
- ``a2ad-eager``: the public API called eagerly, many pairs back to back, one synchronize;
- ``flashinfer`` / ``flashinfer-eager``: FlashInfer's ``MoeAlltoAll``
  (``flashinfer.comm.trtllm_moe_alltoall``) timed and checked exactly like a2ad, when it
  imports (``pip install flashinfer-python``, or ``--flashinfer-archive``); skipped with the
  reason otherwise;
- ``nccl``: the Megatron-style all-to-all through ``torch.distributed``
  (count exchange, permutation, ``all_to_all_single`` with splits, inverse
  permutation + sum), eager only: its splits need a host sync, so it cannot be captured;
- ``agrs``: all-gather dispatch + reduce-scatter combine through NCCL, eager;
- the NVLink ceilings: a two-way copy-engine copy GPU0<->GPU1 and an SM-driven
  two-way peer store into the a2ad-mapped workspace.

Every implementation is checked (dispatch: the received rows per source as a set;
combine: against a float64 reference and against a2ad's output). Results: a
table on stdout (plus graph-vs-graph and eager-vs-eager comparisons), ``--json``,
``--plot``, ``--write-perf-doc``. ``--dry-run`` runs the whole pipeline on CPU (gloo
stands in for NCCL, the host backend for CUDA). benchmarks/README.md says what every
figure means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

SCHEMA = "a2ad-bench/1"
IMPLS = ("a2ad", "a2ad-eager", "flashinfer", "flashinfer-eager", "nccl", "agrs")
IMPL_LABELS = {
    "a2ad": "a2ad (CUDA graph)",
    "a2ad-eager": "a2ad (eager API)",
    "flashinfer": "FlashInfer MoeAlltoAll (CUDA graph)",
    "flashinfer-eager": "FlashInfer MoeAlltoAll (eager API)",
    "nccl": "NCCL all_to_all (Megatron, eager)",
    "agrs": "NCCL all-gather + reduce-scatter (eager)",
}
#: How each implementation is timed: replays of CUDA graphs, or eager calls.
IMPL_MODE = {"a2ad": "graph", "a2ad-eager": "eager", "flashinfer": "graph", "flashinfer-eager": "eager",
             "nccl": "eager", "agrs": "eager"}
#: A remark printed next to an implementation's rows.
IMPL_NOTES = {
    "nccl": "eager only: cannot be captured (its splits need a host sync)",
    "agrs": "eager",
}
#: The graph row an eager row is compared with (eager overhead = eager pair - graph pair).
EAGER_OF = {"a2ad-eager": "a2ad", "flashinfer-eager": "flashinfer"}
#: The module FlashInfer's MoeAlltoAll lives in.
FLASHINFER_MODULE = "flashinfer.comm.trtllm_moe_alltoall"
FULL_TOKENS = (1, 8, 32, 128, 512, 1024, 4096)
QUICK_TOKENS = (1, 128, 4096)
DEFAULT_HIDDEN = (7168, 4096, 2880)
DRY_TOKENS = (1, 8, 64)
DRY_HIDDEN = (256,)
#: Never use NVLink multicast / NVLS on the lent machines.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: The targets.
TARGET_DISPATCH_CE_FRACTION = 0.85
TARGET_COMBINE_CE_FRACTION = 0.80
TARGET_T1_DISPATCH_US = 10.0
TARGET_T1_COMBINE_US = 12.0
TARGET_SPEEDUP_SMALL = 2.0  # T <= 1024
TARGET_SPEEDUP_4096 = 1.4
TARGET_EAGER_OVERHEAD_T1_US = 30.0  # a2ad eager pair - a2ad graph pair at T=1
#: Relative error (||out - ref|| / ||ref||) a bf16 combine output may have against float64.
COMBINE_TOLERANCE = 1e-2


def log(msg: str) -> None:
    print(f"[a2ad-bench] {msg}", file=sys.stderr, flush=True)


def ensure_client_package() -> str | None:
    """Make ``a2ad.client`` importable in a checkout that was not pip-installed (the mapping of
    ``client/`` to ``a2ad.client`` lives in pyproject.toml); returns what is missing, or None."""
    missing = [m for m in ("zmq", "msgpack") if __import__("importlib").util.find_spec(m) is None]
    if missing:
        names = {"zmq": "pyzmq", "msgpack": "msgpack"}
        return (f"the a2ad client needs {' and '.join(names[m] for m in missing)}: install "
                f"{' '.join(names[m] for m in missing)} (on a machine without a registry, carry the wheels)")
    try:
        import a2ad.client  # noqa: F401

        return None
    except ModuleNotFoundError as exc:
        if exc.name not in ("a2ad.client",):
            return f"cannot import a2ad.client: {exc}"
    import importlib.util

    import a2ad

    root = Path(a2ad.__file__).resolve().parent.parent / "client"
    if not (root / "__init__.py").is_file():
        return "a2ad.client is not importable: run `pip install -e .` in the repository (scripts/setup.sh)"
    spec = importlib.util.spec_from_file_location("a2ad.client", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["a2ad.client"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["a2ad.client"]
        raise
    a2ad.client = mod
    return None


# =====================================================================================
# Accounting (pure; unit-tested on CPU)
# =====================================================================================
def dispatch_bytes_per_token(hidden: int, top_k: int) -> int:
    """bf16 hidden + int32 expert ids + float32 scales."""
    return 2 * hidden + 4 * top_k + 4 * top_k


def combine_bytes_per_token(hidden: int) -> int:
    """bf16 expert output."""
    return 2 * hidden


def expert_owner_tensor(experts: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    """Owner rank of every expert id (contiguous partition, as ``a2ad.layout.expert_owner``), int64."""
    base, rem = divmod(num_experts, ep)
    if base < 1:
        raise ValueError(f"num_experts ({num_experts}) must be >= ep ({ep})")
    split = rem * (base + 1)
    e = experts.long()
    return torch.where(e < split, e // (base + 1), rem + (e - split).clamp(min=0) // base)


def target_mask(experts: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    """``[T, ep]`` bool: token t is sent to rank r (at most once, however many of its experts r owns)."""
    owner = expert_owner_tensor(experts, num_experts, ep)
    mask = torch.zeros(experts.shape[0], ep, dtype=torch.bool, device=experts.device)
    if experts.shape[0]:
        mask.scatter_(1, owner, True)
    return mask


def remote_pairs(mask: torch.Tensor, rank: int) -> int:
    """(token, distinct target rank != rank) pairs: the token copies that cross to another GPU."""
    return int(mask.sum().item()) - int(mask[:, rank].sum().item())


def remote_bytes(mask: torch.Tensor, rank: int, bytes_per_token: int) -> int:
    return remote_pairs(mask, rank) * bytes_per_token


def logical_bytes(tokens: int, ep: int, top_k: int, bytes_per_token: int) -> int:
    """TensorRT-LLM's convention: tokens x min(ep, top_k) x bytes per token."""
    return tokens * min(ep, top_k) * bytes_per_token


def gbps(nbytes: float, us: float | None) -> float | None:
    """Bytes over microseconds, in GB/s (1e9 bytes per second)."""
    if us is None or not us > 0 or nbytes is None:
        return None
    return nbytes / us / 1e3


# =====================================================================================
# Routing and inputs
# =====================================================================================
def _seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (FNV-1a over 64-bit words)."""
    h = 0xCBF29CE484222325
    for p in parts:
        h ^= int(p) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def expert_weights(num_experts: int, routing: str, zipf_s: float, seed: int) -> torch.Tensor | None:
    """Expert popularity: None for uniform; for ``skewed`` Zipf weights ``1/(i+1)^s`` over a
    fixed random permutation of the experts (hot experts spread over the ranks)."""
    if routing == "uniform":
        return None
    if routing != "skewed":
        raise ValueError(f"routing must be uniform or skewed, got {routing!r}")
    g = torch.Generator().manual_seed(_seed(seed, 77))
    order = torch.randperm(num_experts, generator=g)
    w = torch.empty(num_experts, dtype=torch.float64)
    w[order] = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf_s
    return w / w.sum()


def make_routing(tokens: int, top_k: int, num_experts: int, generator: torch.Generator,
                 weights: torch.Tensor | None = None, device="cpu") -> torch.Tensor:
    """``[tokens, top_k]`` int32 of distinct expert ids per token.

    Gumbel-top-k: ``top_k`` draws without replacement with probabilities ``weights``
    (uniform when None). Deterministic for a given generator state and device type.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    u = torch.rand(tokens, num_experts, generator=generator, device=device, dtype=torch.float32)
    keys = -torch.log(-torch.log(u.clamp_(min=1e-30)))
    if weights is not None:
        keys += torch.log(weights.to(device=device, dtype=torch.float32)).unsqueeze(0)
    return keys.topk(top_k, dim=1).indices.to(torch.int32)


class Inputs:
    """One rank's payloads for one round: routing, bf16 hidden states, float32 scales."""

    __slots__ = ("experts", "hidden", "scales")

    def __init__(self, experts: torch.Tensor, hidden: torch.Tensor, scales: torch.Tensor):
        self.experts, self.hidden, self.scales = experts, hidden, scales

    def payloads(self) -> list[torch.Tensor]:
        return [self.hidden, self.experts, self.scales]

    def clone(self) -> "Inputs":
        return Inputs(self.experts.clone(), self.hidden.clone(), self.scales.clone())

    def copy_from(self, other: "Inputs") -> None:
        self.experts.copy_(other.experts)
        self.hidden.copy_(other.hidden)
        self.scales.copy_(other.scales)


def make_routing_for(seed: int, rank: int, tokens: int, set_idx: int, top_k: int, num_experts: int,
                     weights: torch.Tensor | None, device) -> torch.Tensor:
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(_seed(seed, 1, rank, tokens, set_idx))
    return make_routing(tokens, top_k, num_experts, g, weights, dev)


def make_inputs(seed: int, rank: int, tokens: int, hidden: int, set_idx: int, top_k: int, num_experts: int,
                weights: torch.Tensor | None, device) -> Inputs:
    """Input set ``set_idx`` of ``rank`` for one grid point; any rank can regenerate any other's."""
    dev = torch.device(device)
    experts = make_routing_for(seed, rank, tokens, set_idx, top_k, num_experts, weights, dev)
    g = torch.Generator(device=dev).manual_seed(_seed(seed, 2, rank, tokens, hidden, set_idx))
    h = torch.randn(tokens, hidden, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    scales = torch.rand(tokens, top_k, generator=g, device=dev, dtype=torch.float32) + 0.5
    return Inputs(experts, h, scales)


# =====================================================================================
# Megatron-style permutation (pure torch; unit-tested on CPU)
# =====================================================================================
def permute_indices(mask: torch.Tensor, n_send: int | None = None) -> torch.Tensor:
    """Token index of every (target rank, token) send, sorted by target rank then token.

    ``mask`` is ``[T, ep]`` (:func:`target_mask`). ``n_send`` (= ``mask.sum()``) may be
    given when the host already knows it, so that no host sync happens here.
    """
    T, ep = mask.shape
    flat = mask.t().reshape(-1)
    if n_send is None:
        n_send = int(flat.sum().item())
    pos = torch.cumsum(flat.to(torch.int64), 0) - 1
    dump = ep * T  # every unselected entry lands in one spare slot
    dest = torch.where(flat, pos, torch.full_like(pos, dump))
    buf = torch.empty(dump + 1, dtype=torch.int64, device=mask.device)
    src = torch.arange(dump, dtype=torch.int64, device=mask.device) % max(T, 1)
    buf.scatter_(0, dest, src)
    return buf[:n_send]


def unpermute_sum(back: torch.Tensor, token_idx: torch.Tensor, tokens: int, out_dtype=None) -> torch.Tensor:
    """Inverse permutation + sum: ``out[t] = sum of back[i] over i with token_idx[i] == t``, float32 accumulation."""
    out = torch.zeros(tokens, back.shape[1], dtype=torch.float32, device=back.device)
    out.index_add_(0, token_idx, back.float())
    return out.to(out_dtype or back.dtype)


def pack_rows(inp: Inputs) -> torch.Tensor:
    """``[T, bytes_per_token]`` uint8: hidden | expert ids | scales, one row per token."""
    return torch.cat([inp.hidden.view(torch.uint8), inp.experts.view(torch.uint8), inp.scales.view(torch.uint8)], 1)


def unpack_rows(rows: torch.Tensor, hidden: int, top_k: int) -> Inputs:
    """Views of packed rows (:func:`pack_rows`) as (experts, hidden, scales)."""
    h = rows[:, : 2 * hidden].view(torch.bfloat16)
    e = rows[:, 2 * hidden : 2 * hidden + 4 * top_k].view(torch.int32)
    s = rows[:, 2 * hidden + 4 * top_k :].view(torch.float32)
    return Inputs(e, h, s)


def reference_combine(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 combine output for the identity expert: hidden x (number of distinct target ranks)."""
    return hidden.double() * mask.sum(1, keepdim=True).double()


# =====================================================================================
# Checks
# =====================================================================================
def _row_keys(hidden_rows: torch.Tensor) -> torch.Tensor:
    """Exact int64 fingerprint of bf16 rows (first 64 columns), for ordering rows as sets."""
    cols = hidden_rows[:, :64].contiguous().view(torch.int16).to(torch.int64)
    w = (torch.arange(1, cols.shape[1] + 1, dtype=torch.int64, device=cols.device) * 2654435761) % (1 << 31)
    return (cols * w).sum(1)


def same_rows_as_sets(expected: Inputs, got: Inputs) -> tuple[bool, str]:
    """True when ``got`` holds exactly ``expected``'s rows (all three payloads), in any order."""
    n, m = expected.hidden.shape[0], got.hidden.shape[0]
    if n != m:
        return False, f"{m} rows, expected {n}"
    if n == 0:
        return True, ""
    oe = torch.sort(_row_keys(expected.hidden), stable=True).indices
    og = torch.sort(_row_keys(got.hidden), stable=True).indices
    for name in ("hidden", "experts", "scales"):
        a = getattr(expected, name).index_select(0, oe)
        b = getattr(got, name).index_select(0, og)
        if not torch.equal(a, b.to(a.device)):
            bad = int((a != b.to(a.device)).reshape(n, -1).any(1).sum().item())
            return False, f"{name}: {bad} of {n} rows differ"
    return True, ""


def check_received(per_source: list[Inputs], sources: list[Inputs], me: int, num_experts: int, ep: int,
                   full: bool = False) -> tuple[bool, str]:
    """Received rows per source against what each source routed here (all its rows when ``full``)."""
    for s, (got, src) in enumerate(zip(per_source, sources)):
        if full:
            exp = src
        else:
            sel = target_mask(src.experts, num_experts, ep)[:, me]
            exp = Inputs(src.experts[sel], src.hidden[sel], src.scales[sel])
        ok, why = same_rows_as_sets(exp, got)
        if not ok:
            return False, f"from rank {s}: {why}"
    return True, ""


def check_combine(out: torch.Tensor, own: Inputs, num_experts: int, ep: int,
                  other: torch.Tensor | None = None) -> dict:
    """Combine output vs the float64 reference (and vs another implementation's output)."""
    mask = target_mask(own.experts, num_experts, ep)
    ref = reference_combine(own.hidden, mask)
    res: dict = {"shape_ok": list(out.shape) == list(ref.shape)}
    if not res["shape_ok"]:
        res.update(ok=False, why=f"shape {list(out.shape)}, expected {list(ref.shape)}")
        return res
    o = out.double()
    finite = bool(torch.isfinite(o).all().item())
    denom = float(ref.norm().item()) or 1.0
    rel = float((o - ref).norm().item()) / denom if finite else float("inf")
    exact_ref = (own.hidden.float() * mask.sum(1, keepdim=True).float()).to(out.dtype)
    res.update(rel_err=rel, exact=bool(torch.equal(out, exact_ref)), finite=finite)
    if other is not None:
        res["max_abs_diff_vs_a2ad"] = float((o - other.double()).abs().max().item()) if out.numel() else 0.0
    res["ok"] = finite and rel <= COMBINE_TOLERANCE
    if not res["ok"]:
        res["why"] = f"relative error {rel:.3g} > {COMBINE_TOLERANCE}" if finite else "non-finite values"
    return res


# =====================================================================================
# Statistics
# =====================================================================================
def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]) of a non-empty sequence."""
    v = sorted(float(x) for x in values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(values) -> dict | None:
    v = [float(x) for x in values]
    if not v:
        return None
    return {
        "median": percentile(v, 50),
        "p10": percentile(v, 10),
        "p90": percentile(v, 90),
        "min": min(v),
        "max": max(v),
        "n": len(v),
    }


def step_latencies(per_rank: list[list[float]]) -> list[float]:
    """Per replay, the slowest rank's time: ranks run in lockstep, so a step lasts that long."""
    n = min(len(x) for x in per_rank)
    return [max(r[i] for r in per_rank) for i in range(n)]


# =====================================================================================
# Rows, speedups, targets, table, JSON, plot, perf doc
# =====================================================================================
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


def ce_per_gpu_gbps(ceilings: dict) -> float | None:
    ce = (ceilings or {}).get("ce_two_way")
    return ce.get("per_gpu_gbps") if ce else None


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


def table_cells(r: dict) -> list[str]:
    med = lambda k: r[k]["median"] if r.get(k) else None  # noqa: E731
    t = r.get("total_us")
    chk = r.get("check") or {}
    check = "ok" if chk.get("ok") else ("FAIL" if chk.get("ok") is False else "-")
    note = IMPL_NOTES.get(r["impl"], "")
    if r["impl"] == "a2ad" and r.get("capture"):
        note = f"{r['capture']} capture" + (" (fallback)" if r.get("capture_fallback") or
                                            "failed" in (r.get("capture_why") or "") else "")
    return [
        r["impl"],
        r.get("mode") or IMPL_MODE.get(r["impl"], "-"),
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


def format_capture(summary: dict) -> str:
    n_api, n_plane = summary.get("api_points", 0), summary.get("plane_points", 0)
    if not n_api and not n_plane:
        return "a2ad graphs: none built in this run"
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
    parts += [format_capture(result.get("capture") or capture_summary(result["rows"], None)), ""]
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


def perf_doc(result: dict, plot_rel: str | None) -> str:
    hw = result.get("hardware") or {}
    cfg = result["config"]
    comp = result.get("comparisons") or comparisons(result["rows"])
    lines = [
        "# a2ad performance",
        "",
        "Written by `a2ad-bench --write-perf-doc` (a2ad/bench.py); benchmarks/README.md says how each",
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
        format_capture(result.get("capture") or capture_summary(result["rows"], cfg.get("capture"))),
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


# =====================================================================================
# Per-rank worker
# =====================================================================================
class Skip(Exception):
    """An implementation that cannot run in this configuration (not an error)."""


class Clock:
    """CUDA events on a GPU (recorded on the current stream), perf_counter on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    def pool(self, n: int) -> list:
        """``n`` timing events made ahead (so that making them is not timed); None on CPU."""
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self.cuda else [None] * n

    def at(self, event):
        """Record a pooled event now (the time now on CPU)."""
        if self.cuda:
            event.record()
            return event
        return time.perf_counter()


class Ctx:
    """One rank's context: config, device, process groups, clock, L2 flush buffer."""

    def __init__(self, cfg: dict, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.ep = cfg["ep"]
        self.cuda = cfg["device"] == "cuda"
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.clock = Clock(self.cuda)
        self.gloo = None
        self.flush_buf: torch.Tensor | None = None
        self.cycles_per_us = 1000.0
        self.enqueue_us = 60.0  # CPU time to enqueue one graph-mode iteration (measured as we go)
        self.sleep_base_us = 500.0
        #: set once capturing MoeAlltoAll's API failed: later points capture through the plane
        self.capture_fallback: str | None = None
        self.notes: list[str] = []

    # --- collectives on the gloo group (CPU; never NCCL) ---------------------------
    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.gloo)

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.ep
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def bcast(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.gloo)
        return box[0]

    # --- device helpers -----------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def flush_l2(self) -> None:
        if self.flush_buf is not None:
            self.flush_buf.zero_()

    def gpu_sleep(self, us: float) -> None:
        torch.cuda._sleep(max(1, int(us * self.cycles_per_us)))

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)


def _init_dist(ctx: Ctx) -> None:
    import torch.distributed as dist

    cfg = ctx.cfg
    timeout = datetime.timedelta(seconds=cfg["pg_timeout"])
    init = f"file://{cfg['run_dir']}/pg-store"
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
        kw = dict(backend="nccl", init_method=init, rank=ctx.rank, world_size=ctx.ep, timeout=timeout)
        try:
            dist.init_process_group(**kw, device_id=ctx.device)
        except TypeError:  # torch without device_id
            dist.init_process_group(**kw)
        ctx.gloo = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=init, rank=ctx.rank, world_size=ctx.ep, timeout=timeout)
        ctx.gloo = dist.group.WORLD


def _setup_device(ctx: Ctx) -> None:
    if not ctx.cuda:
        return
    props = torch.cuda.get_device_properties(ctx.device)
    if ctx.cfg["l2_flush"]:
        l2 = int(getattr(props, "L2_cache_size", 0) or (50 << 20))
        ctx.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=ctx.device)
    # cycles of torch.cuda._sleep per microsecond (to queue work behind a known delay)
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(2_000_000)
    b.record()
    b.synchronize()
    us = a.elapsed_time(b) * 1e3
    ctx.cycles_per_us = 2_000_000 / us if us > 0 else 1500.0


def run_timed(ctx: Ctx, prepare, step, *, graph: bool) -> tuple[list[list[float]], list[str]]:
    """Replay ``step`` ``replays`` times (after ``warmup`` per chunk); per replay, the intervals
    between the marks ``step`` returns, in us, on this rank.

    Chunks of at most ``chunk`` replays; every chunk starts with a barrier (ranks in
    lockstep). ``prepare(i)`` (copy input set i into the static inputs, flush L2) runs
    outside the timed interval. ``graph``: the whole chunk is queued behind a GPU sleep
    so that the replays run back to back without waiting for the CPU (if the sleep ends
    before the CPU finished queueing, every rank redoes the chunk with a longer sleep).
    Otherwise (eager) the device is synchronized before every replay, so each one is
    timed from an idle GPU, launch overhead and host syncs included.
    """
    cfg = ctx.cfg
    total, warm, chunk = cfg["replays"], cfg["warmup"], cfg["chunk"]
    samples: list[list[float]] = []
    notes: list[str] = []
    it = 0
    while len(samples) < total:
        n = min(chunk, total - len(samples))
        for attempt in range(3):
            ctx.barrier()
            marks = []
            sleep_done = None
            if graph and ctx.cuda:
                ctx.gpu_sleep(ctx.sleep_base_us + 2.0 * ctx.enqueue_us * (warm + n))
                sleep_done = torch.cuda.Event()
                sleep_done.record()
            t0 = time.perf_counter()
            for j in range(warm + n):
                prepare(it + j)
                if not graph:
                    ctx.sync()
                m = step()
                if j >= warm:
                    marks.append(m)
            enq_us = (time.perf_counter() - t0) * 1e6 / (warm + n)
            starved = bool(sleep_done is not None and sleep_done.query())
            ctx.sync()
            if graph:
                ctx.enqueue_us = max(enq_us, 5.0)
            if not any(ctx.gather(starved)):
                break
            if attempt == 2:
                notes.append("the GPU may have waited for the CPU inside timed replays (queueing outran the sleep)")
                break
            ctx.sleep_base_us *= 4
        it += warm + n
        samples.extend([[ctx.clock.us(m[i], m[i + 1]) for i in range(len(m) - 1)] for m in marks])
    return samples, notes


def _received_a2ad(recv: list[torch.Tensor], sources: list[Inputs], me: int, num_experts: int, ep: int) -> list[Inputs]:
    """The first n_s slots of every source s in ``[ep, rt, ...]`` dispatch outputs (a2ad's and
    FlashInfer's layout alike: source s's tokens for this rank fill slots 0..n_s-1, in any order)."""
    out = []
    for s, src in enumerate(sources):
        n = int(target_mask(src.experts, num_experts, ep)[:, me].sum().item())
        out.append(Inputs(recv[1][s, :n], recv[0][s, :n], recv[2][s, :n]))
    return out


def _poison_recv(recv: list[torch.Tensor]) -> None:
    for t in recv:
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(-1234567)


class A2adJob:
    """One MoeAlltoAll (one daemon job) per hidden size, reopened under a new name after a failure."""

    def __init__(self, ctx: Ctx, hidden: int, gen: int):
        self.hidden = hidden
        self.name = f"{ctx.cfg['run_id']}-h{hidden}-{gen}"
        self.reopened = 0
        self.a2a = self._open(ctx, self.name)

    def _open(self, ctx: Ctx, name: str):
        from types import SimpleNamespace

        from a2ad.client import MoeAlltoAll

        cfg = ctx.cfg
        return MoeAlltoAll(
            SimpleNamespace(moe_ep_rank=ctx.rank, moe_ep_size=ctx.ep),
            max(cfg["tokens"]),
            cfg["top_k"],
            cfg["num_experts"],
            hidden_size=self.hidden,
            job=name,
            runtime_dir=cfg["runtime_dir"],
            device=ctx.device if ctx.cuda else None,
            timeout=cfg["a2ad_timeout"],
        )

    def reopen(self, ctx: Ctx) -> None:
        """Every rank leaves the job and joins a fresh one (after a failed capture the ranks'
        rounds may disagree); collective."""
        self.close()
        self.reopened += 1
        self.a2a = self._open(ctx, f"{self.name}-r{self.reopened}")

    def close(self) -> None:
        try:
            self.a2a.close()
        except Exception:
            pass


def exception_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception, and of the one it was raised while handling
    (``torch.cuda.graph`` ends a failed capture in ``__exit__``, which may raise again)."""
    def one(e):
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:limit] if text else ''}".rstrip(": ")
    out = one(exc)
    ctx_exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if ctx_exc is not None:
        out += f" (while handling {one(ctx_exc)})"
    return out


def _api_calls(a2a, static: Inputs, T: int):
    """``(dispatch, combine)`` closures calling the public API exactly as a user does."""
    payloads = static.payloads()

    def d():
        return a2a.dispatch(static.experts, payloads, T)

    def c(recv):
        return a2a.combine(recv[0], T)

    return d, c


def _capture_three(ctx: Ctx, d, c):
    """Dispatch, combine and dispatch + no-op expert + combine, each captured in its own graph."""
    ctx.barrier()
    g_d, recv_d = _capture(ctx, d)
    g_c, out_c = _capture(ctx, lambda: c(recv_d))
    g_p, (recv_p, out_p) = _capture(ctx, lambda: _pair(d, c))
    ctx.sync()
    return {"d": g_d, "c": g_c, "p": g_p, "recv_d": recv_d, "out_c": out_c, "recv_p": recv_p, "out_p": out_p}


def a2ad_graphs(ctx: Ctx, job: A2adJob, static: Inputs, T: int) -> tuple[str, str, str | None, dict]:
    """Build a2ad's three graphs for one point: ``(mode, why, fallback, graphs)``.

    ``--capture api`` (the default) captures ``MoeAlltoAll.dispatch``/``combine`` themselves.
    When that raises on any rank, every rank reopens its job (the failed capture may have left
    the ranks' rounds apart), captures MoeAlltoAll's CUDA-plane kernels instead (``plane``), and
    ``fallback`` holds the exceptions; later points of the run go to the plane directly.
    ``--capture plane`` goes to the plane from the start."""
    requested = ctx.cfg["capture"]
    fallback = None
    if requested == "plane":
        mode, why = "plane", "--capture plane: MoeAlltoAll's CUDA-plane kernels, launched with the arguments it passes"
    elif ctx.capture_fallback:
        mode, why = "plane", f"capturing MoeAlltoAll's API failed earlier in this run ({ctx.capture_fallback})"
    else:
        mode, why = "api", "the public MoeAlltoAll.dispatch/combine captured as a user calls them"
    if mode == "api":
        err, graphs, stage = None, None, "the eager round before capture"
        stream = torch.cuda.current_stream(ctx.device) if ctx.cuda else None
        try:
            d, c = _api_calls(job.a2a, static, T)
            ctx.barrier()
            c(d())  # one eager round first, as a user would before capturing
            ctx.sync()
            stage = "capture"
            graphs = _capture_three(ctx, d, c)
        except Exception as exc:
            err = f"{stage}: {exception_text(exc)}"
            log(f"rank {ctx.rank}: T={T} hidden={job.hidden}: capturing MoeAlltoAll's API failed: {err}")
            if ctx.cuda:
                # torch.cuda.graph leaves its capture stream current when ending a failed capture raises
                torch.cuda.set_stream(stream)
                try:
                    torch.cuda.synchronize(ctx.device)
                except Exception:
                    pass
        votes = ctx.gather(err)
        failed = [f"rank {r}: {e}" for r, e in enumerate(votes) if e]
        if not failed:
            return mode, why, None, graphs
        graphs = None
        fallback = "; ".join(failed)
        ctx.capture_fallback = f"at T={T} hidden={job.hidden}: {fallback}"
        job.reopen(ctx)
        mode, why = "plane", f"capturing MoeAlltoAll's API raised ({fallback}); fell back to its CUDA-plane kernels"
    d, c = _plane_calls(ctx, job.a2a, static, T)
    return mode, why, fallback, _capture_three(ctx, d, c)


class _PlaneRecorder:
    """Stands in for MoeAlltoAll's plane for one round: forwards every call, keeps the last
    arguments of ``dispatch`` and ``combine``."""

    def __init__(self, plane):
        self._plane = plane
        self.calls: dict = {}

    def __getattr__(self, name):
        return getattr(self._plane, name)

    def dispatch(self, *a, **kw):
        self.calls["dispatch"] = (a, kw)
        return self._plane.dispatch(*a, **kw)

    def combine(self, *a, **kw):
        self.calls["combine"] = (a, kw)
        return self._plane.combine(*a, **kw)


def _plane_calls(ctx: Ctx, a2a, static: Inputs, T: int):
    """``(dispatch, combine)`` closures launching MoeAlltoAll's CUDA-plane kernels with exactly
    the arguments MoeAlltoAll passed in one eager round (run here), for graph capture when
    the API itself synchronizes the host. The recorded tensors must alias the static inputs
    and the received views, so that replays read what ``prepare`` copied in."""
    real = getattr(a2a, "_plane", None)
    if real is None or not hasattr(real, "dispatch"):
        raise RuntimeError("MoeAlltoAll has no plane (_plane) to capture through; try --capture api")
    rec = _PlaneRecorder(real)
    ctx.barrier()
    a2a._plane = rec
    try:
        recv0 = a2a.dispatch(static.experts, static.payloads(), T)
        a2a.combine(recv0[0], T)
    finally:
        a2a._plane = real
    ctx.sync()
    if "dispatch" not in rec.calls or "combine" not in rec.calls:
        raise RuntimeError("MoeAlltoAll did not call its plane's dispatch and combine; cannot capture through it")
    (da, dk), (ca, ck) = rec.calls["dispatch"], rec.calls["combine"]
    tensors = [x for x in list(da) + list(dk.values()) if isinstance(x, torch.Tensor)]
    lists = [x for x in list(da) + list(dk.values()) if isinstance(x, (list, tuple))]
    got = {t.data_ptr() for t in tensors} | {t.data_ptr() for lst in lists for t in lst if isinstance(t, torch.Tensor)}
    need = {static.experts.data_ptr(), static.hidden.data_ptr(), static.scales.data_ptr()}
    payload = next((x for x in list(ca) + list(ck.values()) if isinstance(x, torch.Tensor)), None)
    if not need <= got or payload is None or payload.data_ptr() != recv0[0].data_ptr():
        raise RuntimeError("MoeAlltoAll passed copies of the inputs to its plane; replays would not see new "
                           "inputs, so the graphs cannot be built through the plane")

    def d():
        real.dispatch(*da, **dk)
        return recv0

    def c(recv):
        return real.combine(*ca, **ck)

    return d, c


class _CpuGraph:
    """CPU stand-in for a CUDA graph (CPU runs only, to exercise this code path): capture runs
    the function once, replay runs it again and copies its results into the captured tensors."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        _copy_into(self.out, self.fn())


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


def _capture(ctx: Ctx, fn):
    """``(graph, outputs)``: ``fn`` captured in a CUDA graph (a _CpuGraph on CPU)."""
    if not ctx.cuda:
        g = _CpuGraph()
        return g, g.capture(fn)
    g = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread queries CUDA events; under the default "global"
    # mode such a call from another thread during capture would invalidate the capture.
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = fn()
    return g, out


def _pair(d, c):
    recv = d()
    return recv, c(recv)


def time_graphs(ctx: Ctx, pt: dict, graphs: dict, after=None) -> dict:
    """Time and check the three graphs of :func:`_capture_three` (a2ad's and FlashInfer's alike).

    Dispatch and combine are timed in one loop (their alternation is one round each replay),
    the pair in a loop of its own. ``after()`` runs once the timing is over (a2ad: raise what a
    wait that gave up inside a replay left). The checks replay on fresh inputs (the check set is
    never timed) into poisoned outputs."""
    cfg = ctx.cfg
    E, ep, me = cfg["num_experts"], ctx.ep, ctx.rank
    static: Inputs = pt["static"]
    g_d, g_c, g_p = graphs["d"], graphs["c"], graphs["p"]
    mark = ctx.clock.mark

    def step_split():
        m0 = mark()
        g_d.replay()
        m1 = mark()
        g_c.replay()
        return (m0, m1, mark())

    def step_pair():
        m0 = mark()
        g_p.replay()
        return (m0, mark())

    split, n1 = run_timed(ctx, pt["prepare"], step_split, graph=True)
    pair, n2 = run_timed(ctx, pt["prepare"], step_pair, graph=True)
    if after is not None:
        after()
    own, sources = pt["own"], pt["sources"]
    checks = []
    for g, recv, out, both in ((g_d, graphs["recv_d"], graphs["out_c"], g_c),
                               (g_p, graphs["recv_p"], graphs["out_p"], None)):
        static.copy_from(own)
        _poison_recv(recv)
        out.fill_(float("nan"))
        ctx.sync()
        ctx.barrier()
        g.replay()
        ctx.sync()
        ok, why = check_received(_received_a2ad(recv, sources, me, E, ep), sources, me, E, ep)
        if both is not None:
            both.replay()
            ctx.sync()
        checks.append((ok, why, check_combine(out, own, E, ep, pt.get("a2ad_out"))))
    ok = all(ck[0] and ck[2]["ok"] for ck in checks)
    why = "; ".join(x for ck in checks for x in (ck[1], ck[2].get("why", "")) if x)
    return {
        "dispatch": [x[0] for x in split],
        "combine": [x[1] for x in split],
        "total": [x[0] for x in pair],
        "check": {"ok": ok, "why": why, "dispatch_ok": checks[0][0] and checks[1][0], "combine": checks[0][2],
                  "pair_combine": checks[1][2]},
        "notes": n1 + n2,
    }


def impl_a2ad(ctx: Ctx, job: A2adJob | None, pt: dict) -> tuple[dict, torch.Tensor]:
    """a2ad from CUDA graphs of its public API (dispatch, combine and the pair, each captured in
    its own graph), or of its CUDA-plane kernels when capturing the API failed (:func:`a2ad_graphs`).

    On CPU (dry runs) the graphs are _CpuGraph stand-ins: the rows check the code path only."""
    if job is None:
        raise Skip("a2ad is not available")
    mode, why, fallback, graphs = a2ad_graphs(ctx, job, pt["static"], pt["T"])
    plane = getattr(job.a2a, "_plane", None)
    result = time_graphs(ctx, pt, graphs, after=getattr(plane, "check", None))  # a wait that gave up raises here
    label = "public API" if mode == "api" else "CUDA-plane kernels"
    result.update(timing=f"cuda-graph ({mode} capture: {label})" if ctx.cuda else f"cpu stand-in graph ({mode})",
                  capture=mode, capture_why=why, capture_fallback=fallback)
    return result, graphs["out_c"].clone()


def run_eager(ctx: Ctx, prepare, dispatch, combine):
    """Time an eager implementation as a user runs it: per sample, ``eager_pairs`` dispatch +
    combine pairs issued back to back, then one synchronize.

    Two loops, one sample of each per input set in turn: *split* records an event before every
    call (per sample, the mean dispatch and combine intervals) and *pair* records one event
    before the first and one after the last pair (per sample, the interval over the number of
    pairs: the pair figure). Every sample starts from an idle device after a barrier, with the
    next input set copied in and L2 flushed; warm-up pairs run first. Returns
    ``(split samples [(dispatch, combine)], pair samples, the last dispatch's state)``."""
    cfg = ctx.cfg
    n, batches = cfg["eager_pairs"], cfg["eager_batches"]
    clock = ctx.clock
    st = None

    def start(i):
        prepare(i)
        ctx.sync()
        ctx.barrier()

    start(0)
    for _ in range(max(1, cfg["warmup"])):
        st = dispatch()
        combine(st)
    ctx.sync()
    split, pair = [], []
    for b in range(batches):
        ev = clock.pool(2 * n + 1)
        start(b)
        marks = []
        for j in range(n):
            marks.append(clock.at(ev[2 * j]))
            st = dispatch()
            marks.append(clock.at(ev[2 * j + 1]))
            combine(st)
        marks.append(clock.at(ev[2 * n]))
        ctx.sync()
        split.append((sum(clock.us(marks[2 * j], marks[2 * j + 1]) for j in range(n)) / n,
                      sum(clock.us(marks[2 * j + 1], marks[2 * j + 2]) for j in range(n)) / n))
        ev = clock.pool(2)
        start(b)
        m0 = clock.at(ev[0])
        for _ in range(n):
            st = dispatch()
            combine(st)
        m1 = clock.at(ev[1])
        ctx.sync()
        pair.append(clock.us(m0, m1) / n)
    return split, pair, st


def _eager_result(timing: str, split, pair, ok: bool, why: str, comb: dict) -> dict:
    """The result of an eagerly timed implementation: per-sample figures and its checks."""
    return {
        "timing": timing,
        "dispatch": [x[0] for x in split],
        "combine": [x[1] for x in split],
        "total": list(pair),
        "check": {"ok": ok and comb["ok"], "why": "; ".join(x for x in (why, comb.get("why", "")) if x),
                  "dispatch_ok": ok, "combine": comb},
        "notes": [],
    }


def _eager_impl(ctx: Ctx, pt: dict, dispatch, combine, received, *, timing: str, full: bool = False,
                poison=None):
    """Time an eager implementation (:func:`run_eager`) and check it as a2ad is checked:
    ``dispatch(inputs)`` returns a state, ``received(state)`` lists the rows it delivered per
    source, ``combine(state)`` returns the combine output. ``poison(state)`` (when given)
    spoils the last timed dispatch's outputs before the checked one."""
    E, ep, me = ctx.cfg["num_experts"], ctx.ep, ctx.rank
    static: Inputs = pt["static"]
    split, pair, last = run_eager(ctx, pt["prepare"], lambda: dispatch(static), combine)
    own = pt["own"]
    static.copy_from(own)
    if poison is not None and last is not None:
        poison(last)
    ctx.sync()
    ctx.barrier()
    st = dispatch(static)
    ctx.sync()
    ok, why = check_received(received(st), pt["sources"], me, E, ep, full=full)
    out = combine(st)
    ctx.sync()
    comb = check_combine(out, own, E, ep, pt.get("a2ad_out"))
    how = f"eager ({ctx.cfg['eager_pairs']} pairs back to back, one synchronize)"
    return _eager_result(f"{how}{': ' + timing if timing else ''}", split, pair, ok, why, comb), out


def _api_eager(ctx: Ctx, pt: dict, a2a, label: str):
    """A MoeAlltoAll (a2ad's or FlashInfer's) called eagerly through its public API."""
    T, E, ep, me = pt["T"], ctx.cfg["num_experts"], ctx.ep, ctx.rank
    return _eager_impl(
        ctx, pt,
        lambda inp: a2a.dispatch(inp.experts, inp.payloads(), T),
        lambda recv: a2a.combine(recv[0], T),
        lambda recv: _received_a2ad(recv, pt["sources"], me, E, ep),
        timing=label, poison=_poison_recv)


def impl_a2ad_eager(ctx: Ctx, job: A2adJob | None, pt: dict) -> tuple[dict, torch.Tensor]:
    """The public MoeAlltoAll API called eagerly (input checks and launches included)."""
    if job is None:
        raise Skip("a2ad is not available")
    return _api_eager(ctx, pt, job.a2a, "public API")


# --- FlashInfer --------------------------------------------------------------------
def flashinfer_probe(cuda: bool) -> dict:
    """Whether FlashInfer's MoeAlltoAll can run here: ``available``, else ``reason``; its
    ``version`` and where it was imported from (``source``)."""
    import importlib

    info: dict = {"available": False, "module": FLASHINFER_MODULE}
    try:
        mod = importlib.import_module(FLASHINFER_MODULE)
    except Exception as exc:  # ImportError, or a kernel library that fails to load
        info["reason"] = (f"{FLASHINFER_MODULE} does not import ({exception_text(exc, 200)}); install it "
                          "(pip install flashinfer-python) or pass --flashinfer-archive")
        return info
    top = sys.modules.get("flashinfer")
    info["version"] = getattr(top, "__version__", None)
    info["source"] = str(Path(getattr(top, "__file__", "") or "?").parent)
    if not hasattr(mod, "MoeAlltoAll"):
        info["reason"] = f"{FLASHINFER_MODULE} has no MoeAlltoAll"
        return info
    if not cuda and not getattr(mod, "A2AD_BENCH_CPU_STANDIN", False):
        info["reason"] = "FlashInfer's MoeAlltoAll needs CUDA GPUs (CPU run)"
        return info
    info["available"] = True
    return info


class FiJob:
    """One FlashInfer MoeAlltoAll per hidden size (its workspace sized for the largest T).

    FlashInfer's MnnvlMemory exchanges its workspace handles through a CommBackend; the bench
    gives it ``TorchDistBackend`` over the ranks' gloo group (no MPI needed)."""

    def __init__(self, ctx: Ctx, hidden: int):
        import importlib

        fi = importlib.import_module(FLASHINFER_MODULE)
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlMemory, TorchDistBackend

        cfg, ep = ctx.cfg, ctx.ep
        if MnnvlMemory.comm is None:
            MnnvlMemory.comm = TorchDistBackend(group=ctx.gloo)
        mapping = Mapping(world_size=ep, rank=ctx.rank, gpus_per_node=ep, tp_size=ep, moe_ep_size=ep)
        self.hidden = hidden
        self.a2a = fi.MoeAlltoAll(mapping, max(cfg["tokens"]), cfg["top_k"], cfg["num_experts"], hidden_size=hidden)

    def close(self) -> None:
        pass  # FlashInfer keeps its workspaces cached for the process's lifetime


def impl_flashinfer(ctx: Ctx, job: FiJob | None, pt: dict) -> tuple[dict, torch.Tensor]:
    """FlashInfer's MoeAlltoAll from CUDA graphs of its public dispatch/combine, timed and
    checked exactly as a2ad's graphs are."""
    if job is None:
        raise Skip("FlashInfer is not available")
    d, c = _api_calls(job.a2a, pt["static"], pt["T"])
    ctx.barrier()
    c(d())  # one eager round first (loads its kernels)
    ctx.sync()
    graphs = _capture_three(ctx, d, c)
    result = time_graphs(ctx, pt, graphs)
    result["timing"] = "cuda-graph (public API)" if ctx.cuda else "cpu stand-in graph (public API)"
    return result, graphs["out_c"].clone()


def impl_flashinfer_eager(ctx: Ctx, job: FiJob | None, pt: dict) -> tuple[dict, torch.Tensor]:
    """FlashInfer's public dispatch/combine called eagerly, timed as a2ad-eager."""
    if job is None:
        raise Skip("FlashInfer is not available")
    return _api_eager(ctx, pt, job.a2a, "public API")


def impl_nccl(ctx: Ctx, job, pt: dict) -> tuple[dict, torch.Tensor]:
    """Megatron-style all-to-all: counts, permutation, all_to_all_single with splits, inverse + sum."""
    import torch.distributed as dist

    cfg = ctx.cfg
    T, H, k, E, ep = pt["T"], pt["H"], cfg["top_k"], cfg["num_experts"], ctx.ep
    B = dispatch_bytes_per_token(H, k)
    dev = ctx.device

    def dispatch(inp: Inputs):
        mask = target_mask(inp.experts, E, ep)
        in_counts = mask.sum(0)
        out_counts = torch.empty_like(in_counts)
        dist.all_to_all_single(out_counts, in_counts)
        counts = torch.cat([in_counts, out_counts]).cpu()  # the host sync this design needs for its splits
        in_splits, out_splits = counts[:ep].tolist(), counts[ep:].tolist()
        token_idx = permute_indices(mask, sum(in_splits))
        send = pack_rows(inp).index_select(0, token_idx)
        recv = torch.empty(sum(out_splits), B, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
        return recv, token_idx, in_splits, out_splits

    def combine(state):
        recv, token_idx, in_splits, out_splits = state
        expert_out = recv[:, : 2 * H].view(torch.bfloat16).contiguous()  # the identity expert
        back = torch.empty(token_idx.shape[0], H, dtype=torch.bfloat16, device=dev)
        dist.all_to_all_single(back, expert_out, in_splits, out_splits)
        return unpermute_sum(back, token_idx, T, torch.bfloat16)

    def received(st):
        rows = unpack_rows(st[0], H, k)
        per_source, off = [], 0
        for s in range(ep):
            n = st[3][s]
            per_source.append(Inputs(rows.experts[off : off + n], rows.hidden[off : off + n], rows.scales[off : off + n]))
            off += n
        return per_source

    return _eager_impl(ctx, pt, dispatch, combine, received, timing="a host sync for the splits in every dispatch")


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor) -> None:
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, inp)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, inp)


def impl_agrs(ctx: Ctx, job, pt: dict) -> tuple[dict, torch.Tensor]:
    """All-gather every rank's tokens, each rank runs its experts on all of them, reduce-scatter back."""
    cfg = ctx.cfg
    T, H, k, E, ep, me = pt["T"], pt["H"], cfg["top_k"], cfg["num_experts"], ctx.ep, ctx.rank
    B = dispatch_bytes_per_token(H, k)
    dev = ctx.device

    def dispatch(inp: Inputs):
        gathered = torch.empty(ep * T, B, dtype=torch.uint8, device=dev)
        _all_gather_into(gathered, pack_rows(inp))
        return gathered

    def combine(gathered):
        rows = unpack_rows(gathered, H, k)
        mine = (expert_owner_tensor(rows.experts, E, ep) == me).any(1)
        expert_out = rows.hidden * mine.unsqueeze(1).to(torch.bfloat16)  # identity expert, zero where not ours
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        _reduce_scatter(out, expert_out)
        return out

    def received(g):
        rows = unpack_rows(g, H, k)
        return [Inputs(rows.experts[s * T : (s + 1) * T], rows.hidden[s * T : (s + 1) * T],
                       rows.scales[s * T : (s + 1) * T]) for s in range(ep)]

    return _eager_impl(ctx, pt, dispatch, combine, received, timing="", full=True)


IMPL_FUNCS = {"a2ad": impl_a2ad, "a2ad-eager": impl_a2ad_eager, "flashinfer": impl_flashinfer,
              "flashinfer-eager": impl_flashinfer_eager, "nccl": impl_nccl, "agrs": impl_agrs}


# --- ceilings ----------------------------------------------------------------------
def ce_copy(dev_a: int, dev_b: int, nbytes: int, reps: int = 5) -> dict:
    """Copy-engine ceiling: ``tensor.copy_`` to the peer device (cudaMemcpyAsync between
    peers), one-way and both directions at once on two streams. Runs in one process."""
    da, db = torch.device("cuda", dev_a), torch.device("cuda", dev_b)
    a_src = torch.empty(nbytes, dtype=torch.uint8, device=da).random_(0, 256)
    b_src = torch.empty(nbytes, dtype=torch.uint8, device=db).random_(0, 256)
    a_dst = torch.empty(nbytes, dtype=torch.uint8, device=da)
    b_dst = torch.empty(nbytes, dtype=torch.uint8, device=db)
    # torch's peer copy runs on the source device's current stream and fences with the
    # destination device's current stream: give each direction its own pair, so the two
    # directions never wait for each other.
    s_ab, s_ab_peer = torch.cuda.Stream(da), torch.cuda.Stream(db)
    s_ba, s_ba_peer = torch.cuda.Stream(db), torch.cuda.Stream(da)

    def copy(dst, src, s, s_peer):
        with torch.cuda.stream(s_peer), torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)

    def sync():
        torch.cuda.synchronize(da)
        torch.cuda.synchronize(db)

    copy(b_dst, a_src, s_ab, s_ab_peer)
    copy(a_dst, b_src, s_ba, s_ba_peer)
    sync()
    two, one = [], []
    for _ in range(reps):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s_ab)
        s_ba.wait_stream(s_ab)
        copy(b_dst, a_src, s_ab, s_ab_peer)
        copy(a_dst, b_src, s_ba, s_ba_peer)
        s_ab.wait_stream(s_ba)
        end.record(s_ab)
        end.synchronize()
        two.append(start.elapsed_time(end) * 1e3)
    for _ in range(reps):
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s_ab)
        copy(b_dst, a_src, s_ab, s_ab_peer)
        end.record(s_ab)
        end.synchronize()
        one.append(start.elapsed_time(end) * 1e3)
    sync()
    ok = torch.equal(b_dst[:1 << 20].cpu(), a_src[:1 << 20].cpu()) and torch.equal(a_dst[-(1 << 20):].cpu(),
                                                                                    b_src[-(1 << 20):].cpu())
    t2, t1 = percentile(two, 50), percentile(one, 50)
    peer = torch.cuda.can_device_access_peer(dev_a, dev_b)
    return {
        "ce_two_way": {"devices": [dev_a, dev_b], "bytes": nbytes, "us": summarize(two), "per_gpu_gbps": gbps(nbytes, t2),
                       "aggregate_gbps": gbps(2 * nbytes, t2), "verified": ok, "peer_access": peer},
        "ce_one_way": {"devices": [dev_a, dev_b], "bytes": nbytes, "us": summarize(one), "per_gpu_gbps": gbps(nbytes, t1)},
    }


def sm_store(ctx: Ctx, nbytes: int, reps: int = 5) -> dict:
    """SM-driven peer stores: every rank writes ``nbytes`` into the next rank's row of an
    a2ad-mapped workspace with an elementwise kernel (``torch.add(src, 0, out=peer_view)``),
    all ranks at once (two-way for ep=2)."""
    from a2ad import layout as L
    from a2ad.client import attach

    cfg = ctx.cfg
    n = nbytes // 16 * 16
    aux = L.aux_layout(ctx.ep, 1)
    off = L.pad_up(aux.aux_data_size)
    att = attach(f"{cfg['run_id']}-ceiling", ctx.rank, ctx.ep, max_num_tokens=1, top_k=1, num_experts=ctx.ep,
                 workspace_size_per_rank=off + n, runtime_dir=cfg["runtime_dir"],
                 device=ctx.device if ctx.cuda else None, timeout=cfg["a2ad_timeout"])
    try:
        peer = (ctx.rank + 1) % ctx.ep
        dst = att.workspace[peer, off : off + n].view(torch.float32)
        g = torch.Generator(device=ctx.device).manual_seed(_seed(cfg["seed"], 9, ctx.rank))
        src = torch.rand(n // 4, generator=g, device=ctx.device)
        times = []
        for rep in range(reps + 1):
            ctx.barrier()
            if ctx.cuda:
                ctx.gpu_sleep(300)
            m0 = ctx.clock.mark()
            torch.add(src, 0, out=dst)
            m1 = ctx.clock.mark()
            ctx.sync()
            if rep:
                times.append(ctx.clock.us(m0, m1))
        ok = bool(torch.equal(dst[:4096], src[:4096]) and torch.equal(dst[-4096:], src[-4096:]))
        ctx.sync()
        ctx.barrier()
        del dst
    finally:
        att.close()
    return {"times": times, "ok": ok, "bytes": n}


def measure_ceilings(ctx: Ctx) -> dict:
    cfg = ctx.cfg
    res: dict = {}
    nbytes = cfg["ceiling_bytes"]
    if ctx.rank == 0 and ctx.cuda:
        if torch.cuda.device_count() >= 2:
            log(f"copy-engine ceiling: {nbytes / 2**30:.2f} GiB GPU0<->GPU1 ...")
            try:
                res.update(ce_copy(0, 1, nbytes))
            except Exception as exc:
                res["ce_error"] = f"{type(exc).__name__}: {exc}"
            torch.cuda.empty_cache()
        else:
            res["ce_error"] = "one GPU: no peer to copy to"
    ctx.barrier()
    if ctx.rank == 0:
        log("SM peer-store ceiling through the a2ad workspace ...")
    try:
        mine = sm_store(ctx, nbytes)
        err = None
    except Exception as exc:
        mine, err = None, f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
    allr = ctx.gather((mine, err))
    if ctx.rank == 0:
        errs = [e for _, e in allr if e]
        if errs:
            res["sm_store_error"] = "; ".join(errs)
        else:
            steps = step_latencies([m["times"] for m, _ in allr])
            med = percentile(steps, 50)
            nb = allr[0][0]["bytes"]
            res["sm_store_two_way"] = {
                "bytes": nb,
                "us": summarize(steps),
                "per_gpu_gbps": gbps(nb, med),
                "aggregate_gbps": gbps(nb * ctx.ep, med),
                "verified": all(m["ok"] for m, _ in allr),
                "how": "torch.add(src, 0, out=peer row)" + ("" if ctx.cuda else ", host shared memory"),
            }
    if ctx.cuda:
        torch.cuda.empty_cache()
    return res


def hardware_info(ctx: Ctx) -> dict:
    import platform

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host_cpu": platform.machine()}
    if not ctx.cuda:
        info.update(device_name="CPU (gloo stands in for NCCL, the host backend for CUDA)", device_count=ctx.ep,
                    nccl=None, driver=None)
        return info
    p = torch.cuda.get_device_properties(ctx.device)
    info.update(
        device_name=torch.cuda.get_device_name(ctx.device),
        device_count=torch.cuda.device_count(),
        capability=f"{p.major}.{p.minor}",
        sm_count=p.multi_processor_count,
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
        memory_bytes=int(p.total_memory),
    )
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        info["nccl"] = None
    info["driver"] = None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=15)
            info["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
            r = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=15)
            if r.returncode == 0:
                info["topology"] = r.stdout[:4000]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    return info


# --- the rank's main loop ------------------------------------------------------------
def _remote_accounting(ctx: Ctx, T: int, H: int, weights) -> dict:
    """Per-GPU mean over ranks and timed input sets of the remote (token, target) pairs."""
    cfg = ctx.cfg
    k, E, ep = cfg["top_k"], cfg["num_experts"], ctx.ep
    pairs = []
    for s in range(ep):
        for i in range(cfg["input_sets"]):
            e = make_routing_for(cfg["seed"], s, T, i, k, E, weights, ctx.device)
            pairs.append(remote_pairs(target_mask(e, E, ep), s))
    mean_pairs = sum(pairs) / len(pairs)
    return {
        "dispatch_bytes": mean_pairs * dispatch_bytes_per_token(H, k),
        "combine_bytes": mean_pairs * combine_bytes_per_token(H),
        "pairs_per_token": mean_pairs / T,
    }


def _run_point(ctx: Ctx, job_box: dict, T: int, H: int, weights) -> dict:
    cfg = ctx.cfg
    K, k, E = cfg["input_sets"], cfg["top_k"], cfg["num_experts"]
    sets = [make_inputs(cfg["seed"], ctx.rank, T, H, i, k, E, weights, ctx.device) for i in range(K)]
    static = sets[0].clone()
    # the check set (index K) is never used in timing, so stale outputs of a timed replay cannot pass a check
    sources = [make_inputs(cfg["seed"], s, T, H, K, k, E, weights, ctx.device) for s in range(ctx.ep)]

    def prepare(i):
        static.copy_from(sets[i % K])
        ctx.flush_l2()

    pt = {"T": T, "H": H, "static": static, "prepare": prepare, "sources": sources, "own": sources[ctx.rank],
          "a2ad_out": None}
    out = {"rows": [], "skipped": [], "errors": [], "notes": []}
    remote = _remote_accounting(ctx, T, H, weights) if ctx.rank == 0 else None
    for impl in job_box.get("impls", cfg["impls"]):
        t0 = time.monotonic()
        job, missing = None, None
        if impl.startswith("a2ad"):
            job, missing = job_box.get("job"), job_box.get("why") or "a2ad is not available"
        elif impl.startswith("flashinfer"):
            job, missing = job_box.get("fi"), job_box.get("fi_why") or "FlashInfer is not available"
        res, err, skip, tb = None, None, None, None
        try:
            if missing and job is None:
                raise Skip(missing)
            res, comb_out = IMPL_FUNCS[impl](ctx, job, pt)
            if impl.startswith("a2ad") and pt["a2ad_out"] is None:
                pt["a2ad_out"] = comb_out
        except Skip as exc:
            skip = str(exc)
        except Exception as exc:
            err, tb = f"rank {ctx.rank}: {type(exc).__name__}: {exc}", traceback.format_exc()
        if err is None:
            ctx.sync()
        votes = ctx.gather((res, err, skip, tb))
        errs = [v[1] for v in votes if v[1]]
        if errs and impl.startswith("a2ad") and job is not None:
            # the job's rounds may now disagree between ranks: every rank reopens it under a new name
            job.close()
            job_box["gen"] = job_box.get("gen", 0) + 1
            try:
                job_box["job"] = A2adJob(ctx, H, job_box["gen"])
                reopen_err = None
            except Exception as exc:
                job_box["job"], reopen_err = None, f"{type(exc).__name__}: {exc}"
            reopen = ctx.gather(reopen_err)
            if any(reopen):
                if job_box["job"] is not None:
                    job_box["job"].close()
                job_box["job"], job_box["why"] = None, f"reopening the a2ad job failed: {[r for r in reopen if r]}"
        if errs and impl.startswith("flashinfer") and job is not None:
            # FlashInfer has no way to re-arm its ranks' rounds: no more FlashInfer at this hidden size
            job_box["fi"], job_box["fi_why"] = None, f"FlashInfer failed earlier at hidden={H} (T={T} {impl})"
        if ctx.rank != 0:
            continue
        dt = time.monotonic() - t0
        if errs:
            out["errors"].append(f"T={T} hidden={H} {impl}: " + " | ".join(errs))
            for v in votes:
                if v[3]:
                    log(f"T={T} hidden={H} {impl} traceback:\n{v[3]}")
            log(f"T={T} hidden={H} {impl}: ERROR {errs[0]}")
            continue
        if any(v[2] for v in votes):
            out["skipped"].append({"tokens": T, "hidden": H, "impl": impl, "reason": next(v[2] for v in votes if v[2])})
            continue
        per = [v[0] for v in votes]
        row = build_row(
            impl, T, H, ctx.ep, k, E,
            step_latencies([p["dispatch"] for p in per]),
            step_latencies([p["combine"] for p in per]),
            step_latencies([p["total"] for p in per]),
            remote,
            timing=per[0]["timing"],
            routing=cfg["routing"],
            replays=len(per[0]["total"]),
            check={"ok": all(p["check"]["ok"] for p in per),
                   "why": "; ".join(f"rank {r}: {p['check']['why']}" for r, p in enumerate(per) if p["check"]["why"]),
                   "ranks": [{kk: vv for kk, vv in p["check"].items() if kk != "why"} for p in per]},
            mode=IMPL_MODE.get(impl, "eager"),
            **{k: per[0][k] for k in ("capture", "capture_why", "capture_fallback") if k in per[0]},
            **({"eager_pairs": cfg["eager_pairs"]} if IMPL_MODE.get(impl) == "eager" else {}),
            per_rank_median_us={key: [percentile(p[key], 50) for p in per] for key in ("dispatch", "combine", "total")},
            samples_us={key: [round(x, 3) for x in step_latencies([p[key] for p in per])]
                        for key in ("dispatch", "combine", "total")},
            seconds=dt,
        )
        for p in per:
            for n in p["notes"]:
                if n not in out["notes"]:
                    out["notes"].append(n)
        out["rows"].append(_finite(row))
        t = row["total_us"]
        log(f"T={T} hidden={H} {impl:<16} dispatch {row['dispatch_us']['median']:9.2f} us  combine "
            f"{row['combine_us']['median']:9.2f} us  total {t['median']:9.2f} us  "
            f"check {'ok' if row['check']['ok'] else 'FAIL: ' + row['check']['why']}  ({dt:.1f} s)")
    return out


def _append_jsonl(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(_finite(obj), default=_json_default) + "\n")


def _run_rank(ctx: Ctx) -> None:
    cfg = ctx.cfg
    run_dir = Path(cfg["run_dir"])
    points = run_dir / "points.jsonl"
    _setup_device(ctx)
    meta: dict = {}
    impls = list(cfg["impls"])
    want_fi = any(i.startswith("flashinfer") for i in impls)
    if want_fi:
        if cfg.get("flashinfer_paths") and ctx.cuda:  # the archive's kernels are built for this GPU's arch
            major, minor = torch.cuda.get_device_capability(ctx.device)
            os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}")
        probe = flashinfer_probe(ctx.cuda)
        probes = ctx.gather(probe)
        bad = [(r, p) for r, p in enumerate(probes) if not p["available"]]
        meta["flashinfer"] = probe if not bad else {**probe, "available": False,
                                                    "reason": f"rank {bad[0][0]}: {bad[0][1]['reason']}"}
        if bad:
            impls = [i for i in impls if not i.startswith("flashinfer")]
            want_fi = False
            if ctx.rank == 0:
                log(f"flashinfer: skipped: {meta['flashinfer']['reason']}")
                _append_jsonl(points, {"skipped": [{"impl": i, "reason": meta["flashinfer"]["reason"]}
                                                   for i in cfg["impls"] if i.startswith("flashinfer")]})
        elif ctx.rank == 0:
            log(f"flashinfer: {probe.get('version')} from {probe.get('source')}")
    else:
        meta["flashinfer"] = {"available": False, "reason": "not requested (--impls)"}
    if ctx.rank == 0:
        meta["hardware"] = hardware_info(ctx)
    if cfg["ceilings"]:
        meta["ceilings"] = measure_ceilings(ctx)
    if ctx.rank == 0:
        (run_dir / "meta.json").write_text(json.dumps(_finite(meta), default=_json_default))
        if meta.get("ceilings"):
            log(format_ceilings(meta["ceilings"]))
    weights = expert_weights(cfg["num_experts"], cfg["routing"], cfg["zipf_s"], cfg["seed"])
    want_a2ad = any(i.startswith("a2ad") for i in impls)
    durations: dict[int, float] = {}
    last = None
    for H in cfg["hidden"]:
        job_box: dict = {"gen": 0, "impls": impls}
        if want_fi:
            try:
                job_box["fi"], err = FiJob(ctx, H), None
            except Exception as exc:
                job_box["fi"], err = None, f"rank {ctx.rank}: {exception_text(exc)}"
                log(f"hidden={H}: FlashInfer's MoeAlltoAll failed:\n{traceback.format_exc()}")
            errs = [e for e in ctx.gather(err) if e]
            if errs:
                job_box["fi"], job_box["fi_why"] = None, "constructing FlashInfer's MoeAlltoAll failed: " + " | ".join(errs)
                job_box["impls"] = [i for i in impls if not i.startswith("flashinfer")]
                if ctx.rank == 0:
                    _append_jsonl(points, {"errors": [f"hidden={H}: {job_box['fi_why']}"]})
        if want_a2ad:
            try:
                job_box["job"], err = A2adJob(ctx, H, 0), None
            except Exception as exc:
                job_box["job"], err = None, f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
            errs = [e for e in ctx.gather(err) if e]
            if errs:
                if job_box["job"] is not None:
                    job_box["job"].close()
                job_box["job"], job_box["why"] = None, "opening the a2ad job failed: " + " | ".join(errs)
                if ctx.rank == 0:
                    _append_jsonl(points, {"errors": [f"hidden={H}: {job_box['why']}"]})
                    log(f"hidden={H}: {job_box['why']}")
        try:
            for T in cfg["tokens"]:
                decision = None
                if ctx.rank == 0:
                    remaining = cfg["deadline"] - time.time() - cfg["reserve_s"]
                    est = durations.get(T) or (2.0 * last if last else 10.0)
                    if remaining < est:
                        decision = f"time budget: {max(remaining, 0):.0f} s left, this point needs about {est:.0f} s"
                decision = ctx.bcast(decision)
                if decision:
                    if ctx.rank == 0:
                        _append_jsonl(points, {"skipped": [{"tokens": T, "hidden": H, "reason": decision}]})
                        log(f"T={T} hidden={H}: skipped ({decision})")
                    continue
                t0 = time.monotonic()
                res = _run_point(ctx, job_box, T, H, weights)
                if ctx.cuda:
                    torch.cuda.empty_cache()  # the point's inputs and graph pools are gone now
                last = durations[T] = time.monotonic() - t0
                if ctx.rank == 0:
                    _append_jsonl(points, res)
        finally:
            if job_box.get("job") is not None:
                ctx.sync()
                job_box["job"].close()
    ctx.barrier()
    if ctx.rank == 0:
        (run_dir / "done").write_text("ok\n")


def _worker(rank: int, cfg: dict) -> None:
    """Entry point of one rank's process (spawned)."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    # --flashinfer-archive: spawn hands the children the launcher's sys.path, so add the paths here
    for path in reversed(cfg.get("flashinfer_paths") or []):
        if path not in sys.path:
            sys.path.insert(0, path)
    for k, v in (cfg.get("flashinfer_env") or {}).items():
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    code = 0
    try:
        why = ensure_client_package()
        if why:
            raise RuntimeError(why)
        ctx = Ctx(cfg, rank)
        _init_dist(ctx)
        _run_rank(ctx)
    except BaseException:
        code = 1
        tb = traceback.format_exc()
        try:
            (Path(cfg["run_dir"]) / f"error-rank{rank}.txt").write_text(tb)
        except OSError:
            pass
        print(f"[a2ad-bench] rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
    if code == 0:
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang in interpreter teardown (NCCL, CUDA, zmq)


# =====================================================================================
# Launcher
# =====================================================================================
def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return vals


def _impl_list(text: str) -> list[str]:
    vals = [x for x in text.replace(" ", "").split(",") if x]
    bad = [v for v in vals if v not in IMPLS]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"implementations are {', '.join(IMPLS)}; got {text!r}")
    return vals


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1G, 256M)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="a2ad-bench",
        description="Benchmark a2ad dispatch/combine against NCCL baselines (one process per GPU).",
        epilog="benchmarks/README.md explains every figure. Example: a2ad-bench --quick --json bench.json --plot perf.png",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--tokens", type=_int_list, help=f"tokens per rank (default {','.join(map(str, FULL_TOKENS))})")
    g.add_argument("--hidden", type=_int_list, help=f"hidden sizes (default {','.join(map(str, DEFAULT_HIDDEN))})")
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--num-experts", type=int, default=256)
    g.add_argument("--ep", type=int, help="ranks, one per GPU (default: every visible GPU; 2 on CPU)")
    g.add_argument("--routing", choices=["uniform", "skewed"], default="uniform",
                   help="uniform random experts, or Zipf-skewed expert popularity")
    g.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of --routing skewed (default 1.0)")
    g.add_argument("--impls", type=_impl_list, help=f"subset of {','.join(IMPLS)} (default all)")
    g.add_argument("--quick", action="store_true", help="T in {1,128,4096}, hidden 7168, 50 replays: a smoke run")
    m = p.add_argument_group("measurement")
    m.add_argument("--replays", type=int, help="timed replays per figure (default 100; 50 with --quick)")
    m.add_argument("--warmup", type=int, default=None, help="untimed replays before every chunk of replays (default 3)")
    m.add_argument("--input-sets", type=int, default=4, help="input sets rotated between replays (default 4)")
    m.add_argument("--no-l2-flush", action="store_true", help="do not overwrite 2 x L2 between replays")
    m.add_argument("--capture", choices=["api", "plane", "auto"], default="api",
                   help="how a2ad is put in CUDA graphs: its public dispatch/combine (api, the default; falls back "
                        "to the plane, with the reason in the report, when capturing raises) or its CUDA-plane "
                        "kernels (plane); auto is api")
    m.add_argument("--eager-pairs", type=int, default=None,
                   help="eager rows: dispatch+combine pairs issued back to back per sample, one synchronize "
                        "(default 50; 5 with --dry-run)")
    m.add_argument("--eager-batches", type=int, default=None,
                   help="eager rows: samples per figure (default 20; 3 with --dry-run)")
    m.add_argument("--no-ceilings", action="store_true", help="skip the NVLink ceiling measurements")
    m.add_argument("--ceiling-bytes", type=_size, default=None, help="bytes per direction of the ceilings (default 1G)")
    m.add_argument("--seed", type=int, default=1234)
    r = p.add_argument_group("run")
    r.add_argument("--budget", type=float, default=480.0,
                   help="wall-clock seconds for the whole run; grid points that would overrun are skipped (default 480)")
    r.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo instead of NCCL and the host backend instead of CUDA (timings meaningless)")
    r.add_argument("--dry-run", action="store_true", help="--device cpu with a tiny grid: checks the whole pipeline")
    r.add_argument("--runtime-dir", help="use the a2ad daemon already serving this runtime folder")
    r.add_argument("--flashinfer-archive", metavar="PATH",
                   help="a FlashInfer archive (.tgz, or the folder it was extracted to) holding the flashinfer "
                        "package and the wheels it needs: extracted and installed in the scratch folder for the "
                        "ranks only (not needed after pip install flashinfer-python)")
    r.add_argument("--a2ad-timeout", type=float, default=30.0, help="MoeAlltoAll rendezvous/peer wait timeout, s")
    r.add_argument("--keep-run-dir", action="store_true", help="keep the scratch folder (daemon log, raw points)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every result to this JSON file")
    o.add_argument("--plot", metavar="PATH", help="write latency/bandwidth plots to this PNG")
    o.add_argument("--write-perf-doc", metavar="PATH",
                   help="write a markdown report (e.g. docs/PERF.md); the plot goes beside it as perf.png unless --plot")
    return p


def resolve_config(args, visible_gpus: int) -> dict:
    """Turn parsed options into the workers' config (raises ValueError on a bad combination)."""
    cpu = args.dry_run or args.device == "cpu"
    if args.dry_run:
        tokens = args.tokens or list(DRY_TOKENS)
        hidden = args.hidden or list(DRY_HIDDEN)
    elif args.quick:
        tokens = args.tokens or list(QUICK_TOKENS)
        hidden = args.hidden or [7168]
    else:
        tokens = args.tokens or list(FULL_TOKENS)
        hidden = args.hidden or list(DEFAULT_HIDDEN)
    replays = args.replays or (5 if args.dry_run else 50 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    ep = args.ep or (2 if cpu else visible_gpus)
    if not cpu:
        if visible_gpus < 1:
            raise ValueError("no CUDA GPU is visible: run on a GPU machine, or use --dry-run (CPU, gloo)")
        if ep > visible_gpus:
            raise ValueError(f"--ep {ep} needs {ep} GPUs (one rank per GPU); {visible_gpus} visible")
    if ep < 1:
        raise ValueError("--ep must be >= 1")
    if args.num_experts < ep:
        raise ValueError(f"--num-experts ({args.num_experts}) must be >= ep ({ep})")
    if not 1 <= args.top_k <= min(22, args.num_experts):
        raise ValueError(f"--top-k must be in [1, min(22, num_experts)], got {args.top_k}")
    if any(h % 2 for h in hidden):
        raise ValueError(f"hidden sizes must be even, got {hidden}")
    if replays < 1 or warmup < 0 or args.input_sets < 1:
        raise ValueError("--replays >= 1, --warmup >= 0 and --input-sets >= 1 please")
    if args.budget <= 0:
        raise ValueError("--budget must be > 0 seconds")
    eager_batches = args.eager_batches if args.eager_batches is not None else (3 if args.dry_run else 20)
    eager_pairs = args.eager_pairs if args.eager_pairs is not None else (5 if args.dry_run else 50)
    if eager_pairs < 1 or eager_batches < 1:
        raise ValueError("--eager-pairs >= 1 and --eager-batches >= 1 please")
    if args.flashinfer_archive and not Path(args.flashinfer_archive).exists():
        raise ValueError(f"--flashinfer-archive {args.flashinfer_archive}: no such file or folder")
    impls = args.impls or list(IMPLS)
    return {
        "mode": "cpu" if cpu else "gpu",
        "device": "cpu" if cpu else "cuda",
        "tokens": sorted(set(tokens)),
        "hidden": sorted(set(hidden), reverse=True),
        "top_k": args.top_k,
        "num_experts": args.num_experts,
        "ep": ep,
        "routing": args.routing,
        "zipf_s": args.zipf_s,
        "impls": [i for i in IMPLS if i in impls],
        "replays": replays,
        "warmup": warmup,
        "chunk": 25,
        "input_sets": args.input_sets,
        "l2_flush": not (cpu or args.no_l2_flush),
        "capture": "api" if args.capture == "auto" else args.capture,
        "eager_pairs": eager_pairs,
        "eager_batches": eager_batches,
        "flashinfer_archive": args.flashinfer_archive,
        "ceilings": not args.no_ceilings,
        "ceiling_bytes": args.ceiling_bytes or ((16 << 20) if cpu else (1 << 30)),
        "seed": args.seed,
        "budget_s": args.budget,
        "reserve_s": min(30.0, max(5.0, 0.08 * args.budget)),
        "a2ad_timeout": args.a2ad_timeout,
        "pg_timeout": max(60.0, min(600.0, args.budget)),
    }


class Daemon:
    """An a2ad daemon subprocess on a private runtime folder, through the shared launcher
    (the log goes to ``log_path``, in the run folder the bench removes itself)."""

    def __init__(self, runtime_dir: Path, backend: str, log_path: Path):
        from a2ad.tools.launcher import DaemonLauncher

        self.runtime_dir, self.backend, self.log_path = runtime_dir, backend, log_path
        self._launcher = DaemonLauncher(runtime_dir, "--backend", backend, "--grace", "1", "--log-level", "info",
                                        log_path=log_path)

    @property
    def proc(self):
        return self._launcher.proc

    def start(self, timeout: float = 30.0) -> None:
        self._launcher.start(timeout)  # LaunchError (a RuntimeError) with the log's tail

    def log_tail(self, n: int = 3000) -> str:
        return self._launcher.log()[-n:]

    def stop(self) -> None:
        self._launcher.stop(timeout=15.0)


def prepare_flashinfer_archive(archive, dest, python: str | None = None) -> tuple[list[str], dict]:
    """Make a FlashInfer archive importable by the ranks, as a user's ``pip install`` would:
    extract it (a ``.tgz``; a folder is used as it is) into ``dest``, install the wheels it
    carries (apache-tvm-ffi) with ``pip install --no-index --no-deps --target``, and return
    ``(paths for sys.path / PYTHONPATH, environment variables to set where unset)``.
    Raises ValueError with the reason when that cannot be done."""
    import tarfile

    archive, dest = Path(archive), Path(dest)
    if archive.is_dir():
        root = archive.resolve()
    else:
        root = dest / "flashinfer-archive"
        root.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(archive) as tf:
                try:
                    tf.extractall(root, filter="data")
                except TypeError:  # a Python without extraction filters
                    tf.extractall(root)
        except (OSError, tarfile.TarError) as exc:
            raise ValueError(f"cannot extract {archive}: {exc}") from None
    if not (root / "flashinfer" / "__init__.py").is_file():
        raise ValueError(f"{archive} holds no flashinfer package at its top")
    paths = [str(root)]
    wheels = sorted(str(w) for w in root.glob("*.whl"))
    if wheels:
        site = dest / "flashinfer-site"
        cmd = [python or sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--disable-pip-version-check", "--target", str(site), *wheels]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(f"installing {', '.join(Path(w).name for w in wheels)} failed: {exc}") from None
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise ValueError(f"pip could not install {', '.join(Path(w).name for w in wheels)}: "
                             f"{tail[-1] if tail else 'exit ' + str(r.returncode)}")
        paths.append(str(site))
    env = {"FLASHINFER_WORKSPACE_BASE": str(dest / "flashinfer-workspace")}
    return paths, env


def _command_line(argv: list[str]) -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    head = "a2ad-bench" if prog == "a2ad-bench" else "python -m a2ad.bench"
    return " ".join([head] + [shlex.quote(a) for a in argv])


def _collect(run_dir: Path) -> dict:
    """What the ranks left in the run folder."""
    out = {"hardware": {}, "ceilings": {}, "flashinfer": {}, "rows": [], "skipped": [], "errors": [], "notes": [],
           "complete": (run_dir / "done").exists()}
    meta = run_dir / "meta.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        out["hardware"], out["ceilings"] = m.get("hardware") or {}, m.get("ceilings") or {}
        out["flashinfer"] = m.get("flashinfer") or {}
    pts = run_dir / "points.jsonl"
    if pts.exists():
        for line in pts.read_text().splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            for key in ("rows", "skipped", "errors", "notes"):
                for v in obj.get(key, []):
                    if key != "notes" or v not in out["notes"]:
                        out[key].append(v)
    for f in sorted(run_dir.glob("error-rank*.txt")):
        text = f.read_text(errors="replace").strip().splitlines()
        out["errors"].append(f"{f.stem}: {text[-1] if text else '?'} (traceback on stderr)")
    return out


def _spawn_and_wait(cfg: dict, hard_deadline: float) -> list[str]:
    """Run one process per rank; returns launcher-side problems (never hangs past hard_deadline)."""
    import torch.multiprocessing as tmp

    from a2ad import bench as this  # spawn pickles the target by its module name, never __main__

    mp = tmp.get_context("spawn")
    procs = [mp.Process(target=this._worker, args=(r, cfg), daemon=True, name=f"a2ad-bench-rank{r}")
             for r in range(cfg["ep"])]
    for p in procs:
        p.start()
    problems: list[str] = []
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.monotonic()
                log(f"rank(s) {[i for i, _ in bad]} exited with {[c for _, c in bad]}; giving the others 20 s")
            if failed_at is not None and time.monotonic() > failed_at + 20:
                problems.append("ranks still running 20 s after another rank failed were stopped")
                break
            if time.time() > hard_deadline:
                problems.append("the time budget ran out with ranks still running: stopped them (raise --budget)")
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for i, p in enumerate(procs):
        if p.exitcode not in (0, None) and not problems:
            problems.append(f"rank {i} exited with {p.exitcode}")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:  # fail before the run, not after it
        why = plot_unavailable()
        if why:
            parser.exit(2, f"a2ad-bench: error: {why}\n")
    started = time.time()
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    cpu = args.dry_run or args.device == "cpu"
    visible = 0
    if not cpu:
        try:
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            visible = 0
    try:
        cfg = resolve_config(args, visible)
    except ValueError as exc:
        parser.error(str(exc))
    why = ensure_client_package()
    if why:
        log(why)
        return 2
    cfg["deadline"] = started + args.budget
    command = _command_line(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="a2ad-bench-"))
    cfg["run_dir"] = str(run_dir)
    cfg["run_id"] = f"bench{os.getpid()}"
    errors_: list[str] = []
    notes: list[str] = []
    skipped: list[dict] = []
    fi_info: dict = {}
    daemon = None
    if cfg["flashinfer_archive"] and any(i.startswith("flashinfer") for i in cfg["impls"]):
        try:
            paths, env = prepare_flashinfer_archive(cfg["flashinfer_archive"], run_dir)
            cfg["flashinfer_paths"], cfg["flashinfer_env"] = paths, env
            os.environ["PYTHONPATH"] = os.pathsep.join(paths + [x for x in [os.environ.get("PYTHONPATH")] if x])
            log(f"flashinfer: {cfg['flashinfer_archive']} ready for the ranks")
        except ValueError as exc:
            reason = f"--flashinfer-archive: {exc}"
            log(f"flashinfer: skipped: {reason}")
            fi_info = {"available": False, "reason": reason}
            skipped += [{"impl": i, "reason": reason} for i in cfg["impls"] if i.startswith("flashinfer")]
            cfg["impls"] = [i for i in cfg["impls"] if not i.startswith("flashinfer")]
    log(f"{cfg['mode']} run: ep={cfg['ep']} tokens={cfg['tokens']} hidden={cfg['hidden']} impls={cfg['impls']} "
        f"replays={cfg['replays']} budget={args.budget:.0f} s; scratch {run_dir}")
    try:
        wants_a2ad = any(i.startswith("a2ad") for i in cfg["impls"]) or cfg["ceilings"]
        if wants_a2ad and not cpu:
            try:
                from a2ad.client import _ext

                _ext.load()  # build once here, not in every rank at once
            except Exception as exc:
                errors_.append(f"the a2ad CUDA extension is unavailable, a2ad rows skipped: {exc}")
                log(errors_[-1])
                cfg["impls"] = [i for i in cfg["impls"] if not i.startswith("a2ad")]
        if args.runtime_dir:
            from a2ad.connection import ping

            try:
                hello = ping(args.runtime_dir, timeout=5.0)
            except Exception as exc:
                parser.error(f"no a2ad daemon answers in --runtime-dir {args.runtime_dir}: {exc}")
            if hello.get("backend") != ("host" if cpu else "cuda"):
                parser.error(f"the daemon in {args.runtime_dir} runs the {hello.get('backend')} backend; "
                             f"this run needs {'host' if cpu else 'cuda'}")
            cfg["runtime_dir"] = str(args.runtime_dir)
        else:
            rt = run_dir / "rt"
            daemon = Daemon(rt, "host" if cpu else "cuda", run_dir / "daemon.log")
            daemon.start()
            cfg["runtime_dir"] = str(rt)
        problems = _spawn_and_wait(cfg, cfg["deadline"] - 5.0)
        errors_ += problems
    except KeyboardInterrupt:
        errors_.append("interrupted")
    except Exception as exc:
        errors_.append(f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        if daemon is not None:
            daemon.stop()
    got = _collect(run_dir)
    rows = got["rows"]
    add_speedups(rows)
    add_comparisons(rows)
    public_cfg = {k: v for k, v in cfg.items()
                  if k not in ("run_dir", "deadline", "runtime_dir", "run_id", "flashinfer_paths", "flashinfer_env")}
    result = {
        "schema": SCHEMA,
        "command": command,
        "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": public_cfg,
        "hardware": got["hardware"],
        "ceilings": got["ceilings"],
        "flashinfer": fi_info or got["flashinfer"],
        "capture": capture_summary(rows, cfg["capture"]),
        "comparisons": comparisons(rows),
        "rows": sort_rows(rows),
        "skipped": skipped + got["skipped"],
        "errors": errors_ + got["errors"],
        "notes": notes + got["notes"],
        "complete": got["complete"],
        "wall_s": round(time.time() - started, 1),
    }
    if cpu:
        result["notes"].insert(0, "CPU run: gloo stands in for NCCL and the host backend for CUDA; the figures "
                                  "check the pipeline, they are not performance")
    result["targets"] = [] if cpu else evaluate_targets(result["rows"], result["ceilings"])
    result = _finite(result)
    print(make_report(result), flush=True)
    plot_path = args.plot
    if args.write_perf_doc and not plot_path:
        plot_path = str(Path(args.write_perf_doc).parent / "perf.png")
    if plot_path:
        why = plot(result, plot_path)
        if why:
            log(why)
            plot_path = None
        else:
            log(f"plot: {plot_path}")
    if args.json:
        write_json(result, args.json)
        log(f"json: {args.json}")
    if args.write_perf_doc:
        doc = Path(args.write_perf_doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        rel = os.path.relpath(plot_path, doc.parent) if plot_path else None
        doc.write_text(perf_doc(result, rel))
        log(f"perf doc: {doc}")
    if daemon is not None and (errors_ or got["errors"]):
        tail = daemon.log_tail(1500)
        if tail:
            log(f"daemon log tail:\n{tail}")
    if args.keep_run_dir:
        log(f"scratch kept: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    failed_checks = [r for r in result["rows"] if not (r.get("check") or {}).get("ok", True)]
    if failed_checks:
        log(f"{len(failed_checks)} row(s) failed their correctness check")
    return 1 if (result["errors"] or failed_checks) else 0


if __name__ == "__main__":
    sys.exit(main())
