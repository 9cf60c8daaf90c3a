"""DeepEP's low-latency pair (``a2ad.deep_ep``) against a2ad's own token-major pair
(``MoeAlltoAll``) on the same tokens: ``python -m a2ad.bench.ll_timing``.

Every rank runs in this one process, all on cuda:0, over a daemon this harness starts (or
the one serving ``--runtime-dir``): per rank a ``deep_ep.Buffer`` per path of its local
steps (``ops``: torch ops; ``kernels``: the extension's kernels, ``csrc/ll.cu``) and a
``MoeAlltoAll`` of the same geometry (``max_num_tokens`` = the largest T, as DeepEP's
``num_max_dispatch_tokens_per_rank``). Both ranks on one GPU, as ``kernel_timing --one-gpu``
does: no NVLink, so the figures are the on-GPU costs (launches, kernel boundaries, copies),
and each rank's planes get 1/(ep+1) of the SMs so that every combine grid is resident.

At each T every rank's tokens are the same for both pairs: bf16 x ``[T, hidden]``, ``top_k``
distinct experts per token, float32 weights. The token-major pair sends x with the expert
ids and weights as payloads and combines the received rows (an identity expert); the
low-latency pair dispatches x and combines ``recv_x`` with the weights. Before timing, one
eager round of each is checked against what it must give (small integers: exact sums).
Timing: ``kernel_timing``'s own loop (``TwoGpuJob.time``: each rank's dispatch and combine
captured in CUDA graphs, replays queued behind a GPU sleep, L2 flushed before every round,
the slowest rank's interval per round); medians and p10-p90 in microseconds, the pair being
the sum of the two medians, one line per (T, pair) as it goes, then a markdown table with each
low-latency pair's time over the token-major pair's (below 1: the low-latency pair is faster).

Every rank being a thread of this one process, CUDA's lazy module loading is turned off
(``CUDA_MODULE_LOADING=EAGER`` unless the environment sets it): the first launch of a
kernel whose module is not loaded yet (the torch-ops path's torch kernels) can wait for
the context to go idle while another rank's a2ad kernel in the same context waits for this
rank, until that kernel's bounded wait gives up. After every checked round each job's
failure record is read (``check()``), so a wait that gave up is raised as what it was, not
reported as a wrong output.

``--dry-run`` runs the same rounds on the host backend (CPU tensors, a tiny geometry, eager
calls timed with the wall clock; meaningless as figures) to check the harness without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from .kernel_timing import TwoGpuJob, sleep_cycles_per_us

PATHS = ("ops", "kernels")


class _LocalComm:
    """The communicator a ``deep_ep.Buffer`` asks its rank and size of, for ranks that share
    this process (the job name is given, so nothing is broadcast)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def bcast(self, data, root: int = 0):
        raise RuntimeError("the harness names every job: nothing is broadcast")


def on_ranks(ep: int, fn, timeout: float = 120.0) -> list:
    """``[fn(0), ..., fn(ep - 1)]``, each rank in its own thread, all at once (collective
    steps); re-raises the first failure, and fails when a rank has not finished in time."""
    out: list = [None] * ep
    failed: list = []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            failed.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ep)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if any(th.is_alive() for th in threads):
        raise TimeoutError(f"a rank's step did not finish within {timeout:g} s")
    if failed:
        raise failed[0]
    return out


def _planes(obj) -> list:
    """The data planes under a MoeAlltoAll or a deep_ep.Buffer (to split the SMs)."""
    if hasattr(obj, "_geos"):
        objs = [obj._ctl, *(a for g in obj._geos.values() for a in g.slots)]
    else:
        objs = [obj]
    return [a._plane for a in objs if getattr(a, "_plane", None) is not None]


class Rank:
    """One rank's objects and its inputs at the current T."""

    def __init__(self, rank: int):
        self.rank = rank
        self.buffers: dict = {}  # path -> deep_ep.Buffer
        self.tm = None  # MoeAlltoAll
        self.stream = None


