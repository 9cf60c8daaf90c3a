"""Rank functions and a process runner for the serving-engine integration tests.

Each rank is a real spawned process: it joins a gloo process group (the group the
integrations agree on job names through), builds the integration under test against a
real daemon, and checks every round against the one-process reference
(``a2ad.client.reference``). :func:`run_group` runs them, allows named ranks to die (the
kill -9 scenarios), and kills whatever still runs when it returns or fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback

HIDDEN = 16
TOP_K = 2
INVALID = -1


def _child(fn, rank, args, q):
    try:
        q.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # everything goes to the parent
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_group(fn, ep: int, args=(), timeout: float = 180.0, may_die=()):
    """Run ``fn(rank, *args)`` in ``ep`` spawned processes; return {rank: result} of the ranks
    that reported. A rank in ``may_die`` may end without reporting; any other such rank, an
    error, or ``timeout`` fails (AssertionError with the tracebacks). Every process still
    alive at the end is killed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {r: ctx.Process(target=_child, args=(fn, r, args, q), daemon=True) for r in range(ep)}
    results, failures, gone = {}, {}, {}
    try:
        for p in procs.values():
            p.start()
        end = time.monotonic() + timeout
        while len(results) + len(failures) + len(gone) < ep:
            if time.monotonic() > end:
                missing = sorted(set(procs) - set(results) - set(failures) - set(gone))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s")
            try:
                rank, status, value = q.get(timeout=0.25)
            except queue_mod.Empty:
                now = time.monotonic()
                for r, p in procs.items():
                    if r in results or r in failures or r in gone or p.is_alive():
                        continue
                    gone.setdefault(r, now)
                continue
            (results if status == "ok" else failures)[rank] = value
            gone.pop(rank, None)
    finally:
        for p in procs.values():
            if p.pid is not None:
                p.join(timeout=3 if not failures else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        q.close()
        q.cancel_join_thread()
    unexpected = {r for r in gone if r not in may_die}
    msgs = [f"rank {r}: {v}" for r, v in sorted(failures.items())]
    msgs += [f"rank {r}: exited with {procs[r].exitcode} without reporting" for r in sorted(unexpected)]
    if msgs:
        raise AssertionError(f"{len(msgs)} rank(s) failed:\n" + "\n".join(msgs))
    return results


def init_group(rank: int, ep: int, pg_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=ep)


def reference_round(seed: int, ep: int, num_experts: int, max_tokens: int, tokens=None, dead=()):
    """Every rank's inputs of one round, what each receives and each one's combine (dead ranks:
    no tokens, and their experts contribute nothing)."""
    import torch

    from a2ad.client import reference as ref

    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(1, max_tokens + 1, (ep,), generator=g).tolist()
    tokens = [0 if r in dead else n for r, n in enumerate(tokens)]
    rt = max(1, max(tokens))
    inputs = ref.make_round(seed, tokens, HIDDEN, TOP_K, num_experts, torch.bfloat16)
    payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, num_experts, rt, INVALID, 1)
    outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, num_experts, ep)
               for q, r in enumerate(received)]
    active = [r for r in range(ep) if r not in dead] if dead else None
    combined = ref.combine(routings, outputs, active)
    return rt, inputs, received, combined


