"""FlashInfer's ``MoeAlltoAll`` kernels timed the way ``a2ad.bench.kernel_timing --one-gpu``
times a2ad's: ``python -m a2ad.bench.fi_timing`` (one GPU, one process, no daemon).

Both ranks run on cuda:0 over one ``[2, size_per_rank]`` workspace (FlashInfer's functional
ops accept any such tensor; its own tests run several ranks on one GPU this way), each rank's
dispatch and combine in its own CUDA graph on its own stream, replays queued behind a GPU
sleep, L2 flushed once before each round, the slower rank's interval counted per round:
the same loop, inputs and statistics as ``kernel_timing.TwoGpuJob.time``, so the rows of the
two harnesses compare directly when they run in one call.

FlashInfer's kernels wait for their peer inside the kernel, so both ranks' grids must be
resident at once; on one GPU that holds only at small T (a launch that cannot be co-resident
never finishes). Every configuration therefore runs first in a child process with a time
limit; one that does not finish is reported as such and skipped.

FlashInfer is imported from the Python path: ``pip install flashinfer-python==0.7.2.post1``,
or an extracted FlashInfer archive on ``PYTHONPATH`` (benchmarks/README.md says how).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading

import torch

from .kernel_timing import TwoGpuJob, sleep_cycles_per_us


class FlashInferOneGpuJob:
    """Two ranks of FlashInfer's ``MoeAlltoAll`` on cuda:0, duck-typed like ``TwoGpuJob`` so
    that ``TwoGpuJob.time`` can drive it."""

    one_gpu = True

    def __init__(self, max_tokens: int, top_k: int, num_experts: int, hidden: int, low_precision: bool = False):
        from flashinfer.comm import trtllm_moe_alltoall as fi

        self.fi = fi
        ep = 2
        self.ep_size, self.top_k, self.num_experts, self.hidden = ep, top_k, num_experts, hidden
        self.low_precision = low_precision
        self.devs = [0] * ep
        self.planes = []  # no diagnostics here (TwoGpuJob.time sets a diag bit on each plane)
        dispatch_bytes = 2 * hidden + 4 * top_k + 4 * top_k  # bf16 hidden, int32 ids, fp32 scales
        self.size = int(fi.moe_a2a_get_workspace_size_per_rank(ep, max_tokens, dispatch_bytes, 2 * hidden))
        self.workspace = torch.zeros(ep, self.size, dtype=torch.uint8, device="cuda:0")
        self.metainfo = [fi.moe_a2a_initialize(self.workspace, r, ep, max_tokens) for r in range(ep)]
        torch.cuda.synchronize()
        self.streams = [torch.cuda.Stream() for _ in range(ep)]
        l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (50 << 20))
        self.flush = [torch.empty(2 * l2, dtype=torch.uint8, device="cuda:0")] * ep
        self.cycles_per_us = sleep_cycles_per_us([0])
        self.offsets = [0] * ep

    def close(self) -> None:
        self.sync()

    def inputs(self, T: int) -> None:
        self.T = T
        self.experts, self.payloads, self.comb = [], [], []
        for _r in range(self.ep_size):
            e = torch.rand(T, self.num_experts, device="cuda:0").argsort(dim=1)[:, : self.top_k].to(torch.int32).contiguous()
            x = torch.randn(T, self.hidden, device="cuda:0").bfloat16()
            sc = torch.rand(T, self.top_k, device="cuda:0")
            self.experts.append(e)
            self.payloads.append([x, e, sc])
            self.comb.append(torch.randn(self.ep_size, T, self.hidden, device="cuda:0").bfloat16())
        self.sync()

    def d(self, r: int) -> None:
        _out, off, _stats = self.fi.moe_a2a_dispatch(
            self.experts[r], self.payloads[r], self.workspace, self.metainfo[r], self.T, r, self.ep_size,
            self.top_k, self.num_experts)
        self.offsets[r] = int(off)

    def c(self, r: int):
        return self.fi.moe_a2a_combine(
            self.comb[r], self.T, self.workspace, self.metainfo[r], self.T, r, self.ep_size, self.top_k,
            self.offsets[r], False, use_low_precision=self.low_precision)

    # rank r's stream current, synchronize, one eager round: TwoGpuJob's own (devs are all 0)
    on = TwoGpuJob.on
    sync = TwoGpuJob.sync
    eager_round = TwoGpuJob.eager_round

    def time(self, rounds: int = 50, chunks: int = 12, flush: bool = True) -> dict:
        return TwoGpuJob.time(self, 0, rounds=rounds, chunks=chunks, flush=flush)


def _one(T: int, hidden: int, top_k: int, num_experts: int, low_precision: bool, flush: bool) -> dict:
    job = FlashInferOneGpuJob(max(T, 1), top_k, num_experts, hidden, low_precision=low_precision)
    try:
        job.inputs(T)
        return job.time(rounds=50, chunks=12, flush=flush) if T < 4096 else job.time(rounds=40, chunks=3, flush=flush)
    finally:
        job.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m a2ad.bench.fi_timing",
        description="Time FlashInfer's MoeAlltoAll kernels with two ranks on one GPU, the way "
                    "'python -m a2ad.bench.kernel_timing --one-gpu' times a2ad's (needs flashinfer importable).",
    )
    p.add_argument("--hidden", default="7168", help="comma-separated hidden sizes, bf16 (default 7168)")
    p.add_argument("--tokens", default="1,8,32,128", help="comma-separated T per rank (default 1,8,32,128)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--num-experts", type=int, default=256, help="experts in all (default 256)")
    p.add_argument("--low-precision", choices=["off", "on", "both"], default="both",
                   help="combine with use_low_precision (FP8 on the wire): off, on or both (default both)")
    p.add_argument("--no-l2-flush", action="store_true", help="do not overwrite 2 x L2 before every round")
    p.add_argument("--limit", type=float, default=60.0,
                   help="seconds one configuration may take before it counts as not finishing (default 60)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def _ints(parser, name: str, text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--{name}: comma-separated integers, got {text!r}")
    if not v or any(x < 1 for x in v):
        parser.error(f"--{name}: positive integers, got {text!r}")
    return v


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        for i, c in enumerate(json.loads(args.child)):
            print(f"START {i}", flush=True)
            r = _one(c["T"], c["hidden"], args.top_k, args.num_experts, c["lp"], not args.no_l2_flush)
            print(f"RESULT {i} " + json.dumps(r), flush=True)
        return 0
    tokens = _ints(parser, "tokens", args.tokens)
    hiddens = _ints(parser, "hidden", args.hidden)
    if not torch.cuda.is_available():
        print("fi_timing needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        import flashinfer.comm.trtllm_moe_alltoall  # noqa: F401  (fail here, not in every child)
    except Exception as exc:
        print(f"fi_timing: FlashInfer is not importable ({type(exc).__name__}: {exc}); "
              "pip install flashinfer-python==0.7.2.post1, or put an extracted archive on PYTHONPATH", file=sys.stderr)
        return 2
    lps = {"off": [False], "on": [True], "both": [False, True]}[args.low_precision]
    configs = [{"T": T, "hidden": h, "lp": lp} for h in hiddens for T in tokens for lp in lps]
    results: list[dict | None] = [None] * len(configs)
    notes: list[str] = [""] * len(configs)
    start = 0
    while start < len(configs):
        # one child runs the rest in order; one that does not finish within --limit is killed
        # (a hung launch holds the GPU until its process ends) and the next child starts after it
        todo = configs[start:]
        cmd = [sys.executable, "-u", "-m", "a2ad.bench.fi_timing", "--child", json.dumps(todo), "--top-k",
               str(args.top_k), "--num-experts", str(args.num_experts)] + (["--no-l2-flush"] if args.no_l2_flush else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
        done_upto, hung = start, False
        while True:
            try:  # every configuration gets --limit seconds from the end of the one before
                ln = lines.get(timeout=args.limit)
            except queue.Empty:
                hung = True
                proc.kill()
                break
            if ln is None:
                break
            if ln.startswith("RESULT "):
                _, i, js = ln.split(" ", 2)
                results[start + int(i)] = json.loads(js)
                done_upto = start + int(i) + 1
                _report(configs[done_upto - 1], results[done_upto - 1], "")
        proc.wait()
        err = proc.stderr.read()
        if done_upto < len(configs):
            if hung:
                notes[done_upto] = f"did not finish in {args.limit:.0f} s (both ranks' grids not resident at once?)"
            else:
                tail = (err or "").strip().splitlines()[-1:] or ["?"]
                notes[done_upto] = f"failed (rc {proc.returncode}): {tail[0]}"
            _report(configs[done_upto], None, notes[done_upto])
        start = done_upto + 1
    print(f"\ntop_k {args.top_k}, {args.num_experts} experts, 2 ranks both on cuda:0, FlashInfer's kernels")
    print("\n| impl | T | hidden | dispatch us (p10-p90) | combine us (p10-p90) |")
    print("| --- | --: | --: | --: | --: |")
    for c, r, note in zip(configs, results, notes):
        if r is None:
            print(f"| {_label(c)} | {c['T']} | {c['hidden']} | {note} | |")
        else:
            print(f"| {_label(c)} | {c['T']} | {c['hidden']} | {r['d']:.2f} ({r['d10']:.2f}-{r['d90']:.2f}) | "
                  f"{r['c']:.2f} ({r['c10']:.2f}-{r['c90']:.2f}) |")
    return 0


def _label(c: dict) -> str:
    return f"flashinfer combine={'fp8' if c['lp'] else 'bf16'}"


def _report(c: dict, r: dict | None, note: str) -> None:
    head = f"{_label(c):<28} T={c['T']:<5} hidden={c['hidden']:<5}"
    if r is None:
        print(f"{head} {note}", flush=True)
    else:
        print(f"{head} dispatch {r['d']:8.2f} us ({r['d10']:.2f}-{r['d90']:.2f})  combine {r['c']:8.2f} us "
              f"({r['c10']:.2f}-{r['c90']:.2f})" + ("  STARVED" if r["starved"] else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
