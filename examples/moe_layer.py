#!/usr/bin/env python3
"""An expert-parallel MoE layer on a2ad, checked against the same layer run in one process.

Every rank process holds the whole layer's weights (seeded, so identical everywhere) but
runs only its own experts: ``num_experts / ep_size`` of them, a contiguous block, the
partition a2ad routes by (``a2ad.layout.experts_of_rank``). One forward pass is:

1. router: ``softmax(x @ w_router)``, top-k experts per token, weights renormalized;
2. dispatch: hidden states, expert ids and routing weights go to the ranks that own
   those experts (a token goes once to a rank, however many of its experts live there);
3. local experts: every received token runs through each of its experts that this rank
   owns, as bf16 batched GEMMs, weighted by its routing weight; ids of other ranks'
   experts and the invalid id of empty slots are skipped;
4. combine: every token's partial outputs come back to its rank and are summed.

Each rank then runs the same layer on its tokens with no communication at all (all
experts, one process) and compares: the results must agree within bf16 tolerance.

    python3 examples/moe_layer.py                 # 2 ranks, own daemon, cuda if GPUs are visible
    python3 examples/moe_layer.py --ranks 4 --backend host
    python3 examples/moe_layer.py --runtime-dir /run/a2ad    # use a running daemon

The last line printed is ``moe_layer: OK`` or ``moe_layer: FAIL``; the exit status is
non-zero on any mismatch or error.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

from helpers.layer_args import add_arguments, check_arguments  # noqa: F401  examples/helpers/layer_args.py

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return check_arguments(parser, parser.parse_args(argv))


if __name__ == "__main__":
    ARGS = parse_args()  # before torch is imported, so that --help and a usage error answer at once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from a2ad.layout import experts_of_rank  # noqa: E402

INVALID_EXPERT_ID = -1  # what dispatch writes into the expert ids of empty slots


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------
@dataclass
class Config:
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 128
    ffn: int = 256
    max_tokens: int = 32  # the most tokens one rank passes to one forward
    seed: int = 0


class MoELayer:
    """Router plus experts (``silu(x @ w1[e]) @ w2[e]``), bf16 weights.

    ``ep_rank``/``ep_size``: this rank keeps only the weights of its own experts;
    ``ep_size=1`` keeps all of them (the single-process reference).
    """

    def __init__(self, cfg: Config, device: torch.device, ep_rank: int = 0, ep_size: int = 1):
        g = torch.Generator().manual_seed(cfg.seed)  # the same weights in every process
        E, H, F_ = cfg.num_experts, cfg.hidden, cfg.ffn
        w_router = torch.randn(H, E, generator=g) / H**0.5
        w1 = torch.randn(E, H, F_, generator=g) / H**0.5
        w2 = torch.randn(E, F_, H, generator=g) / F_**0.5
        self.cfg = cfg
        self.experts = experts_of_rank(ep_rank, E, ep_size)  # a range of expert ids
        self.w_router = w_router.to(device)  # float32: routing decisions do not flip on rounding
        self.w1 = w1[self.experts.start : self.experts.stop].to(device, torch.bfloat16)
        self.w2 = w2[self.experts.start : self.experts.stop].to(device, torch.bfloat16)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: ``[T, hidden]`` bf16 -> (expert ids ``[T, top_k]`` int32, weights ``[T, top_k]`` float32)."""
        probs = torch.softmax(x.float() @ self.w_router, dim=-1)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.to(torch.int32), weights

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Apply this rank's experts to the rows of ``x`` that selected them.

        ``x``: ``[N, hidden]`` bf16; ``ids``: ``[N, top_k]`` int32; ``weights``: ``[N, top_k]``
        float32. Ids outside this rank's experts (other ranks' experts, ``INVALID_EXPERT_ID``)
        contribute nothing. Returns ``[N, hidden]`` bf16: per row, the sum over its own
        experts e of ``weight_e * expert_e(x)``.
        """
        local = ids.long() - self.experts.start
        mine = (local >= 0) & (local < len(self.experts))
        rows, ks = mine.nonzero(as_tuple=True)  # one (row, k) pair per expert application
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if rows.numel() == 0:
            return out.to(torch.bfloat16)
        expert = local[rows, ks]
        # group the pairs by expert: each expert gets a [capacity, hidden] block, padded with zeros
        order = torch.argsort(expert, stable=True)
        rows, ks, expert = rows[order], ks[order], expert[order]
        counts = torch.bincount(expert, minlength=len(self.experts))
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(expert.numel(), device=x.device) - starts[expert]
        capacity = int(counts.max())
        blocks = torch.zeros(len(self.experts), capacity, x.shape[1], dtype=torch.bfloat16, device=x.device)
        blocks[expert, pos] = x[rows]
        # the experts, as two batched GEMMs over [num_local_experts, capacity, ...]
        y = torch.bmm(F.silu(torch.bmm(blocks, self.w1)), self.w2)
        out.index_add_(0, rows, y[expert, pos].float() * weights[rows, ks].unsqueeze(1))
        return out.to(torch.bfloat16)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer with no communication (needs all experts: ``ep_size=1``)."""
        ids, weights = self.route(x)
        return self.run_experts(x, ids, weights)


