"""Timing of the CUDA kernels alone and of their diagnostics, no daemon:
``python -m a2ad.bench.kernel_timing`` (2 GPUs, one process).

Ranks 0 and 1 run on cuda:0 and cuda:1 over a VMM workspace mapped on both (as the daemon
does), each rank's dispatch and combine in its own CUDA graph; replays are queued behind a
GPU sleep and L2 is flushed before each round (as in a2ad-bench). Per round the slowest
rank's interval counts; medians and p10-p90 over the rounds.

``--low-precision`` adds, at every T, a row of the FP8 combine (``low_precision=True``: e4m3
rows and their scales pulled, fp32 accumulation, bf16 out) beside the bf16 one, and the ratio
of their combine times.

``--one-gpu`` puts both ranks on cuda:0 instead (one device buffer holds both rows, each rank
gets a third of the SMs, as the kernel tests do): no NVLink, so it shows what a change
costs or saves on the GPU itself (launches, atomics, fences, kernel boundaries), not the
figures a2ad-bench reports. ``--ep N`` runs N ranks instead of two (N GPUs, or all on cuda:0
with ``--one-gpu``, each with 1/(N+1) of the SMs).

The diagnostics (``CudaPlane.diag``, the ``DIAG_*`` bits of a2ad.client.cuda_plane) take
parts of dispatch away to show what each part costs. They exist only in the timing build
of the extension, which this harness asks for (``A2AD_KERNEL_TIMING=1`` before the
extension is first loaded); ``--production`` with ``--no-diags`` times the production build
instead, the kernels as a2ad ships them (the line naming the job says which build ran). One
line per configuration as it goes, then a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import sys
from types import SimpleNamespace

import torch

from a2ad import layout as L
from a2ad.control import ControlBlock

TIMING_ENV = "A2AD_KERNEL_TIMING"


def sleep_cycles_per_us(devices: list[int]) -> float:
    """GPU sleep cycles per us (to queue replays behind a known delay), measured on the first
    of ``devices``. The sleep kernel runs once on each first: its first launch loads it, and
    that time would count as sleep (every later sleep would then be too short to cover the
    queueing)."""
    for d in devices:
        with torch.cuda.device(d):
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
    with torch.cuda.device(devices[0]):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(4_000_000)
        b.record()
        b.synchronize()
        return 4_000_000 / max(a.elapsed_time(b) * 1e3, 1.0)


class TwoGpuJob:
    """One job of ``ep`` ranks (two by default), rank r on cuda:r (all on cuda:0 with
    ``one_gpu``), each with its stream, CudaPlane and L2 flush buffer."""

    def __init__(self, max_tokens: int, top_k: int, num_experts: int, hidden: int, timeout: float = 2.0,
                 one_gpu: bool = False, ep: int = 2, degrade: bool = False):
        from a2ad import cuda_driver as cd
        from a2ad.client.cuda_map import CudaMapping
        from a2ad.client.cuda_plane import CudaPlane, initialize_row, sm_count

        if ep < 2:
            raise ValueError(f"ep must be at least 2, got {ep}")
        self.ep_size, self.top_k, self.num_experts, self.hidden = ep, top_k, num_experts, hidden
        self.one_gpu = one_gpu
        self.low_precision = False  # the FP8 combine (rows labelled "fp8 combine")
        self.devs = [0] * ep if one_gpu else list(range(ep))
        self.widths = [2 * hidden, 4 * top_k, 4 * top_k]  # bf16 hidden, int32 ids, fp32 scales (as the bench)
        self.aux = L.aux_layout(ep, max_tokens)
        self.size = L.workspace_size_per_rank(ep, max_tokens, sum(self.widths), 2 * hidden)
        self.handles, self.maps = [], []
        budget = 0
        if one_gpu:
            # one buffer, row q at q * row_stride (as the kernel tests); the SMs split so that
            # every rank's grid is resident together (combine sizes its grid to be co-resident)
            self.row_stride = L.pad_up(L.row_bytes_with_tail(self.size), 1 << 16)
            self._buf = torch.zeros(ep * self.row_stride, dtype=torch.uint8, device="cuda:0")
            self.ws = [self._buf.as_strided((ep, self.size), (self.row_stride, 1))] * ep
            budget = max(1, sm_count() // (ep + 1))
        else:
            gran = max(cd.granularity(d) for d in range(ep))
            self.row_stride = L.pad_up(L.row_bytes_with_tail(self.size), gran)
            fds = []
            for d in range(ep):
                h, _ = cd.create(self.row_stride, d, cd.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                self.handles.append(h)
                fds.append(cd.export_fd(h))
            for r in range(ep):  # every rank maps every row on its own device, as attach does
                dups = [os.dup(f) for f in fds]
                self.maps.append(CudaMapping(dups, self.size, self.row_stride, r))
                for f in dups:
                    os.close(f)
            for f in fds:
                os.close(f)
            self.ws = [m.tensor for m in self.maps]
        # rows with a lines tail, as the daemon's CUDA backend allocates them (zeroed below)
        self.lines_tail = L.lines_tail_offset(self.size, self.row_stride)
        self._mm = mmap.mmap(-1, L.CONTROL_BLOCK_SIZE)
        self.control = ControlBlock(self._mm, owner=self._mm)
        # a degrade job's dispatch runs its one-block prologue first (the round's view)
        self.control.initialize(ep, L.POLICY_DEGRADE if degrade else L.POLICY_RAISE)
        self.streams, self.flush, self.planes = [], [], []
        for r in range(ep):
            d = self.devs[r]
            with torch.cuda.device(d):
                self.streams.append(torch.cuda.Stream())
                if one_gpu and r > 0:  # one L2, flushed from rank 0's stream only (see time())
                    self.flush.append(self.flush[0])
                else:
                    l2 = int(getattr(torch.cuda.get_device_properties(d), "L2_cache_size", 0) or (50 << 20))
                    self.flush.append(torch.empty(2 * l2, dtype=torch.uint8, device=f"cuda:{d}"))
                att = SimpleNamespace(
                    job="timing", ep_rank=r, ep_size=ep,
                    spec={"max_num_tokens": max_tokens, "top_k": top_k, "num_experts": num_experts,
                          "on_peer_loss": "degrade" if degrade else "raise"},
                    backend="cuda", device=torch.device("cuda", d), workspace=self.ws[r],
                    size_per_rank=self.size, row_stride=self.row_stride, aux=self.aux, lines_tail=self.lines_tail,
                    control=self.control, generation=0,
                )
                self.planes.append(CudaPlane(att, timeout, sm_budget=budget))
                initialize_row(self.ws[r], r, self.aux, lines_tail=self.lines_tail)
                torch.cuda.synchronize()
        self.cycles_per_us = sleep_cycles_per_us(sorted(set(self.devs)))

    def close(self) -> None:
        from a2ad import cuda_driver as cd

        self.sync()
        for p in self.planes:
            p.close()
        self.ws = []
        for m in self.maps:
            m.close()
        for h in self.handles:
            cd.release(h)
        self.control.close()

    def inputs(self, T: int) -> None:
        """Random routing, payloads and combine inputs of T tokens per rank."""
        self.T = T
        self.pl = L.payload_layout(self.aux, self.size, T, self.widths, 2 * self.hidden)
        self.experts, self.payloads, self.comb = [], [], []
        for r in range(self.ep_size):
            dev = f"cuda:{self.devs[r]}"
            e = torch.rand(T, self.num_experts, device=dev).argsort(dim=1)[:, : self.top_k].to(torch.int32).contiguous()
            x = torch.randn(T, self.hidden, device=dev).bfloat16()
            sc = torch.rand(T, self.top_k, device=dev)
            self.experts.append(e)
            self.payloads.append([x.view(torch.uint8), e.view(torch.uint8), sc.view(torch.uint8)])
            self.comb.append(torch.randn(self.ep_size, T, self.hidden, device=dev).bfloat16())
        self.sync()

    def d(self, r: int) -> None:
        self.planes[r].dispatch(self.experts[r], self.payloads[r], self.T, self.pl, self.num_experts)

    def c(self, r: int):
        return self.planes[r].combine(self.comb[r], self.T, self.T, self.pl, False, low_precision=self.low_precision)

    def on(self, r: int) -> contextlib.ExitStack:
        """Rank r's device and stream current."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.devs[r]))
        stack.enter_context(torch.cuda.stream(self.streams[r]))
        return stack

    def sync(self) -> None:
        for d in sorted(set(self.devs)):
            torch.cuda.synchronize(d)

    def eager_round(self) -> None:
        for fn in (self.d, self.c):
            for r in range(self.ep_size):
                with self.on(r):
                    fn(r)
        self.sync()

    def time(self, diag: int, rounds: int = 200, chunks: int = 3, flush: bool = True) -> dict:
        """Dispatch and combine of the current inputs with the diagnostic bits ``diag`` (0: the
        kernels as they serve), ``chunks`` x ``rounds`` graph replays; medians and p10/p90 in us."""
        for p in self.planes:
            p.diag = diag
        for _ in range(3):
            self.eager_round()
        for p in self.planes:
            p.check()
        graphs_d, graphs_c = [], []
        for r in range(self.ep_size):
            with torch.cuda.device(self.devs[r]):
                # A capture stream of this device: torch.cuda.graph's default capture stream is
                # one per process, made on the device current at its first use, so capturing on
                # cuda:1 with it would leave the graph empty and run rank 1's kernels eagerly
                # (alone: its dispatch then waits for a peer that is not running; seen on 2xH200).
                cap = torch.cuda.Stream()
                g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(g1, stream=cap, capture_error_mode="thread_local"):
                    self.d(r)
                with torch.cuda.graph(g2, stream=cap, capture_error_mode="thread_local"):
                    self.c(r)
                graphs_d.append(g1)
                graphs_c.append(g2)
        self.sync()
        ds, cs, starved = [], [], False
        for _ in range(chunks):
            done = []
            for r in range(self.ep_size):
                with self.on(r):
                    torch.cuda._sleep(int((5000 + 400 * rounds) * self.cycles_per_us))
                    ev = torch.cuda.Event()
                    ev.record()
                    done.append(ev)
            marks = [[] for _ in range(self.ep_size)]
            for _i in range(rounds):
                flushed = None
                if flush and self.one_gpu:
                    # one L2: flushed once, and every rank starts after it (two flushes side by
                    # side on one GPU end far apart, and a rank's dispatch would wait out the skew)
                    with self.on(0):
                        self.flush[0].zero_()
                        flushed = torch.cuda.Event()
                        flushed.record()
                for r in range(self.ep_size):
                    with self.on(r):
                        if flushed is not None:
                            self.streams[r].wait_event(flushed)
                        elif flush:
                            self.flush[r].zero_()
                        m = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                        m[0].record()
                        graphs_d[r].replay()
                        m[1].record()
                        graphs_c[r].replay()
                        m[2].record()
                        marks[r].append(m)
            starved = starved or any(ev.query() for ev in done)
            self.sync()
            for i in range(rounds):
                ds.append(max(marks[r][i][0].elapsed_time(marks[r][i][1]) for r in range(self.ep_size)) * 1e3)
                cs.append(max(marks[r][i][1].elapsed_time(marks[r][i][2]) for r in range(self.ep_size)) * 1e3)
        for p in self.planes:
            p.check()
            p.diag = 0
        for _ in range(2):  # leave the job in a clean round state for the next entry
            self.eager_round()
        q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
        return {"d": q(ds, 0.5), "c": q(cs, 0.5), "d10": q(ds, 0.1), "d90": q(ds, 0.9), "c10": q(cs, 0.1),
                "c90": q(cs, 0.9), "starved": starved}


    def time_back_to_back(self, rounds_per_graph: int = 25, replays: int = 8, chunks: int = 12) -> dict:
        """The steady-state time of one round (a dispatch and a combine on every rank) of the
        current inputs: each rank's graph holds ``rounds_per_graph`` rounds back to back, every
        rank replays its graph ``replays`` times from one start event, and the span from that
        event to the last rank's end, divided by the rounds, is one sample (``chunks`` of them;
        medians and p10/p90 in us). No L2 flush and no per-round start skew: where the per-round
        figures of :meth:`time` spread over several us (many ranks on one GPU start their
        replays far apart), this resolves a change of a fraction of a us in the round."""
        for p in self.planes:
            p.diag = 0
        for _ in range(3):
            self.eager_round()
        for p in self.planes:
            p.check()
        graphs = []
        for r in range(self.ep_size):
            with torch.cuda.device(self.devs[r]):
                cap = torch.cuda.Stream()  # a capture stream of this device (see time())
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=cap, capture_error_mode="thread_local"):
                    for _ in range(rounds_per_graph):
                        self.d(r)
                        self.c(r)
                graphs.append(g)
        self.sync()
        per_round, starved = [], False
        rounds = rounds_per_graph * replays
        for _ in range(chunks + 1):  # the first chunk warms up and is not counted
            with self.on(0):
                torch.cuda._sleep(int((2000 + 50 * self.ep_size * replays) * self.cycles_per_us))
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            ends = []
            for r in range(self.ep_size):
                with self.on(r):
                    self.streams[r].wait_event(start)
                    for _i in range(replays):
                        graphs[r].replay()
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    ends.append(e)
            starved = starved or start.query()
            self.sync()
            per_round.append(max(start.elapsed_time(e) for e in ends) * 1e3 / rounds)
        per_round = per_round[1:]
        for p in self.planes:
            p.check()
        for _ in range(2):
            self.eager_round()
        q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
        return {"round": q(per_round, 0.5), "r10": q(per_round, 0.1), "r90": q(per_round, 0.9), "starved": starved}