class Bench:
    def __init__(self, args, runtime_dir: str):
        self.args = args
        self.cuda = not args.dry_run
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.ep, self.k, self.E, self.H = args.ep, args.top_k, args.num_experts, args.hidden
        self.num_max = max(args.tokens)
        self.rd = runtime_dir
        self.ranks = [Rank(r) for r in range(self.ep)]
        self.budget = 0
        if self.cuda:
            from a2ad.client.cuda_plane import sm_count

            self.budget = max(1, sm_count(0) // (self.ep + 1))
            for rk in self.ranks:
                rk.stream = torch.cuda.Stream(self.dev)
        stamp = f"{int(time.time()) % 100000}"
        self._open(stamp)

    # --- set-up ---------------------------------------------------------------------------
    def _open(self, stamp: str) -> None:
        import a2ad.deep_ep as deep_ep
        from a2ad.client import MoeAlltoAll

        a = self.args
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(self.num_max, self.H, self.ep, self.E)
        dev = self.dev if self.cuda else None

        def make(r):
            rk = self.ranks[r]
            for path in a.paths:
                rk.buffers[path] = deep_ep.Buffer(
                    None, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True,
                    comm=_LocalComm(r, self.ep), job=f"llb-{path}-{stamp}", runtime_dir=self.rd, device=dev,
                    timeout=a.timeout, kernels=(path == "kernels") if self.cuda else None)
                # the geometry's jobs now, so that their planes get their share of the SMs before
                # any round (its first dispatch would make them and run with the whole GPU, beside
                # the other rank's doing the same)
                rk.buffers[path]._prepare_geometry(self.num_max, self.H, self.E, self.k)
            rk.tm = MoeAlltoAll(SimpleNamespace(moe_ep_rank=r, moe_ep_size=self.ep), self.num_max, self.k, self.E,
                                hidden_size=self.H, job=f"llb-tm-{stamp}", runtime_dir=self.rd, device=dev,
                                timeout=a.timeout)

        on_ranks(self.ep, make)
        self._split_sms()

    def _split_sms(self) -> None:
        """Every plane of every rank gets 1/(ep+1) of the SMs (ranks share the GPU, and each
        combine grid must be resident at once); planes made since the last call too."""
        if not self.cuda:
            return
        for rk in self.ranks:
            for obj in [*rk.buffers.values(), rk.tm]:
                for p in _planes(obj):
                    if p.sm_budget != self.budget:  # (a new budget makes a new plan)
                        p.sm_budget = self.budget

    def close(self) -> None:
        def shut(r):
            rk = self.ranks[r]
            for b in rk.buffers.values():
                b.destroy()
            if rk.tm is not None:
                rk.tm.close()

        on_ranks(self.ep, shut)

    # --- inputs and the rounds ------------------------------------------------------------
    def inputs(self, T: int, seed: int) -> None:
        """Every rank's x, topk_idx and weights at T (small integers; weights k/4)."""
        g = torch.Generator().manual_seed(seed)
        for rk in self.ranks:
            x = torch.randint(-4, 5, (T, self.H), generator=g).to(torch.bfloat16)
            idx = torch.rand(T, self.E, generator=g).argsort(dim=1)[:, : self.k]
            w = torch.randint(1, 5, (T, self.k), generator=g).float() / 4
            rk.x, rk.idx, rk.w = x.to(self.dev), idx.to(self.dev), w.to(self.dev)
            rk.ids32 = rk.idx.to(torch.int32)
            rk.payloads = [rk.x, rk.ids32, rk.w]
            lx = self.E // self.ep
            ranks = (idx // lx)
            rk.want_ll = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
            rk.want_tm = (x.float() * torch.tensor([len(set(row.tolist())) for row in ranks],
                                                   dtype=torch.float32).view(-1, 1)).to(torch.bfloat16)
        self.T = T

    def ll_dispatch(self, r: int, path: str):
        rk = self.ranks[r]
        recv_x, _, handle, _, _ = rk.buffers[path].low_latency_dispatch(rk.x, rk.idx, self.num_max, self.E,
                                                                        use_fp8=self.args.fp8)
        rk.ll = (recv_x, handle)

    def ll_combine(self, r: int, path: str):
        rk = self.ranks[r]
        recv_x, handle = rk.ll
        if self.args.fp8:
            if not hasattr(rk, "ll_y") or rk.ll_y.shape != recv_x[0].shape:
                rk.ll_y = torch.zeros(recv_x[0].shape, dtype=torch.bfloat16, device=self.dev)
            y = rk.ll_y
        else:
            y = recv_x
        rk.ll_out = rk.buffers[path].low_latency_combine(y, rk.idx, rk.w, handle)[0]
        return rk.ll_out

    def tm_dispatch(self, r: int, path=None):
        rk = self.ranks[r]
        rk.tm_recv = rk.tm.dispatch(rk.ids32, rk.payloads, self.T)

    def tm_combine(self, r: int, path=None):
        rk = self.ranks[r]
        rk.tm_out = rk.tm.combine(rk.tm_recv[0], self.T)
        return rk.tm_out

    def _ctx(self, r: int):
        import contextlib

        stack = contextlib.ExitStack()
        if self.cuda:
            stack.enter_context(torch.cuda.stream(self.ranks[r].stream))
        return stack

    def eager_round(self, pair: str, path: str | None) -> list:
        """One round of ``pair`` ("ll" or "tm") on every rank, eagerly; returns the outputs."""
        d, c = (self.ll_dispatch, self.ll_combine) if pair == "ll" else (self.tm_dispatch, self.tm_combine)

        def step_d(r):
            with self._ctx(r):
                d(r, path)

        def step_c(r):
            with self._ctx(r):
                return c(r, path)

        on_ranks(self.ep, step_d)
        outs = on_ranks(self.ep, step_c)
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        self.check_jobs()
        return [o.cpu() for o in outs]

    def check_jobs(self) -> None:
        """Raise what any job of any rank recorded (a wait that gave up inside a kernel, a
        lost peer): every deep_ep Buffer's jobs and every MoeAlltoAll."""
        for rk in self.ranks:
            for buf in rk.buffers.values():
                jobs = [buf._ctl] + [a for g in buf._geos.values() for a in g.slots]
                for job in jobs:
                    job.check()
            if rk.tm is not None:
                rk.tm.check()

    def check(self, pair: str, path: str | None) -> None:
        outs = self.eager_round(pair, path)
        if pair == "ll":  # the round ran in the job made (and given its SMs) before it
            made = [len(g.slots) for rk in self.ranks for g in rk.buffers[path]._geos.values()]
            if made != [1] * self.ep:
                raise AssertionError(f"ll {path}: the round made jobs of its own ({made} per rank and geometry)")
        for rk, out in zip(self.ranks, outs):
            if pair == "ll" and self.args.fp8:  # the FP8 round combines zeros (exact whatever FP8 did)
                want = torch.zeros_like(rk.want_ll)
            else:
                want = rk.want_ll if pair == "ll" else rk.want_tm
            if not torch.equal(out, want):
                bad = (out.float() - want.float()).abs().amax()
                raise AssertionError(f"{pair} {path or ''} T={self.T} rank {rk.rank}: the output differs from the "
                                     f"expected one by up to {float(bad)}")

    # --- timing ---------------------------------------------------------------------------
    def time_pair(self, pair: str, path: str | None) -> dict:
        """Medians and p10-p90 of the pair's dispatch and combine, in us, and the pair (their
        sum): on CUDA timed by kernel_timing's own loop (``TwoGpuJob.time``), on the host
        backend by the wall clock of eager rounds."""
        d, c = (self.ll_dispatch, self.ll_combine) if pair == "ll" else (self.tm_dispatch, self.tm_combine)
        a = self.args
        if self.cuda:
            r = _PairJob(self, lambda q: d(q, path), lambda q: c(q, path)).time(a.rounds, a.chunks, not a.no_l2_flush)
        else:
            ds, cs = [], []
            for _ in range(a.rounds):
                ds.append(max(on_ranks(self.ep, lambda q: _timed(lambda: d(q, path)))))
                cs.append(max(on_ranks(self.ep, lambda q: _timed(lambda: c(q, path)))))
            q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
            r = {"d": q(ds, 0.5), "c": q(cs, 0.5), "d10": q(ds, 0.1), "d90": q(ds, 0.9), "c10": q(cs, 0.1),
                 "c90": q(cs, 0.9), "starved": False}
        r["p"] = r["d"] + r["c"]
        return r


class _PairJob:
    """One pair on every rank of a :class:`Bench`, duck-typed like kernel_timing's
    ``TwoGpuJob`` (as fi_timing's job is) so that ``TwoGpuJob.time`` times it: each rank's
    dispatch and combine in CUDA graphs, replays behind a GPU sleep, L2 flushed before each
    round, the slowest rank per round."""

    one_gpu = True

    def __init__(self, bench: Bench, d, c):
        if not hasattr(bench, "cycles_per_us"):  # measured once per run
            bench.cycles_per_us = sleep_cycles_per_us([0])
            l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (50 << 20))
            bench.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device=bench.dev)
        self.ep_size = bench.ep
        self.devs = [0] * bench.ep
        self.streams = [rk.stream for rk in bench.ranks]
        self.flush = [bench.flush_buffer] * bench.ep
        self.cycles_per_us = bench.cycles_per_us
        self.planes = []  # no diagnostics (TwoGpuJob.time sets a diag bit on each plane)
        self.d, self.c = d, c

    # rank r's stream current, synchronize, one eager round: TwoGpuJob's own (devs are all 0)
    on = TwoGpuJob.on
    sync = TwoGpuJob.sync
    eager_round = TwoGpuJob.eager_round

    def time(self, rounds: int, chunks: int, flush: bool) -> dict:
        return TwoGpuJob.time(self, 0, rounds=rounds, chunks=chunks, flush=flush)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2ad.bench.ll_timing",
        description="DeepEP's low-latency dispatch/combine (a2ad.deep_ep) against a2ad's token-major MoeAlltoAll on "
                    "the same tokens, every rank in this process on cuda:0, CUDA-graph replays.")
    p.add_argument("--tokens", help="comma-separated T per rank (default 1,8,32,128; 1,4 with --dry-run)")
    p.add_argument("--hidden", type=int, help="hidden size, bf16 (default 7168; 256 with --dry-run)")
    p.add_argument("--top-k", type=int, help="experts per token (default 8; 4 with --dry-run)")
    p.add_argument("--num-experts", type=int, help="experts in the model (default 256; 16 with --dry-run)")
    p.add_argument("--ep", type=int, default=2, help="ranks, all on cuda:0 (default 2)")
    p.add_argument("--paths", default="kernels",
                   help="the low-latency pair's local steps to time: kernels (csrc/ll.cu, a2ad.deep_ep's default on "
                        "CUDA), ops (torch ops), or both as ops,kernels (default kernels)")
    p.add_argument("--fp8", action="store_true", help="the low-latency dispatch in FP8 (its combine stays bf16)")
    p.add_argument("--rounds", type=int, default=50, help="rounds per chunk (default 50)")
    p.add_argument("--chunks", type=int, default=8, help="chunks, each behind one GPU sleep (default 8)")
    p.add_argument("--no-l2-flush", action="store_true", help="do not overwrite 2 x L2 before every round")
    p.add_argument("--timeout", type=float, default=60.0, help="the jobs' bound on every wait, seconds (default 60)")
    p.add_argument("--runtime-dir", help="use the a2ad daemon already serving this folder (default: start one)")
    p.add_argument("--dry-run", action="store_true",
                   help="the host backend with CPU tensors and a tiny geometry (checks the harness; no figures)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dry = args.dry_run
    for name, gpu, cpu in (("tokens", "1,8,32,128", "1,4"), ("hidden", 7168, 256), ("top_k", 8, 4),
                           ("num_experts", 256, 16)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if dry else gpu)
    try:
        args.tokens = sorted({int(x) for x in args.tokens.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--tokens: comma-separated integers, got {args.tokens!r}")
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not args.paths or any(x not in PATHS for x in args.paths):
        parser.error(f"--paths: a comma-separated subset of {','.join(PATHS)}")
    if dry:
        args.rounds, args.chunks = min(args.rounds, 5), 1
        args.paths = ["ops"]  # the kernels are CUDA's
    if not args.tokens or any(t < 1 for t in args.tokens):
        parser.error("--tokens: each T at least 1")
    if not 2 <= args.ep <= 64 or args.num_experts % args.ep or not 1 <= args.top_k <= min(11, args.num_experts):
        parser.error("--ep in [2, 64], --num-experts a multiple of it, --top-k in [1, min(11, num_experts)]")
    if args.fp8 and args.hidden % 128:
        parser.error("--fp8 needs --hidden a multiple of 128")
    if args.rounds < 1 or args.chunks < 1:
        parser.error("--rounds and --chunks at least 1")
    from .common import ensure_client_package

    why = ensure_client_package()
    if why:
        print(why, file=sys.stderr)
        return 2
    if not args.dry_run:
        # before the context exists (the module docstring says why)
        if not torch.cuda.is_initialized():
            os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        if not torch.cuda.is_available():
            print("ll_timing needs a CUDA GPU (or --dry-run, on the host backend)", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory(prefix="a2ad-ll-timing-") as scratch:
        daemon = None
        rd = args.runtime_dir
        if rd is None:
            from .cli import Daemon

            rd = str(Path(scratch) / "run")
            daemon = Daemon(Path(rd), "host" if args.dry_run else "cuda", Path(scratch) / "daemon.log")
            daemon.start()
        try:
            return _run(args, rd)
        finally:
            if daemon is not None:
                daemon.stop()


def _run(args, rd: str) -> int:
    bench = Bench(args, rd)
    rows = []
    try:
        for i, T in enumerate(args.tokens):
            bench.inputs(T, 1000 + i)
            pairs = [("tm", None), *(("ll", p) for p in args.paths)]
            for pair, path in pairs:
                bench.check(pair, path)
            for pair, path in pairs:
                r = bench.time_pair(pair, path)
                label = "token-major (MoeAlltoAll)" if pair == "tm" else f"low-latency (deep_ep, {path})"
                rows.append((T, label, r))
                print(f"T={T:<4} {label:<32} dispatch {r['d']:8.2f} us ({r['d10']:.2f}-{r['d90']:.2f})  combine "
                      f"{r['c']:8.2f} us ({r['c10']:.2f}-{r['c90']:.2f})  pair {r['p']:8.2f} us"
                      + ("  STARVED" if r["starved"] else ""), flush=True)
            print(f"T={T:<4} checked: every pair's output as expected", flush=True)
    finally:
        bench.close()
    where = "host backend, CPU tensors, eager, wall clock (--dry-run: no figures)" if args.dry_run else \
        "all on cuda:0, CUDA graphs" + ("" if args.no_l2_flush else ", L2 flushed every round")
    print(f"\nhidden {args.hidden}, top_k {args.top_k}, {args.num_experts} experts, {args.ep} ranks {where}; "
          f"low-latency dispatch {'FP8' if args.fp8 else 'bf16'}, num_max {max(args.tokens)}")
    print("\n| T | pair | dispatch us (p10-p90) | combine us (p10-p90) | pair us | pair / token-major pair |")
    print("| --: | --- | --: | --: | --: | --: |")
    base = {T: r["p"] for T, label, r in rows if label.startswith("token-major")}
    for T, label, r in rows:
        print(f"| {T} | {label} | {r['d']:.2f} ({r['d10']:.2f}-{r['d90']:.2f}) | {r['c']:.2f} ({r['c10']:.2f}-"
              f"{r['c90']:.2f}) | {r['p']:.2f} | {r['p'] / base[T]:.3f} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
