"""The workload: the grid, byte accounting, routing and inputs (any rank can regenerate any
other's), the Megatron-style permutation, and the checks of received rows and combine outputs.
Pure torch; unit-tested on CPU."""

from __future__ import annotations

import torch

# the grid (kept in common, which imports no torch, so that `a2ad-bench --help` is quick)
from .common import DEFAULT_HIDDEN, DRY_HIDDEN, DRY_TOKENS, FULL_TOKENS, QUICK_TOKENS  # noqa: F401


# --- accounting --------------------------------------------------------------------------
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


# --- routing and inputs ------------------------------------------------------------------
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


# --- the Megatron-style permutation ------------------------------------------------------
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


# --- checks ------------------------------------------------------------------------------
#: Relative error (||out - ref|| / ||ref||) a bf16 combine output may have against float64.
COMBINE_TOLERANCE = 1e-2


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