FP8_LABEL = "fp8 combine (low_precision)"


def plan(cp, tokens: list[int] | None = None, diags: bool = True, low_precision: bool = False
         ) -> list[tuple[str, int, int]]:
    """``(label, T, diag)`` per configuration, in the order they run (``cp``: a2ad.client.cuda_plane):
    the diagnostics at every T of ``tokens`` (default: T=1), then the kernels as they serve at
    T=4096. Without ``diags``, the kernels as they serve at each T only. With
    ``low_precision``, each "default" row is followed by the FP8 combine at its T."""
    rows = plan_bf16(cp, tokens, diags)
    if not low_precision:
        return rows
    out = []
    for row in rows:
        out.append(row)
        if row[0] == "default":
            out.append((FP8_LABEL, row[1], 0))
    return out


def plan_bf16(cp, tokens: list[int] | None = None, diags: bool = True) -> list[tuple[str, int, int]]:
    rows = []
    for T in tokens or [1]:
        if not diags:
            rows.append(("default", T, 0))
            continue
        rows += [
            ("default", T, 0),
            ("diag no-op dispatch kernel (launch floor)", T, cp.DIAG_NOOP),
            ("diag routing only (no copy, fence, publish)", T, cp.DIAG_SKIP_COPY | cp.DIAG_SKIP_FENCE | cp.DIAG_NO_PUBLISH),
            ("diag routing + fence (no copy, publish)", T, cp.DIAG_SKIP_COPY | cp.DIAG_NO_PUBLISH),
            ("diag local work only (no publish, no wait)", T, cp.DIAG_NO_PUBLISH),
            ("diag publish, no wait", T, cp.DIAG_NO_WAIT),
            ("diag one fence more (a fence's cost, added)", T, cp.DIAG_DOUBLE_FENCE),
            ("diag no descriptor comparison after the wait", T, cp.DIAG_NO_SPEC_CHECK),
            ("diag ready words released at gpu scope", T, cp.DIAG_GPU_SCOPE_PUBLISH),
            ("default again (noise)", T, 0),
        ]
    return rows + [("default", 4096, 0)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2ad.bench.kernel_timing",
        description="Time the a2ad CUDA kernels and their diagnostics on two GPUs in one process (no daemon): "
                    "CUDA-graph replays, L2 flushed before each round, slowest rank per round.",
    )
    p.add_argument("--hidden", type=int, default=7168, help="hidden size, bf16 (default 7168)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--no-l2-flush", action="store_true", help="do not overwrite 2 x L2 before every round")
    p.add_argument("--tokens", default="1",
                   help="comma-separated T (each at most 4096) at which the diagnostics run (default 1)")
    p.add_argument("--no-diags", action="store_true", help="only the kernels as they serve, at each T of --tokens")
    p.add_argument("--low-precision", action="store_true",
                   help="also time the FP8 combine (low_precision=True) at each T, beside the bf16 combine")
    p.add_argument("--one-gpu", action="store_true",
                   help="every rank on cuda:0, 1/(ep+1) of the SMs each (no NVLink: the on-GPU costs only)")
    p.add_argument("--back-to-back", action="store_true",
                   help="instead of per-round figures: the steady-state time of one whole round (dispatch and "
                        "combine on every rank), many rounds per graph, no L2 flush, at each T of --tokens")
    p.add_argument("--ep", type=int, default=2,
                   help="ranks in the job (default 2): one GPU each, or all on cuda:0 with --one-gpu")
    p.add_argument("--production", action="store_true",
                   help="time the production build (the kernels a2ad ships, no diagnostics compiled in) instead "
                        "of the timing build; only with --no-diags or --back-to-back")
    p.add_argument("--degrade", action="store_true",
                   help="a job of on_peer_loss='degrade' (its dispatch runs a one-block prologue first)")
    return p