def check_received(rank, what, got, expected):
    """Received payloads (``[ep, rt, ...]`` each): valid rows as sets, empty slots' ids sanitized."""
    from a2ad.client import reference as ref

    problems = ref.dispatch_mismatches(got, expected.recv_counts, expected)
    assert not problems, f"rank {rank} {what}: " + "; ".join(problems)
    for s, n in enumerate(expected.recv_counts.tolist()):
        assert bool((got[1][s, n:] == INVALID).all()), f"rank {rank} {what}: slots >= {n} from {s} not sanitized"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.002):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def die_now(stamp_file: str) -> None:
    """Write the wall-clock time, then kill -9 this process."""
    with open(stamp_file + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(stamp_file + ".tmp", stamp_file)
    os.kill(os.getpid(), signal.SIGKILL)


def all_reached(stamp_file: str, rank: int, ranks, step: str, timeout: float = 60.0) -> None:
    """A barrier of the ranks ``ranks`` (the survivors of a kill, whom the job's process group
    cannot gather any more): this rank says it reached ``step``, then waits until every one of
    them has (files beside ``stamp_file``), bounded by ``timeout``."""
    open(f"{stamp_file}.{step}.{rank}", "w").close()
    wait_until(lambda: all(os.path.exists(f"{stamp_file}.{step}.{q}") for q in ranks), timeout,
               f"ranks {sorted(ranks)} to reach {step!r}", 0.005)


def killed_at(stamp_file: str, timeout: float = 30.0) -> float:
    wait_until(lambda: os.path.exists(stamp_file), timeout, f"the victim's stamp {stamp_file}", 0.001)
    with open(stamp_file) as f:
        return float(f.read())


# --------------------------------------------------------------------------- flashinfer moe_ep
def _fi_comm(rank, ep, runtime_dir, max_tokens, num_experts, **cfg):
    from a2ad.integrations import flashinfer as fi

    return fi.A2adAlltoAll(
        fi.BootstrapConfig(world_size=ep, rank=rank),
        fi.MoEEpCommParams(num_experts=num_experts, top_k=TOP_K, max_tokens_per_rank=max_tokens, hidden_size=HIDDEN,
                           invalid_expert_id=INVALID),
        fi.A2adConfig(runtime_dir=runtime_dir, timeout=20.0, **cfg),
    )


def _fi_round(comm, rank, ep, seed, num_experts, max_tokens, how, tokens=None, dead=()):
    import torch

    from a2ad.client import reference as ref

    rt, inputs, received, combined = reference_round(seed, ep, num_experts, max_tokens, tokens, dead)
    mine = inputs[rank]
    res = comm.dispatch(mine.hidden, mine.experts, mine.scales, max_tokens_per_rank=rt)
    assert res.tokens_per_rank == rt and res.hidden_states.shape == (ep * rt, HIDDEN)
    got = [res.hidden_states.view(ep, rt, -1), res.topk_ids.view(ep, rt, -1), res.topk_weights.view(ep, rt, -1)]
    check_received(rank, f"round {seed}", [t.clone() for t in got], received[rank])
    y = ref.toy_expert(got[0], got[1], got[2], rank, num_experts, ep).flatten(0, 1)
    if how == "buffer":  # the expert output written into the backend's combine buffer
        buf = comm.get_combine_input_buffer(torch.bfloat16)
        buf.copy_(y)
        out = comm.combine(buf)
    elif how == "output":
        dest = torch.full((mine.experts.shape[0], HIDDEN), 7.0, dtype=torch.bfloat16)
        out = comm.combine(y, output=dest)
        assert out.data_ptr() == dest.data_ptr(), "combine(output=) did not return output"
    else:
        out = comm.combine(y.view(ep, rt, HIDDEN))
    want = combined[rank]
    assert out.dtype == want.dtype and torch.equal(out, want), f"rank {rank} round {seed} ({how}): combine differs"
    return rt


def fi_rounds_and_rebuild(rank, ep, runtime_dir, pg_file, num_experts, rounds):
    """Rounds through A2adAlltoAll (three combine ways), then a rebuild with twice the
    capacity: the job name changes, the old job is released, larger rounds run."""
    from a2ad.client.connection import DaemonClient

    init_group(rank, ep, pg_file)
    comm = _fi_comm(rank, ep, runtime_dir, 4, num_experts)
    first = comm.job
    assert first.startswith("fi-") and f"-{ep}x4-" in first, first
    for rnd in range(rounds):
        _fi_round(comm, rank, ep, 100 + rnd, num_experts, 4, ("plain", "output", "buffer")[rnd % 3])
    mask = comm.rank_mask()
    assert mask.dtype.is_floating_point is False and mask.tolist() == [0] * ep and not bool(comm.fault())
    import torch.distributed as dist

    dist.barrier()
    comm.destroy()
    comm.destroy()  # idempotent
    dist.barrier()
    with DaemonClient(runtime_dir) as c:
        wait_until(lambda: first not in [j["name"] for j in c.request("jobs")["jobs"]], 10, f"job {first} released", 0.05)
    bigger = _fi_comm(rank, ep, runtime_dir, 8, num_experts)
    try:
        assert bigger.job != first and f"-{ep}x8-" in bigger.job, (first, bigger.job)
        for rnd in range(rounds):
            _fi_round(bigger, rank, ep, 200 + rnd, num_experts, 8, ("plain", "output", "buffer")[rnd % 3],
                      tokens=[8 - (r % 3) for r in range(ep)])
        names = dist.get_world_size()
        return (first, bigger.job, names)
    finally:
        bigger.destroy()


def fi_kill9(rank, ep, runtime_dir, pg_file, num_experts, policy, stamp):
    """Rounds among every rank, then the last rank is killed with SIGKILL: the survivors see
    it in rank_mask()/fault() within 1 s, and under "degrade" keep serving among themselves,
    under "raise" get PeerLost from the next dispatch (no hang)."""
    from a2ad import errors

    init_group(rank, ep, pg_file)
    victim = ep - 1
    comm = _fi_comm(rank, ep, runtime_dir, 4, num_experts, on_peer_loss=policy)
    try:
        for rnd in range(2):
            _fi_round(comm, rank, ep, 300 + rnd, num_experts, 4, "plain")
        import torch.distributed as dist

        dist.barrier()
        if rank == victim:
            die_now(stamp)
        t0 = killed_at(stamp)
        wait_until(lambda: int(comm.rank_mask()[victim]) == 1, 5.0, f"rank {victim} masked")
        seen = time.time() - t0
        assert bool(comm.fault()), "fault() is False after a rank was killed"
        mask = comm.rank_mask().tolist()
        assert mask == [1 if r == victim else 0 for r in range(ep)], mask
        if policy == "degrade":
            for rnd in range(3):
                _fi_round(comm, rank, ep, 400 + rnd, num_experts, 4, ("plain", "output", "buffer")[rnd],
                          dead=(victim,))
            comm.clean()  # the baseline now holds the loss: no new fault
            assert not bool(comm.fault()), "fault() stays True after clean()"
            # no survivor leaves (its destroy below clears its bit: a new fault, rightly) before
            # every survivor has made the check above
            all_reached(stamp, rank, [r for r in range(ep) if r != victim], "checked fault()")
        else:
            from a2ad.client import reference as ref

            import torch

            inputs = ref.make_round(500, [2] * ep, HIDDEN, TOP_K, num_experts, torch.bfloat16)
            try:
                comm.dispatch(inputs[rank].hidden, inputs[rank].experts, inputs[rank].scales, max_tokens_per_rank=2)
            except (errors.PeerLost, errors.PeerTimeout) as exc:
                assert isinstance(exc, errors.PeerLost), exc
            else:
                raise AssertionError("dispatch after a peer's loss under 'raise' did not raise PeerLost")
        return seen
    finally:
        comm.destroy()


# ---------------------------------------------------------------------------
# DeepEP low-latency rounds (the engines' DeepEP LL paths on a2ad.deep_ep)
# ---------------------------------------------------------------------------
def ll_round(seed: int, ep: int, num_experts: int, num_max: int, hidden: int, topk: int, tokens=None, dead=()):
    """Every rank's (x bf16 [T, hidden], topk_idx int64 [T, topk], weights float32 [T, topk]) of
    one DeepEP LL round, with small integer values and half-integer weights (every sum exact
    in bfloat16), about a sixth of the ids -1; dead ranks have no tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(1, num_max + 1, (ep,), generator=g).tolist()
    out = []
    for r in range(ep):
        t = 0 if r in dead else tokens[r]
        idx = torch.rand(t, num_experts, generator=g).argsort(dim=1)[:, :topk].to(torch.int64)
        idx[torch.rand(t, topk, generator=g) < 1 / 6] = -1
        x = torch.randint(-4, 5, (t, hidden), generator=g).to(torch.bfloat16)
        w = torch.randint(1, 5, (t, topk), generator=g).float() * 0.5
        out.append((x, idx, w))
    return out


def ll_factor(e: int) -> int:
    """The toy expert e: x * (1 + e % 3)."""
    return 1 + e % 3


def ll_expert_outputs(recv_x, recv_count, rank: int, num_experts: int, ep: int):
    """The toy experts on DeepEP's expert-major batch ([L, R * num_max, hidden], bf16 or float):
    valid rows times their expert's factor, the rest zero."""
    import torch

    lx = num_experts // ep
    f = torch.tensor([ll_factor(rank * lx + le) for le in range(lx)], dtype=torch.float32).view(lx, 1, 1)
    valid = torch.arange(recv_x.shape[1]).view(1, -1, 1) < recv_count.view(lx, 1, 1).to(torch.int64)
    return torch.where(valid, recv_x.float() * f, 0.0).to(torch.bfloat16)


def ll_expected_combine(inputs, rank: int, num_experts: int, ep: int, dead=()):
    """bf16 [T, hidden]: sum over k of w * factor(e) * x (experts of dead ranks count nothing)."""
    import torch

    x, idx, w = inputs[rank]
    lx = num_experts // ep
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0 and e // lx not in dead:
                acc[t] += w[t, k] * ll_factor(e) * x[t].float()
    return acc.to(torch.bfloat16)


def ll_check_received(rank: int, what: str, inputs, recv_x, recv_count, num_experts: int, ep: int, dead=()):
    """Each local expert's valid rows (as a multiset, DeepEP's order being free) and count
    against every source's tokens naming it."""
    import torch

    lx = num_experts // ep
    assert tuple(recv_count.shape) == (lx,), (what, recv_count.shape)
    for le in range(lx):
        e = rank * lx + le
        want = [x[t] for s, (x, idx, _) in enumerate(inputs) if s not in dead
                for t in (idx == e).any(1).nonzero().flatten().tolist()]
        n = int(recv_count[le])
        assert n == len(want), f"rank {rank} {what}: expert {e} received {n} rows, want {len(want)}"
        if n:
            got = sorted(tuple(r) for r in recv_x[le, :n].float().tolist())
            exp = sorted(tuple(r) for r in torch.stack(want).float().tolist())
            assert got == exp, f"rank {rank} {what}: expert {e}'s rows differ from its sources' tokens"


def ll_dequant(x, scale):
    """DeepEP's LL FP8 batch ([L, N, H] e4m3, float32 scales [L, N, H / 128]) as float32; bf16
    (``scale`` None) as float32."""
    if scale is None:
        return x.float()
    lx, n, h = x.shape
    return (x.float().view(lx, n, h // 128, 128) * scale.float().unsqueeze(3)).view(lx, n, h)


def ll_fp8_inputs(inputs):
    """The round's inputs with each token as DeepEP's FP8 dispatch delivers it (per-128-channel
    e4m3 with amax / 448 scales, dequantized), for checking what an expert received."""
    from a2ad.deep_ep import quantize_fp8

    out = []
    for x, idx, w in inputs:
        if x.shape[0]:
            q, s = quantize_fp8(x, False)
            x = ll_dequant(q.unsqueeze(0), s.unsqueeze(0))[0]
        out.append((x.float(), idx, w))
    return out


def ll_check_combine(rank: int, what: str, got, inputs, num_experts: int, ep: int, fp8: bool, dead=()):
    """The combine output against the reference: exact for bf16 dispatch; for FP8 within e4m3's
    error (3 mantissa bits: 1/16 relative) of the sum of magnitudes, plus bf16's rounding."""
    import torch

    want = ll_expected_combine(inputs, rank, num_experts, ep, dead)
    assert got.shape == want.shape and got.dtype == torch.bfloat16, (what, got.shape, got.dtype)
    if not fp8:
        assert torch.equal(got, want), f"rank {rank} {what}: combine differs from the reference"
        return
    mag = ll_expected_combine([(x.abs(), i, w.abs()) for x, i, w in inputs], rank, num_experts, ep, dead)
    bound = 0.07 * mag.float() + 1e-2
    assert bool(((got.float() - want.float()).abs() <= bound).all()), \
        f"rank {rank} {what}: FP8 combine beyond FP8's error"
