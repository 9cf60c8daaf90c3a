"""The implementations, each timed and checked the same way: a2ad (CUDA graphs of its public API,
or of its CUDA-plane kernels when capturing the API fails) and a2ad-eager, FlashInfer's
MoeAlltoAll (graph and eager), NCCL's Megatron all-to-all, and all-gather + reduce-scatter."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from .common import Skip, exception_text, log
from .timing import Ctx, _capture_three, _eager_impl, time_graphs
from .workload import (
    Inputs,
    _poison_recv,
    _received_a2ad,
    dispatch_bytes_per_token,
    expert_owner_tensor,
    pack_rows,
    permute_indices,
    target_mask,
    unpack_rows,
    unpermute_sum,
)


# --- a2ad --------------------------------------------------------------------------------
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


def _api_calls(a2a, static: Inputs, T: int):
    """``(dispatch, combine)`` closures calling the public API exactly as a user does."""
    payloads = static.payloads()

    def d():
        return a2a.dispatch(static.experts, payloads, T)

    def c(recv):
        return a2a.combine(recv[0], T)

    return d, c


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
    # MoeAlltoAll calls its plane through its front end (client/frontend.py), which keeps the
    # plane too: the recorder stands in for both references for this one round
    front = getattr(a2a, "_front", None)
    holders = [h for h in (a2a, front) if h is not None and getattr(h, "_plane", None) is real]
    ctx.barrier()
    for h in holders:
        h._plane = rec
    try:
        recv0 = a2a.dispatch(static.experts, static.payloads(), T)
        a2a.combine(recv0[0], T)
    finally:
        for h in holders:
            h._plane = real
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


# --- FlashInfer --------------------------------------------------------------------------
#: The module FlashInfer's MoeAlltoAll lives in.
FLASHINFER_MODULE = "flashinfer.comm.trtllm_moe_alltoall"


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


# --- NCCL --------------------------------------------------------------------------------
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
