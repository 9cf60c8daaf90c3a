"""The NVLink ceilings of the run: a two-way copy-engine copy GPU0<->GPU1 and an SM-driven
two-way peer store into an a2ad-mapped workspace."""

from __future__ import annotations

import torch

from .common import log
from .timing import Ctx, percentile, step_latencies, summarize
from .workload import _seed, gbps


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