def moe_forward(a2a, layer: MoELayer, x: torch.Tensor, runtime_max_tokens: int) -> tuple[torch.Tensor, dict]:
    """The expert-parallel forward of ``x`` (``[T, hidden]`` bf16) through ``a2a`` (a MoeAlltoAll).

    Every rank calls it in the same round with the same ``runtime_max_tokens`` (at least
    every rank's T). Returns the output ``[T, hidden]`` bf16 and a few numbers for the log.
    """
    ids, weights = layer.route(x)
    # dispatch: payload 1 holds the expert ids; empty slots get INVALID_EXPERT_ID there
    recv_x, recv_ids, recv_w = a2a.dispatch(
        ids, [x, ids, weights], runtime_max_tokens,
        invalid_token_expert_id=INVALID_EXPERT_ID, expert_id_payload_index=1,
    )
    ep_size, rt, hidden = recv_x.shape
    received = int((recv_ids[:, :, 0] != INVALID_EXPERT_ID).sum())  # before combine: peers reuse it after
    expert_out = layer.run_experts(recv_x.reshape(-1, hidden), recv_ids.reshape(ep_size * rt, -1),
                                   recv_w.reshape(ep_size * rt, -1))
    out = a2a.combine(expert_out.reshape(ep_size, rt, hidden), runtime_max_tokens)
    return out, {"tokens": x.shape[0], "received": received}


