"""The two sides of tests/test_moe_ep_gpu.py: a2ad's ``flashinfer.moe_ep`` communication
(a2ad.integrations.flashinfer.A2adAlltoAll) in rank processes on a real daemon, and
FlashInfer's own ``MoeAlltoAll`` with every rank in one process on one GPU, fed the same
seeded inputs and the same toy experts. Each side saves what every rank received and every
rank's combine output (CPU tensors, ``torch.save``) for the test to compare.

Both sides run the same rounds: eager rounds (:func:`eager_plan`: full, uneven, a rank with
no tokens, ``runtime_max_tokens_per_rank`` below capacity, the three ways to hand the expert
output to combine), then one CUDA graph per rank of dispatch + expert + combine, captured
once and replayed with the inputs of :data:`GRAPH_SEEDS` copied into its static buffers.
On a CPU job (the host backend; no graphs there) the static-buffer rounds run eagerly.

The expert runs on ``[ep_size, rt, ...]`` views on both sides (the same shapes, so the same
kernels compute it), from copies of the received rows taken before combine."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch

from helpers import Mapping

TOP_K = 8
NUM_EXPERTS = 64
MAX_TOKENS = 16
INVALID = -1
#: the inputs of the CUDA graph's replays, one seed per replay
GRAPH_SEEDS = (31, 32, 33)


def eager_plan(ep: int) -> list[tuple[int, list[int], int, str]]:
    """``(seed, tokens per rank, runtime_max_tokens_per_rank, combine way)`` of each eager round."""
    few = [5] + [3] * (ep - 2) + [0]  # the last rank sends nothing
    return [
        (11, [MAX_TOKENS] * ep, MAX_TOKENS, "plain"),
        (12, [MAX_TOKENS - 3 * r for r in range(ep)], MAX_TOKENS, "output"),
        (13, [1] * ep, 1, "plain"),
        (14, few, 5, "buffer"),
    ]


def graph_tokens(ep: int) -> list[int]:
    """Tokens per rank of the graph rounds (rt is MAX_TOKENS)."""
    return [MAX_TOKENS - r for r in range(ep)]


def make_inputs(seed: int, tokens: list[int], hidden: int):
    from a2ad.client import reference as ref

    return ref.make_round(seed, tokens, hidden, TOP_K, NUM_EXPERTS, torch.bfloat16)


def expert(recv: list[torch.Tensor], rank: int, ep: int) -> torch.Tensor:
    """The toy expert on ``[hidden, ids, weights]`` of shape ``[ep, rt, ...]``: ``[ep, rt, hidden]``."""
    from a2ad.client import reference as ref

    return ref.toy_expert(recv[0], recv[1], recv[2], rank, NUM_EXPERTS, ep)


def log(who: str, msg: str) -> None:
    """A progress line on stderr, at once (children inherit the test's stderr)."""
    print(f"[moe_ep {time.strftime('%H:%M:%S')} {who}] {msg}", file=sys.stderr, flush=True)


def start_child(who: str, limit: float) -> None:
    """First thing in a child: say where it runs, and dump every thread's stack shortly before
    the parent's time limit (then a hang shows where it is, even inside a C call)."""
    env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "A2AD_EXT_DIR", "FLASHINFER_WORKSPACE_BASE")}
    log(who, f"started, pid {os.getpid()}, {env}")
    faulthandler.dump_traceback_later(max(1.0, limit - 5.0), exit=False, file=sys.stderr)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------
