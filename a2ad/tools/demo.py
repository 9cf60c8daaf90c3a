"""``a2ad demo``: a daemon plus a group of client processes doing real dispatch and combine.

The demo starts a daemon (``a2ad serve`` as a child process, through
:mod:`a2ad.tools.launcher`; its log in a temp folder removed afterwards) unless
``--runtime-dir`` names a folder where one is already running, then spawns ``--ranks`` client
processes. Each joins one job through :class:`a2ad.client.MoeAlltoAll` and runs
``--rounds`` rounds of: seeded random routing, dispatch (bf16 hidden states, int32
expert ids, float32 scales), a deterministic toy expert computation on what it
received (``reference.toy_expert``), and combine. Every rank checks every round
against the single-process reference (``a2ad.client.reference``): what it
received, per source, and what combine returned. The parent prints one line per
round (the slowest rank's times) as soon as every rank reported it, and a summary,
and exits non-zero on any mismatch or failure. On the host backend the parent imports no
torch (only the ranks do).

With the cuda backend rank r runs on GPU ``r % device_count``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from a2ad import layout as L
from a2ad.errors import A2ADError

INVALID_ID = -1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="client processes, one per expert-parallel rank (default 4)")
    parser.add_argument("--rounds", type=int, default=20, help="dispatch/combine rounds (default 20)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="most tokens a rank has in a round; each round draws [tokens/2, tokens] per rank (default 128)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token (default 4, at most 22)")
    parser.add_argument("--experts", type=int, default=16, help="experts in the model (default 16)")
    parser.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto",
                        help="workspace memory: cuda when a GPU is visible with auto (default auto)")
    parser.add_argument("--runtime-dir", help="use the daemon running there (else start one, there or in a temp folder)")
    parser.add_argument("--seed", type=int, default=0, help="routing and data seed (default 0)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the rendezvous and every wait (default 60)")


@dataclass(frozen=True)
class _Config:
    runtime_dir: str
    job: str
    ranks: int
    rounds: int
    tokens: int
    hidden: int
    top_k: int
    experts: int
    seed: int
    timeout: float
    backend: str  # the daemon's: host or cuda


def _check_args(args) -> str | None:
    if not 1 <= args.ranks <= L.MAX_EP_SIZE:
        return f"--ranks must be in [1, {L.MAX_EP_SIZE}]"
    if args.rounds < 1 or args.tokens < 1 or args.hidden < 1:
        return "--rounds, --tokens and --hidden must be >= 1"
    if not 1 <= args.top_k <= L.MAX_TOP_K:
        return f"--top-k must be in [1, {L.MAX_TOP_K}]"
    if args.experts < args.ranks:
        return "--experts must be >= --ranks (every rank owns at least one expert)"
    if not args.timeout > 0:
        return "--timeout must be > 0"
    return None


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------
def _round_plan(cfg: _Config, rnd: int) -> tuple[int, list[int], int]:
    """(seed, tokens of every rank, runtime_max_tokens_per_rank) of round ``rnd``; the same in every process.

    Plain Python (no torch): the parent, which imports no torch on the host backend, prints a
    round's row as soon as every rank reported it, instead of stalling at the first row on a
    torch import while the ranks run on."""
    seed = cfg.seed * 1_000_003 + rnd
    rng = random.Random(seed)
    tokens = [rng.randint(cfg.tokens // 2, cfg.tokens) for _ in range(cfg.ranks)]
    return seed, tokens, max(1, max(tokens))


def _rank_main(rank: int, cfg: _Config, results, barrier) -> None:
    try:
        _rank_rounds(rank, cfg, results, barrier)
    except BaseException as exc:
        results.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _rank_rounds(rank: int, cfg: _Config, results, barrier) -> None:
    """Every round: the reference (untimed), a barrier, then timed dispatch / expert / combine,
    with a copy of what arrived taken between dispatch and combine (afterwards peers may
    already write the next round there), checked once the round is over."""
    import torch

    from a2ad.client import reference as ref
    from a2ad.client.moe_alltoall import MoeAlltoAll

    results.put(("stage", rank, "imported"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.ranks))
    if cfg.backend == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    class Mapping:
        moe_ep_rank = rank
        moe_ep_size = cfg.ranks

    tol = 0.0 if cfg.backend == "host" else 2e-2  # the host plane sums in the reference's order
    with MoeAlltoAll(
        Mapping(),
        cfg.tokens,
        cfg.top_k,
        cfg.experts,
        hidden_size=cfg.hidden,
        job=cfg.job,
        runtime_dir=cfg.runtime_dir,
        device=device if device.type == "cuda" else None,
        timeout=cfg.timeout,
    ) as a2a:
        results.put(("stage", rank, "attached"))
        recv_off = int(a2a.metainfo[L.RECV_COUNTERS_OFFSET_INDEX])
        for rnd in range(cfg.rounds):
            seed, tokens, rt = _round_plan(cfg, rnd)
            inputs = ref.make_round(seed, tokens, cfg.hidden, cfg.top_k, cfg.experts)
            payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
            mine = [p.to(device) for p in payloads[rank]]

            routings, received = ref.dispatch([i.experts for i in inputs], payloads, cfg.experts, rt, INVALID_ID, 1)
            outputs = [
                ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, cfg.experts, cfg.ranks)
                for q, r in enumerate(received)
            ]
            want = ref.combine(routings, outputs)[rank]

            barrier.wait(cfg.timeout)  # so that the times below are not one rank waiting for a slower one's checks
            t0 = time.perf_counter()
            got = a2a.dispatch(mine[1], mine, rt, INVALID_ID, 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            # what arrived, and RECV_COUNTERS, are only stable until this rank's combine
            arrived = [g.clone() for g in got]
            counts = a2a.workspace[rank, recv_off : recv_off + 4 * cfg.ranks].clone()
            t2 = time.perf_counter()
            expert_out = ref.toy_expert(got[0], got[1], got[2], rank, cfg.experts, cfg.ranks)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t3 = time.perf_counter()
            out = a2a.combine(expert_out, rt)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t4 = time.perf_counter()

            problems = ref.dispatch_mismatches(arrived, counts.cpu().view(torch.int32), received[rank])
            out = out.cpu()
            if tol == 0.0:
                ok = torch.equal(out, want)
            else:
                ok = torch.allclose(out.float(), want.float(), rtol=tol, atol=tol)
            if not ok:
                diff = (out.float() - want.float()).abs().max().item() if out.shape == want.shape else float("nan")
                problems.append(f"combine differs from the reference (max abs diff {diff:.3g})")
            sent = int(routings[rank].send_counts.sum())
            results.put(("round", rank, (rnd, t1 - t0, t3 - t2, t4 - t3, sent, problems)))
    results.put(("done", rank, None))


# ---------------------------------------------------------------------------
# The daemon
# ---------------------------------------------------------------------------
def _running_daemon(runtime_dir: str | None) -> dict | None:
    if runtime_dir is None:
        return None
    from a2ad.connection import ping
    from a2ad.errors import DaemonUnavailable

    try:
        return ping(runtime_dir, timeout=1.0)
    except DaemonUnavailable:
        return None


# ---------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f}"


def run(args) -> int:
    problem = _check_args(args)
    if problem:
        print(f"a2ad demo: {problem}", file=sys.stderr)
        return 2
    daemon = None
    made_dir = None
    hello = _running_daemon(args.runtime_dir)
    try:
        if hello is not None:
            runtime_dir = Path(args.runtime_dir)
            where = f"using the daemon running on {runtime_dir}"
            if args.backend != "auto" and hello.get("backend") != args.backend:
                print(f"a2ad demo: the daemon on {runtime_dir} runs the {hello.get('backend')} backend, "
                      f"not {args.backend}", file=sys.stderr)
                return 2
        else:
            if args.runtime_dir:
                runtime_dir = Path(args.runtime_dir)
            else:
                made_dir = runtime_dir = Path(tempfile.mkdtemp(prefix="a2ad-demo-"))
            from a2ad.tools.launcher import DaemonLauncher

            print(f"a2ad demo: starting a daemon on {runtime_dir} ...", flush=True)
            daemon = DaemonLauncher(runtime_dir, "--backend", args.backend, "--grace", "1")
            hello = daemon.start(30.0).hello  # LaunchError (a RuntimeError) carries the log's tail
            where = f"started a daemon (pid {daemon.pid}) on {runtime_dir}"
        cfg = _Config(
            runtime_dir=str(runtime_dir),
            job=f"demo-{os.getpid()}-{int(time.time())}",
            ranks=args.ranks,
            rounds=args.rounds,
            tokens=args.tokens,
            hidden=args.hidden,
            top_k=args.top_k,
            experts=args.experts,
            seed=args.seed,
            timeout=args.timeout,
            backend=hello.get("backend", "host"),
        )
        print(f"a2ad demo: {cfg.ranks} ranks, {cfg.rounds} rounds, up to {cfg.tokens} tokens per rank, "
              f"hidden {cfg.hidden}, top_k {cfg.top_k}, {cfg.experts} experts, backend {cfg.backend}")
        print(f"a2ad demo: {where}")
        if cfg.backend == "cuda":
            import torch

            if not torch.cuda.is_available():
                print("a2ad demo: the daemon runs the cuda backend but this process sees no GPU", file=sys.stderr)
                return 2
            from a2ad.client import _ext

            print(f"a2ad demo: loading the CUDA extension; ranks on {torch.cuda.device_count()} GPU(s)", flush=True)
            _ext.load()
        return _run_ranks(cfg)
    except RuntimeError as exc:
        print(f"a2ad demo: {exc}", file=sys.stderr)
        return 1
    except A2ADError as exc:  # e.g. a runtime folder the client does not trust
        print(f"a2ad demo: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        if daemon is not None:
            daemon.stop()
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)


#: Seconds of silence while the ranks start after which the demo says how far they got.
PROGRESS_EVERY = 5.0


def _run_ranks(cfg: _Config) -> int:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(cfg.ranks)
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, results, barrier), daemon=True) for r in range(cfg.ranks)]
    print(f"a2ad demo: starting {cfg.ranks} ranks: each imports torch (a few seconds), then joins job {cfg.job} "
          "through the daemon and maps every rank's workspace ...", flush=True)
    for p in procs:
        p.start()
    stages: dict[str, set[int]] = {"imported": set(), "attached": set()}
    said = time.monotonic()
    rounds: dict[int, dict[int, tuple]] = {}
    errors_by_rank: dict[int, str] = {}
    done: set[int] = set()
    printed = 0
    bad_rounds = 0
    lines = []
    # generous: start-up (imports, rendezvous) plus every round's bounded waits
    deadline = time.monotonic() + 120.0 + cfg.timeout * 2 + cfg.rounds * (5.0 + cfg.timeout / 10)
    start = time.monotonic()
    header = f"{'round':>5} {'tokens':>7} {'rt':>5} {'dispatch ms':>12} {'expert ms':>10} {'combine ms':>11}  check"

    def starting() -> str:
        return (f"{len(stages['imported'])}/{cfg.ranks} ranks imported torch, {len(stages['attached'])}/{cfg.ranks} "
                f"attached ({time.monotonic() - start:.1f} s)")

    try:
        while len(done) + len(errors_by_rank) < cfg.ranks:
            if time.monotonic() > deadline:
                errors_by_rank.update({r: "did not finish in time" for r in range(cfg.ranks)
                                       if r not in done and r not in errors_by_rank})
                break
            if printed == 0 and time.monotonic() - said > PROGRESS_EVERY:
                print(f"a2ad demo: still starting: {starting()}", flush=True)
                said = time.monotonic()
            try:
                kind, rank, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and r not in errors_by_rank and not p.is_alive():
                        errors_by_rank[r] = f"the process exited with status {p.exitcode}"
                continue
            if kind == "stage":
                stages[value].add(rank)
                if len(stages[value]) == cfg.ranks:
                    what = ("every rank imported torch" if value == "imported" else
                            "every rank attached: rendezvous done, workspaces mapped")
                    print(f"a2ad demo: {what} ({time.monotonic() - start:.1f} s)", flush=True)
                    said = time.monotonic()
            elif kind == "done":
                done.add(rank)
            elif kind == "error":
                errors_by_rank[rank] = value
            else:
                rounds.setdefault(value[0], {})[rank] = value[1:]
                while len(rounds.get(printed, {})) == cfg.ranks:
                    if printed == 0:
                        print(header)
                    row = rounds[printed]
                    _, tokens, rt = _round_plan(cfg, printed)
                    d = max(v[0] for v in row.values())
                    e = max(v[1] for v in row.values())
                    c = max(v[2] for v in row.values())
                    problems = [f"rank {r}: {p}" for r, v in sorted(row.items()) for p in v[4]]
                    bad_rounds += bool(problems)
                    lines.append((d, c))
                    print(f"{printed + 1:>5} {sum(tokens):>7} {rt:>5} {_ms(d):>12} {_ms(e)[-10:]:>10} {_ms(c):>11}  "
                          f"{'ok' if not problems else 'MISMATCH'}", flush=True)
                    for p in problems:
                        print(f"        {p}")
                    printed += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for r, msg in sorted(errors_by_rank.items()):
        print(f"a2ad demo: rank {r} failed: {msg}", file=sys.stderr)
    total = time.monotonic() - start
    ok = not errors_by_rank and bad_rounds == 0 and printed == cfg.rounds
    if lines:
        ds = sorted(d for d, _ in lines)
        cs = sorted(c for _, c in lines)
        print(f"summary: {printed - bad_rounds}/{cfg.rounds} rounds matched the reference; "
              f"dispatch median {statistics.median(ds) * 1e3:.3f} ms (max {ds[-1] * 1e3:.3f}), "
              f"combine median {statistics.median(cs) * 1e3:.3f} ms (max {cs[-1] * 1e3:.3f}); "
              f"{total:.1f} s in all")
    else:
        print(f"summary: no round completed; {total:.1f} s in all")
    print("a2ad demo: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1