def compare(out: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    """Within bf16 tolerance? Returns (ok, max abs difference relative to want's scale)."""
    scale = max(float(want.float().abs().max()), 1e-6)
    diff = float((out.float() - want.float()).abs().max()) if out.numel() else 0.0
    return diff <= 3e-2 * scale, diff / scale


# ---------------------------------------------------------------------------
# One rank (a process)
# ---------------------------------------------------------------------------
@dataclass
class RunConfig:
    layer: Config
    ranks: int
    rounds: int
    runtime_dir: str
    job: str
    backend: str  # the daemon's: "host" or "cuda"
    timeout: float


def round_plan(run: RunConfig, rnd: int) -> tuple[list[int], int]:
    """(tokens of every rank, runtime_max_tokens) of round ``rnd``: the same in every process."""
    g = torch.Generator().manual_seed(run.layer.seed * 7919 + rnd)
    tokens = torch.randint(1, run.layer.max_tokens + 1, (run.ranks,), generator=g).tolist()
    return tokens, max(tokens)


def rank_device(run: RunConfig, rank: int) -> torch.device:
    if run.backend == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def make_a2ad_alltoall(run: RunConfig, rank: int, device: torch.device):
    from a2ad.client import MoeAlltoAll

    class Mapping:  # anything with moe_ep_rank and moe_ep_size
        moe_ep_rank = rank
        moe_ep_size = run.ranks

    return MoeAlltoAll(Mapping(), run.layer.max_tokens, run.layer.top_k, run.layer.num_experts,
                       hidden_size=run.layer.hidden, job=run.job, runtime_dir=run.runtime_dir,
                       device=device if device.type == "cuda" else None, timeout=run.timeout)


def rank_main(rank: int, run: RunConfig, results, make_alltoall=make_a2ad_alltoall) -> None:
    """Run ``run.rounds`` forwards, check each, report to the parent through ``results``."""
    try:
        torch.set_num_threads(1)  # the ranks share this machine's cores
        device = rank_device(run, rank)
        layer = MoELayer(run.layer, device, rank, run.ranks)
        reference = MoELayer(run.layer, device)  # all experts
        a2a = make_alltoall(run, rank, device)
        try:
            for rnd in range(run.rounds):
                tokens, rt = round_plan(run, rnd)
                g = torch.Generator().manual_seed(run.layer.seed * 1_000_003 + rnd * 1009 + rank)
                x = torch.randn(tokens[rank], run.layer.hidden, generator=g).to(device, torch.bfloat16)
                out, stats = moe_forward(a2a, layer, x, rt)
                want = reference.forward_local(x)
                ok, rel = compare(out, want)
                results.put(("round", rank, (rnd, ok, rel, stats)))
        finally:
            if hasattr(a2a, "close"):  # FlashInfer's MoeAlltoAll has no close()
                a2a.close()
        results.put(("done", rank, None))
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(run: RunConfig, make_alltoall=make_a2ad_alltoall, name: str = "moe_layer",
              start_timeout: float = 120.0) -> bool:
    """Start one process per rank, print one line per round, return whether every round matched."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, run, results, make_alltoall), daemon=True)
             for r in range(run.ranks)]
    for p in procs:
        p.start()
    rounds: dict[int, dict[int, tuple]] = {}
    failed: dict[int, str] = {}
    done: set[int] = set()
    printed = bad = 0
    deadline = time.monotonic() + start_timeout + run.rounds * run.timeout
    try:
        while len(done) + len(failed) < run.ranks:
            if time.monotonic() > deadline:
                failed.update({r: "did not finish in time" for r in range(run.ranks) if r not in done | set(failed)})
                break
            try:
                kind, rank, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and r not in failed and not p.is_alive():
                        failed[r] = f"the process exited with status {p.exitcode}"
                continue
            if kind == "done":
                done.add(rank)
            elif kind == "error":
                failed[rank] = value
            else:
                rounds.setdefault(value[0], {})[rank] = value[1:]
                while len(rounds.get(printed, {})) == run.ranks:  # a round is complete: print it
                    row = rounds.pop(printed)
                    tokens, rt = round_plan(run, printed)
                    good = all(ok for ok, _, _ in row.values())
                    bad += not good
                    worst = max(rel for _, rel, _ in row.values())
                    per_rank = ", ".join(f"rank {r}: {s['tokens']} tokens, received {s['received']}"
                                         for r, (_, _, s) in sorted(row.items()))
                    print(f"{name}: round {printed + 1}/{run.rounds} (rt {rt}): {per_rank}; "
                          f"max rel diff vs one process {worst:.2e} -> {'ok' if good else 'MISMATCH'}", flush=True)
                    printed += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for r, msg in sorted(failed.items()):
        print(f"{name}: rank {r} failed: {msg}", file=sys.stderr)
    return not failed and bad == 0 and printed == run.rounds


# ---------------------------------------------------------------------------
# The daemon: use a running one, else start one for this run
# ---------------------------------------------------------------------------
def running_daemon(runtime_dir: str | None) -> dict | None:
    """The ``hello`` of the daemon serving ``runtime_dir``, or None."""
    if not runtime_dir:
        return None
    from a2ad.client import DaemonUnavailable, ping

    try:
        return ping(runtime_dir, timeout=1.0)
    except DaemonUnavailable:
        return None


@contextmanager
def a2ad_daemon(runtime_dir: str | None, backend: str, name: str):
    """Yield (runtime folder, backend) of a running daemon: the one on ``runtime_dir`` (or
    ``$A2AD_RUNTIME_DIR``) if it answers, else one started here and stopped on exit."""
    runtime_dir = runtime_dir or os.environ.get("A2AD_RUNTIME_DIR")
    hello = running_daemon(runtime_dir)
    if hello is not None:
        print(f"{name}: using the daemon running on {runtime_dir} (backend {hello['backend']})")
        yield runtime_dir, hello["backend"]
        return
    from a2ad.tools.launcher import DaemonLauncher

    made = tempfile.mkdtemp(prefix="a2ad-example-") if not runtime_dir else None
    daemon = DaemonLauncher(runtime_dir or made, "--backend", backend, "--grace", "1")
    try:
        hello = daemon.start(30.0).hello
        print(f"{name}: started a daemon (pid {daemon.pid}, backend {hello['backend']}) on {daemon.runtime_dir}")
        yield str(daemon.runtime_dir), hello["backend"]
    finally:
        daemon.stop()
        if made:
            shutil.rmtree(made, ignore_errors=True)
        print(f"{name}: stopped the daemon")


def default_backend() -> str:
    return "cuda" if torch.cuda.is_available() else "host"


def run_config(args, runtime_dir: str, backend: str, job: str) -> RunConfig:
    layer = Config(num_experts=args.experts, top_k=args.top_k, hidden=args.hidden, ffn=args.ffn,
                   max_tokens=args.tokens, seed=args.seed)
    return RunConfig(layer=layer, ranks=args.ranks, rounds=args.rounds, runtime_dir=runtime_dir, job=job,
                     backend=backend, timeout=args.timeout)


def main(args: argparse.Namespace | None = None) -> int:
    args = parse_args() if args is None else args
    backend = args.backend or default_backend()
    ok = False
    try:
        with a2ad_daemon(args.runtime_dir, backend, "moe_layer") as (runtime_dir, backend):
            run = run_config(args, runtime_dir, backend, job=f"moe-layer-{os.getpid()}")
            print(f"moe_layer: {run.ranks} ranks, {run.layer.num_experts} experts "
                  f"({run.layer.num_experts // run.ranks}+ per rank), top_k {run.layer.top_k}, "
                  f"hidden {run.layer.hidden}, ffn {run.layer.ffn}, backend {backend}", flush=True)
            ok = run_ranks(run)
    except Exception as exc:  # e.g. the daemon did not start (the message holds its log)
        print(f"moe_layer: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"moe_layer: {'OK' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