# a2ad: one rank process of the moe_ep communication
# ---------------------------------------------------------------------------
def a2ad_rank(rank: int, ep: int, backend: str, runtime_dir: str, pg_file: str, hidden: int, out_dir: str,
              limit: float = 300.0):
    """One rank of ``A2adAlltoAll`` (cuda backend: on cuda:0, whatever the rank) through the
    eager rounds and the graph rounds; saves ``a2ad-<rank>.pt``; returns the job name."""
    from integration_cases import init_group

    from a2ad.integrations import flashinfer as fi

    who = f"a2ad rank {rank}"
    start_child(who, limit)
    init_group(rank, ep, pg_file)
    log(who, "process group joined")
    cuda = backend == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        from a2ad.client import _ext

        t0 = time.monotonic()
        _ext.load()
        log(who, f"CUDA up, a2ad extension loaded in {time.monotonic() - t0:.1f} s")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    comm = fi.A2adAlltoAll(
        fi.BootstrapConfig(world_size=ep, rank=rank, device=0 if cuda else None),
        fi.MoEEpCommParams(num_experts=NUM_EXPERTS, top_k=TOP_K, max_tokens_per_rank=MAX_TOKENS, hidden_size=hidden,
                           invalid_expert_id=INVALID),
        fi.A2adConfig(runtime_dir=runtime_dir, timeout=30.0),
    )
    log(who, f"joined job {comm.job} on {comm.device}")
    try:
        assert comm.device.type == dev.type, f"the job's workspace is on {comm.device}, expected {dev.type}"
        eager = []
        for n, (seed, tokens, rt, how) in enumerate(eager_plan(ep)):
            mine = make_inputs(seed, tokens, hidden)[rank]
            x, ids, w = (t.to(dev) for t in (mine.hidden, mine.experts, mine.scales))
            res = comm.dispatch(x, ids, w, max_tokens_per_rank=rt)
            assert res.tokens_per_rank == rt and tuple(res.hidden_states.shape) == (ep * rt, hidden), \
                (res.tokens_per_rank, tuple(res.hidden_states.shape))
            saved = [t.view(ep, rt, -1).clone() for t in (res.hidden_states, res.topk_ids, res.topk_weights)]
            y = expert(saved, rank, ep)
            if how == "buffer":  # the expert output written into the backend's combine buffer
                buf = comm.get_combine_input_buffer(torch.bfloat16)
                buf.copy_(y.flatten(0, 1))
                out = comm.combine(buf)
            elif how == "output":
                dest = torch.full((tokens[rank], hidden), 7.0, dtype=torch.bfloat16, device=dev)
                out = comm.combine(y.flatten(0, 1), output=dest)
                assert out.data_ptr() == dest.data_ptr(), "combine(output=) did not return output"
            else:
                out = comm.combine(y)
            log(who, f"eager round {n} ({how}) issued")
            _sync(dev)
            eager.append({"recv": [t.cpu() for t in saved], "out": out.cpu()})
            log(who, f"eager round {n} done")

        tokens, rt = graph_tokens(ep), MAX_TOKENS
        first = make_inputs(GRAPH_SEEDS[0], tokens, hidden)[rank]
        s_in = [t.to(dev).clone() for t in (first.hidden, first.experts, first.scales)]
        s_out = torch.zeros(tokens[rank], hidden, dtype=torch.bfloat16, device=dev)

        def step():
            res = comm.dispatch(s_in[0], s_in[1], s_in[2], max_tokens_per_rank=rt)
            kept = [t.view(ep, rt, -1).clone() for t in (res.hidden_states, res.topk_ids, res.topk_weights)]
            comm.combine(expert(kept, rank, ep).flatten(0, 1), output=s_out)
            return kept

        if cuda:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                kept = step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            _sync(dev)
            log(who, "graph captured")
        graphed = []
        for n, seed in enumerate(GRAPH_SEEDS):
            mine = make_inputs(seed, tokens, hidden)[rank]
            for s, t in zip(s_in, (mine.hidden, mine.experts, mine.scales)):
                s.copy_(t)
            if cuda:
                graph.replay()
            else:
                kept = step()
            _sync(dev)
            graphed.append({"recv": [t.cpu() for t in kept], "out": s_out.cpu().clone()})
            log(who, f"graph round {n} done")
        torch.save({"eager": eager, "graph": graphed, "job": comm.job}, Path(out_dir) / f"a2ad-{rank}.pt")
        log(who, "finished")
        return comm.job
    finally:
        _sync(dev)
        comm.destroy()