def print_job_line(args) -> None:
    """The line under the figures that names the job they are of."""
    where = "all on cuda:0 (--one-gpu)" if args.one_gpu else f"on cuda:0 .. cuda:{args.ep - 1}"
    policy = ", on_peer_loss='degrade'" if args.degrade else ""
    build = "production" if args.production else "timing"
    print(f"\nhidden {args.hidden}, top_k {args.top_k}, {args.num_experts} experts, {args.ep} ranks {where}{policy}, "
          f"{build} build")


def back_to_back(job: TwoGpuJob, tokens: list[int], args) -> int:
    """``--back-to-back``: one line per T as it goes, then a markdown table."""
    rows = []
    try:
        for T in tokens:
            job.inputs(T)
            job.low_precision = False
            r = job.time_back_to_back()
            rows.append((T, r))
            print(f"back-to-back round T={T:<5} {r['round']:8.2f} us ({r['r10']:.2f}-{r['r90']:.2f})"
                  + ("  STARVED" if r["starved"] else ""), flush=True)
    finally:
        job.close()
    print_job_line(args)
    print("\n| T | round (dispatch + combine, every rank) us | p10-p90 |")
    print("| --: | --: | --: |")
    for T, r in rows:
        print(f"| {T} | {r['round']:.2f} | {r['r10']:.2f}-{r['r90']:.2f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--tokens: comma-separated integers, got {args.tokens!r}")
    if not tokens or any(not 1 <= t <= 4096 for t in tokens):
        parser.error(f"--tokens: each T in [1, 4096], got {args.tokens!r}")
    if args.production and not (args.no_diags or args.back_to_back):
        parser.error("--production: the production build has no diagnostics; add --no-diags (or --back-to-back)")
    # the diagnostics exist only in the timing build: ask for the build wanted before the
    # extension is first loaded (the production build: what a2ad ships)
    os.environ[TIMING_ENV] = "0" if args.production else "1"
    from .common import ensure_client_package

    why = ensure_client_package()
    if why:
        print(why, file=sys.stderr)
        return 2
    from a2ad.client import cuda_plane as cp

    if not 2 <= args.ep <= L.MAX_EP_SIZE:
        parser.error(f"--ep: in [2, {L.MAX_EP_SIZE}], got {args.ep}")
    if torch.cuda.device_count() < (1 if args.one_gpu else args.ep):
        print(f"timing needs {args.ep} GPUs (or --one-gpu and 1)")
        return 1
    flush = not args.no_l2_flush
    # The ranks' kernels are queued from this one thread, rank after rank, and each waits for
    # the others': a garbage collection between two ranks' launches whose finalizer frees
    # device memory would synchronize the device on kernels waiting for ranks not queued yet
    # (until the job's timeout). So the collector runs once now and is off for the run.
    gc.collect()
    gc.disable()
    job = TwoGpuJob(4096, args.top_k, args.num_experts, args.hidden, one_gpu=args.one_gpu, ep=args.ep,
                     degrade=args.degrade)
    if args.back_to_back:
        return back_to_back(job, tokens, args)
    rows, cur_T = [], None
    try:
        for label, T, dg in plan(cp, tokens, diags=not args.no_diags, low_precision=args.low_precision):
            if T != cur_T:
                job.inputs(T)
                cur_T = T
            job.low_precision = label == FP8_LABEL
            try:
                # 600 rounds in chunks of 50 behind one sleep each (200 at once filled the
                # launch queue while the GPU slept: the CPU blocked and the GPU then waited for it)
                r = job.time(dg, rounds=50, chunks=12, flush=flush) if T < 4096 else job.time(dg, rounds=40, flush=flush)
            except Exception as exc:  # keep going: print what failed
                print(f"{label} T={T}: {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append((label, T, dg, r))
            print(f"{label:<46} T={T:<5} diag={dg:<2} flush={int(flush)}  dispatch {r['d']:8.2f} us "
                  f"({r['d10']:.2f}-{r['d90']:.2f})  combine {r['c']:8.2f} us ({r['c10']:.2f}-{r['c90']:.2f})"
                  + ("  STARVED" if r["starved"] else ""), flush=True)
    finally:
        job.close()
    print_job_line(args)
    print("\n| stage | T | diag | L2 flush | dispatch us (p10-p90) | combine us (p10-p90) |")
    print("| --- | --: | --: | --: | --: | --: |")
    for label, T, dg, r in rows:
        print(f"| {label} | {T} | {dg} | {'yes' if flush else 'no'} | {r['d']:.2f} ({r['d10']:.2f}-{r['d90']:.2f}) | "
              f"{r['c']:.2f} ({r['c10']:.2f}-{r['c90']:.2f}) |", flush=True)
    if args.low_precision:
        bf16 = {T: r["c"] for label, T, _, r in rows if label == "default"}
        print("\n| T | bf16 combine us | fp8 combine us | fp8 / bf16 |")
        print("| --: | --: | --: | --: |")
        for label, T, _, r in rows:
            if label == FP8_LABEL and T in bf16:
                print(f"| {T} | {bf16[T]:.2f} | {r['c']:.2f} | {r['c'] / bf16[T]:.3f} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
