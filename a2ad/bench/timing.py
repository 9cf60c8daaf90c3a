"""Timing: statistics, the rank's context (clock, L2 flush, GPU sleep, gloo collectives), CUDA-graph
replays queued behind a GPU sleep, the three graphs of an implementation and their checks, and eager
calls back to back."""

from __future__ import annotations

import math
import time

import torch

from .workload import Inputs, _poison_recv, _received_a2ad, check_combine, check_received


# --- statistics --------------------------------------------------------------------------
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


# --- the rank's context ------------------------------------------------------------------
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


# --- CUDA graphs -------------------------------------------------------------------------
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


def _capture_three(ctx: Ctx, d, c):
    """Dispatch, combine and dispatch + no-op expert + combine, each captured in its own graph."""
    ctx.barrier()
    g_d, recv_d = _capture(ctx, d)
    g_c, out_c = _capture(ctx, lambda: c(recv_d))
    g_p, (recv_p, out_p) = _capture(ctx, lambda: _pair(d, c))
    ctx.sync()
    return {"d": g_d, "c": g_c, "p": g_p, "recv_d": recv_d, "out_c": out_c, "recv_p": recv_p, "out_p": out_p}


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


# --- eager -------------------------------------------------------------------------------
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