# ---------------------------------------------------------------------------
# FlashInfer: every rank of its MoeAlltoAll in this process, one workspace on cuda:0
# ---------------------------------------------------------------------------
def flashinfer_alltoalls(fim, ep: int, hidden: int, dev: torch.device):
    """``ep`` instances of FlashInfer's ``MoeAlltoAll`` over one ``[ep, size_per_rank]``
    workspace on ``dev``. Across processes ``MoeAlltoAll`` allocates that workspace with
    ``MnnvlMemory`` and caches it per (size, rank, ep, capacity, EPLB, backend); here the
    one tensor is put in that cache for every rank (as FlashInfer's functional tests share
    one tensor between ranks), each row initialized by ``moe_a2a_initialize``."""
    from types import SimpleNamespace

    size = int(fim.MoeAlltoAll.get_moe_workspace_size_per_rank(ep, TOP_K, MAX_TOKENS, hidden))
    ws = torch.zeros(ep, size, dtype=torch.uint8, device=dev)
    out = []
    for r in range(ep):
        meta = fim.moe_a2a_initialize(ws, r, ep, MAX_TOKENS)
        key = (size, r, ep, MAX_TOKENS, 0, "trtllm")
        fim.MoeAlltoAll._WORKSPACE_CACHE[key] = {
            "workspace_size_per_rank": size, "max_num_tokens": MAX_TOKENS, "ep_rank": r, "ep_size": ep,
            "eplb_stats_num_experts": 0, "mnnvl_mem": SimpleNamespace(mapped=True), "workspace": ws,
            "metainfo": meta,
        }
    _sync(dev)
    for r in range(ep):
        a2a = fim.MoeAlltoAll(Mapping(r, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, workspace_size_per_rank=size)
        if a2a.workspace.data_ptr() != ws.data_ptr():
            raise AssertionError("FlashInfer's MoeAlltoAll did not take the workspace from its cache "
                                 "(its cache key changed in this version?)")
        out.append(a2a)
    return out, ws


def _warm_up(dev: torch.device, ep: int, hidden: int) -> None:
    """Every torch kernel the rounds launch between FlashInfer's kernels, once, while none of
    those is in flight (so none is first launched while a dispatch waits for its peers)."""
    for rt in sorted({rt for _, _, rt, _ in eager_plan(ep)} | {MAX_TOKENS}):
        recv = [torch.zeros(ep, rt, hidden, dtype=torch.bfloat16, device=dev),
                torch.zeros(ep, rt, TOP_K, dtype=torch.int32, device=dev),
                torch.zeros(ep, rt, TOP_K, dtype=torch.float32, device=dev)]
        y = expert([t.clone() for t in recv], 0, ep)
        torch.full((rt, hidden), 7.0, dtype=torch.bfloat16, device=dev).copy_(y[0])
        y.cpu()
    _sync(dev)


def flashinfer_ranks(_rank: int, ep: int, hidden: int, out_dir: str, device: str = "cuda", limit: float = 300.0):
    """Every rank of FlashInfer's ``MoeAlltoAll`` in this process, each on its own CUDA stream,
    through the same eager and graph rounds as :func:`a2ad_rank`; saves ``flashinfer.pt``."""
    who = "FlashInfer"
    start_child(who, limit)
    # FlashInfer's kernels wait for their peers' kernels on the other streams of this process. With
    # CUDA's lazy loading, the first launch of any kernel (FlashInfer's sanitize, the experts'
    # torch kernels) may wait for the context to go idle while a dispatch waits for a peer whose
    # launch comes later: a deadlock. Every module is loaded when the context is created instead
    # (this process has no context yet).
    log(who, f"CUDA initialized before setting CUDA_MODULE_LOADING=EAGER: {torch.cuda.is_initialized()}")
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    from flashinfer.comm import trtllm_moe_alltoall as fim

    log(who, f"imported {fim.__file__}")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    t0 = time.monotonic()
    a2as, ws = flashinfer_alltoalls(fim, ep, hidden, dev)
    log(who, f"{ep} MoeAlltoAll instances on one [{ep}, {ws.shape[1]}] workspace on {dev} "
             f"({time.monotonic() - t0:.1f} s with the context's creation)")
    _warm_up(dev, ep, hidden)
    log(who, "the experts' torch kernels ran once")
    streams = [torch.cuda.Stream(dev) if cuda else None for _ in range(ep)]
    main = torch.cuda.current_stream(dev) if cuda else None
    record: dict = {"eager": [], "graph": []}
    try:

        def fork():
            for s in streams:
                if s is not None:
                    s.wait_stream(main)

        def join():
            for s in streams:
                if s is not None:
                    main.wait_stream(s)
            _sync(dev)

        def dispatch(r, payloads, rt):
            # the calls NVLinkOneSidedAlltoAll makes: hidden, ids, weights; ids sanitized
            return a2as[r].dispatch(payloads[1], payloads, rt, invalid_token_expert_id=INVALID,
                                    expert_id_payload_index=1)

        for n, (seed, tokens, rt, how) in enumerate(eager_plan(ep)):
            inputs = make_inputs(seed, tokens, hidden)
            payloads = [[i.hidden.to(dev), i.experts.to(dev), i.scales.to(dev)] for i in inputs]
            fork()
            recv, saved, outs = {}, {}, {}
            for r in range(ep):
                with _on(streams[r]):
                    recv[r] = dispatch(r, payloads[r], rt)
            for r in range(ep):
                with _on(streams[r]):
                    saved[r] = [t.clone() for t in recv[r]]
                    y = expert(saved[r], r, ep)
                    if how == "buffer":
                        buf = a2as[r].get_combine_payload_tensor_in_workspace(rt, hidden, torch.bfloat16)
                        buf.copy_(y)
                        outs[r] = a2as[r].combine(buf, rt, payload_in_workspace=True)
                    elif how == "output":
                        dest = torch.full((tokens[r], hidden), 7.0, dtype=torch.bfloat16, device=dev)
                        outs[r] = a2as[r].combine(y, rt, output=dest)
                        assert outs[r].data_ptr() == dest.data_ptr(), "combine(output=) did not return output"
                    else:
                        outs[r] = a2as[r].combine(y, rt)
            log(who, f"eager round {n} ({how}) issued")
            join()
            record["eager"].append({r: {"recv": [t.cpu() for t in saved[r]], "out": outs[r].cpu()} for r in range(ep)})
            log(who, f"eager round {n} done")

        tokens, rt = graph_tokens(ep), MAX_TOKENS
        first = make_inputs(GRAPH_SEEDS[0], tokens, hidden)
        s_in = [[t.to(dev).clone() for t in (i.hidden, i.experts, i.scales)] for i in first]
        s_out = [torch.zeros(tokens[r], hidden, dtype=torch.bfloat16, device=dev) for r in range(ep)]
        views: dict = {}
        kept: dict = {}

        def dispatch_half(r):
            views[r] = dispatch(r, s_in[r], rt)

        def combine_half(r):
            kept[r] = [t.clone() for t in views[r]]
            a2as[r].combine(expert(kept[r], r, ep), rt, output=s_out[r])

        graphs = []
        if cuda:
            fork()
            for r in range(ep):  # capturing runs nothing: each rank's graph is captured whole
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=streams[r]):
                    dispatch_half(r)
                    combine_half(r)
                graphs.append(g)
            join()
            log(who, f"{ep} graphs captured")
        for n, seed in enumerate(GRAPH_SEEDS):
            inputs = make_inputs(seed, tokens, hidden)
            for r in range(ep):
                for s, t in zip(s_in[r], (inputs[r].hidden, inputs[r].experts, inputs[r].scales)):
                    s.copy_(t)
            _sync(dev)
            fork()
            if cuda:
                for r in range(ep):
                    with _on(streams[r]):
                        graphs[r].replay()
            else:  # no graphs on the CPU: every rank dispatches before any combines
                for r in range(ep):
                    dispatch_half(r)
                for r in range(ep):
                    combine_half(r)
            join()
            record["graph"].append({r: {"recv": [t.cpu() for t in kept[r]], "out": s_out[r].cpu().clone()}
                                    for r in range(ep)})
            log(who, f"graph round {n} done")
        torch.save(record, Path(out_dir) / "flashinfer.pt")
        log(who, "finished")
        return len(record["eager"]) + len(record["graph"])
    finally:
        _sync(dev)
        fim.MoeAlltoAll._WORKSPACE_CACHE.clear()
