"""Scenarios of the data-plane tests, each run by every rank of a job in its own process.

Every function here takes ``(rank, ...)`` and runs inside a pool process
(``_helpers_dataplane.RankPool``). Inputs are seeded, so every rank rebuilds the
whole job's inputs and checks its own results against ``a2ad.client.reference``
itself; what comes back to the test is a small summary. A scenario raises
(AssertionError with what differed) on any mismatch.

Objects that must outlive one scenario (a job used by two consecutive scenarios,
so that the parent's collection of results acts as a barrier between them) stay
in ``_OPEN`` until :func:`close_job`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from a2ad import errors, layout as L

_OPEN: dict = {}

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
INVALID_ID = -1


@dataclass(frozen=True)
class JobSpec:
    """One job: where its daemon is, its name and its shape."""

    runtime_dir: str
    name: str
    backend: str
    ep_size: int
    max_num_tokens: int
    top_k: int
    num_experts: int
    hidden: int
    extra_bytes: int = 0
    timeout: float = 60.0

    def device(self, rank: int) -> torch.device:
        if self.backend == "cuda":
            return torch.device("cuda", rank % torch.cuda.device_count())
        return torch.device("cpu")

    def open(self, rank: int):
        from a2ad.client.moe_alltoall import MoeAlltoAll

        class Mapping:
            moe_ep_rank = rank
            moe_ep_size = self.ep_size

        dev = self.device(rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        size = MoeAlltoAll.get_moe_workspace_size_per_rank(
            self.ep_size, self.top_k, self.max_num_tokens, self.hidden, self.extra_bytes
        )
        # room for a float32 combine (the default size assumes bf16)
        size += L.pad_up(self.ep_size * self.max_num_tokens * 2 * self.hidden)
        a2a = MoeAlltoAll(
            Mapping(),
            self.max_num_tokens,
            self.top_k,
            self.num_experts,
            workspace_size_per_rank=size,
            job=self.name,
            runtime_dir=self.runtime_dir,
            device=dev if dev.type == "cuda" else None,
            timeout=self.timeout,
        )
        _OPEN[self.name] = a2a
        return a2a


@dataclass(frozen=True)
class Plan:
    """What the rounds of :func:`run_rounds` look like.

    ``tokens``: tokens of each rank, the same every round (default: seeded random in
    ``[0, max_num_tokens]``). ``rt``: ``"max"`` passes max_num_tokens,
    ``"tight"`` the round's largest token count. ``experts_from``: ``(start, stop)``
    of the experts tokens pick from. ``in_workspace``: ``"no"``, ``"yes"``, or
    ``"alternate"`` (odd rounds write the expert outputs into the workspace).
    ``extra_payloads``: ``(dtype name, elements per token)`` sent after hidden, ids, scales.
    """

    seed: int = 0
    rounds: int = 2
    tokens: tuple[int, ...] | None = None
    rt: str = "tight"
    dtype: str = "bfloat16"
    experts_from: tuple[int, int] | None = None
    in_workspace: str = "alternate"
    sanitize: bool = True
    extra_payloads: tuple[tuple[str, int], ...] = ()
    noncontiguous: bool = False


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def _aux_row(a2a, rank: int) -> dict[str, torch.Tensor]:
    """This rank's aux fields (CPU copies)."""
    aux = a2a.attachment.aux
    ep, mt = a2a.ep_size, a2a.max_num_tokens
    row = a2a.workspace[rank, : aux.aux_bytes].cpu()

    def f(off, n):
        return row[off : off + 4 * n].view(torch.int32)

    return {
        "flag_val": f(aux.flag_val, 1),
        "local": f(aux.local_token_counter, 1),
        "send": f(aux.send_counters, ep),
        "recv": f(aux.recv_counters, ep),
        "target": f(aux.topk_target_ranks, mt * L.MAX_TOP_K).view(mt, L.MAX_TOP_K),
        "slot": f(aux.topk_send_indices, mt * L.MAX_TOP_K).view(mt, L.MAX_TOP_K),
    }


def _extra(seed: int, rank: int, n: int, dtype_name: str, elements: int) -> torch.Tensor:
    dt = DTYPES[dtype_name]
    size = torch.empty((), dtype=dt).element_size()
    g = torch.Generator().manual_seed(seed * 1009 + rank * 31 + elements)
    raw = torch.randint(0, 256, (n, elements * size), generator=g, dtype=torch.uint8)
    return raw.view(dt)


def _round_inputs(job: JobSpec, plan: Plan, rnd: int):
    from a2ad.client import reference as ref

    seed = plan.seed * 100_003 + rnd
    g = torch.Generator().manual_seed(seed)
    if plan.tokens is not None:
        tokens = list(plan.tokens)
    else:
        tokens = torch.randint(0, job.max_num_tokens + 1, (job.ep_size,), generator=g).tolist()
    rt = job.max_num_tokens if plan.rt == "max" else max(1, max(tokens))
    inputs = ref.make_round(
        seed,
        tokens,
        job.hidden,
        job.top_k,
        job.num_experts,
        DTYPES[plan.dtype],
        experts_from=range(*plan.experts_from) if plan.experts_from else None,
    )
    payloads = [
        [inp.hidden, inp.experts, inp.scales, *(_extra(seed, r, tokens[r], d, n) for d, n in plan.extra_payloads)]
        for r, inp in enumerate(inputs)
    ]
    return tokens, rt, inputs, payloads


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view that is not contiguous (every other column of a wider tensor)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def _check_dispatch(a2a, rank, job, plan, rt, got, expected, routing, my_payloads):
    """Everything a rank can see after dispatch, against the reference."""
    from a2ad.client import reference as ref

    aux = _aux_row(a2a, rank)
    num_tokens = routing.target.shape[0]
    assert int(aux["local"][0]) == num_tokens, f"LOCAL_TOKEN_COUNTER {int(aux['local'][0])} != {num_tokens}"
    assert torch.equal(aux["send"], routing.send_counts), f"SEND_COUNTERS {aux['send'].tolist()} != {routing.send_counts.tolist()}"
    problems = ref.dispatch_mismatches(got, aux["recv"], expected)
    assert not problems, f"rank {rank}: " + "; ".join(problems)
    for tensor, want in zip(got, expected.payloads):
        assert tensor.shape == want.shape and tensor.dtype == want.dtype, (tensor.shape, tensor.dtype, want.shape)
    if plan.sanitize:
        ids = got[1].cpu()
        for s, n in enumerate(expected.recv_counts.tolist()):
            assert bool((ids[s, n:] == INVALID_ID).all()), f"rank {rank}: slots >= {n} from source {s} not sanitized"
    k = job.top_k
    target = aux["target"][:num_tokens, :k]
    assert torch.equal(target, routing.target), f"rank {rank}: TOPK_TARGET_RANKS\n{target}\n!= reference\n{routing.target}"
    slot = aux["slot"][:num_tokens, :k]
    assert torch.equal(slot < 0, routing.slot < 0), f"rank {rank}: TOPK_SEND_INDICES marks other repeats"
    if a2a.attachment.backend == "host":  # the host plane gives slots in token order, like the reference
        assert torch.equal(slot, routing.slot), f"rank {rank}: TOPK_SEND_INDICES\n{slot}\n!= reference\n{routing.slot}"
    # any backend: the slots to each target are 0..count-1, and each holds that token's bytes there
    layout = L.payload_layout(
        a2a.attachment.aux, a2a.attachment.size_per_rank, rt, [_bytes_per_token(p) for p in my_payloads]
    )
    sends = (target >= 0).nonzero()
    for q in range(job.ep_size):
        to_q = sends[target[sends[:, 0], sends[:, 1]] == q]
        slots_q = slot[to_q[:, 0], to_q[:, 1]].sort().values
        assert torch.equal(slots_q, torch.arange(len(to_q), dtype=torch.int32)), f"rank {rank}: slots to {q}: {slots_q}"
        for i, p in enumerate(my_payloads):
            nbytes = layout.dispatch_bytes_per_token[i]
            region = a2a.workspace[q, layout.dispatch_offsets[i] : layout.dispatch_offsets[i] + job.ep_size * rt * nbytes]
            region = region.view(job.ep_size, rt, nbytes)[rank].cpu()
            mine = p.reshape(p.shape[0], math.prod(p.shape[1:])).view(torch.uint8)
            toks = to_q[:, 0]
            assert torch.equal(region[slot[toks, to_q[:, 1]].long()], mine[toks]), (
                f"rank {rank}: payload {i} at rank {q} does not hold the tokens at their slots"
            )


def _bytes_per_token(p: torch.Tensor) -> int:
    return p.element_size() * math.prod(p.shape[1:])


def _assert_combined(out: torch.Tensor, want: torch.Tensor, backend: str, what: str) -> None:
    assert out.shape == want.shape and out.dtype == want.dtype, f"{what}: {out.shape}/{out.dtype} != {want.shape}/{want.dtype}"
    out = out.cpu()
    if backend == "host":  # same float32 sums in the same order: bit-exact
        if not torch.equal(out, want):
            diff = (out.float() - want.float()).abs().max().item()
            raise AssertionError(f"{what}: combine differs from the reference (max abs diff {diff})")
    else:
        tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}[want.dtype]
        torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------
def run_rounds(rank: int, job: JobSpec, plan: Plan) -> dict:
    """``plan.rounds`` rounds of dispatch, toy expert, combine; every step checked.

    Opens the job unless this process has it open already, and leaves it open
    (:func:`close_job` closes it once every rank has returned, so no rank leaves
    while a peer is still in its last round). Returns ``{"rounds",
    "tokens_received", "dispatch_s", "combine_s"}`` for this rank.
    """
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    first_round = int(_aux_row(a2a, rank)["flag_val"][0])
    dispatch_s = combine_s = 0.0
    received_total = 0
    for rnd in range(plan.rounds):
        tokens, rt, inputs, payloads = _round_inputs(job, plan, rnd)
        invalid = (INVALID_ID, 1) if plan.sanitize else (None, None)
        routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, *invalid)
        mine = [p.to(dev) for p in payloads[rank]]
        experts = inputs[rank].experts.to(dev)
        if plan.noncontiguous:
            mine = [_noncontiguous(p) for p in mine]
            experts = _noncontiguous(experts.to(torch.int64))
        t0 = time.perf_counter()
        got = a2a.dispatch(experts, mine, rt, *invalid)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dispatch_s += time.perf_counter() - t0
        assert a2a.phase == "dispatched"
        _check_dispatch(a2a, rank, job, plan, rt, got, received[rank], routings[rank], payloads[rank])
        received_total += int(received[rank].recv_counts.sum())

        expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
        in_ws = plan.in_workspace == "yes" or (plan.in_workspace == "alternate" and rnd % 2 == 1)
        if in_ws:
            payload = a2a.get_combine_payload_tensor_in_workspace(rt, job.hidden, expert_out.dtype)
            payload.copy_(expert_out)
        else:
            payload = expert_out
        t0 = time.perf_counter()
        out = a2a.combine(payload, rt, payload_in_workspace=in_ws)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        combine_s += time.perf_counter() - t0
        assert a2a.phase == "idle"
        outputs = [
            ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
            for q, r in enumerate(received)
        ]
        _assert_combined(out, ref.combine(routings, outputs)[rank], job.backend, f"rank {rank} round {rnd}")
        flag = int(_aux_row(a2a, rank)["flag_val"][0])
        assert flag == first_round + rnd + 1, f"rank {rank}: FLAG_VAL {flag} after round {first_round + rnd}"
    return {"rounds": plan.rounds, "tokens_received": received_total, "dispatch_s": dispatch_s, "combine_s": combine_s}


def close_job(rank: int, name: str) -> bool:
    """Close this rank's MoeAlltoAll of job ``name`` (if open); a closed one refuses every call."""
    a2a = _OPEN.pop(name, None)
    if a2a is None:
        return False
    a2a.close()
    assert a2a.phase == "closed"
    _expect(errors.StateError, a2a.dispatch, None, [], 1)
    _expect(errors.StateError, a2a.combine, None, 1)
    _expect(errors.StateError, lambda: a2a.workspace)
    a2a.close()  # idempotent
    return True


def _expect(exc_type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return str(exc)
    except Exception as exc:
        raise AssertionError(f"{fn.__name__}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"{fn.__name__}{args!r:.200}: expected {exc_type.__name__}, nothing was raised")


def bad_inputs(rank: int, job: JobSpec) -> int:
    """Every bad input raises InputError/StateError, and not one byte of any row changed.

    Runs in every rank at once; the job stays open for a following :func:`run_rounds`.
    Returns the number of bad calls made.
    """
    a2a = job.open(rank)
    dev = job.device(rank)
    before = a2a.workspace.cpu().clone()  # every rank's row
    n, k, E, mt = 3, job.top_k, job.num_experts, job.max_num_tokens
    g = torch.Generator().manual_seed(rank)
    experts = torch.randint(0, E, (n, k), generator=g, dtype=torch.int32).to(dev)
    hidden = torch.randn(n, job.hidden, generator=g).to(torch.bfloat16).to(dev)
    scales = torch.rand(n, k, generator=g).to(dev)
    good = [hidden, experts, scales]
    other_dev = torch.device("meta") if dev.type == "cpu" else torch.device("cpu")
    calls = [
        # state
        (errors.StateError, a2a.combine, torch.zeros(job.ep_size, 4, job.hidden, dtype=torch.bfloat16, device=dev), 4),
        (errors.StateError, a2a.get_combine_payload_tensor_in_workspace, 4, job.hidden, torch.bfloat16),
        # expert ids (their range on the host only: on CUDA the kernel checks it without a host
        # sync, routes a bad id nowhere and reports it later; bad_expert_ids_then_rounds)
        *([
            (errors.InputError, a2a.dispatch, torch.full((n, k), E, dtype=torch.int32, device=dev), good, 4),
            (errors.InputError, a2a.dispatch, torch.full((n, k), -1, dtype=torch.int32, device=dev), good, 4),
            (errors.InputError, a2a.dispatch, torch.full((n, k), (1 << 32) + 1, dtype=torch.int64, device=dev), good, 4),
        ] if dev.type == "cpu" else []),
        (errors.InputError, a2a.dispatch, experts.float(), good, 4),
        (errors.InputError, a2a.dispatch, experts[:, :1].contiguous() if k > 1 else experts.repeat(1, 2), good, 4),
        (errors.InputError, a2a.dispatch, experts.cpu() if dev.type == "cuda" else experts.to(other_dev), good, 4),
        (errors.InputError, a2a.dispatch, experts.tolist(), good, 4),
        # runtime_max_tokens_per_rank
        (errors.InputError, a2a.dispatch, experts, good, n - 1),
        (errors.InputError, a2a.dispatch, experts, good, 0),
        (errors.InputError, a2a.dispatch, experts, good, mt + 1),
        (errors.InputError, a2a.dispatch, experts, good, True),
        (errors.InputError, a2a.dispatch, experts, good, 4.0),
        # payloads
        (errors.InputError, a2a.dispatch, experts, [hidden[:2], experts, scales], 4),
        (errors.InputError, a2a.dispatch, experts, [torch.zeros(n, 0, device=dev)], 4),
        (errors.InputError, a2a.dispatch, experts, [], 4),
        (errors.InputError, a2a.dispatch, experts, [scales] * (L.MAX_PAYLOADS + 1), 4),
        (errors.InputError, a2a.dispatch, experts, hidden, 4),
        (errors.InputError, a2a.dispatch, experts, [hidden, "ids"], 4),
        (errors.InputError, a2a.dispatch, experts, [hidden, scales.to(other_dev)], 4),
        (errors.InputError, a2a.dispatch, experts, [torch.zeros(n, 64 * job.hidden, device=dev)], mt),
        # sanitize arguments
        (errors.InputError, a2a.dispatch, experts, good, 4, -1),
        (errors.InputError, a2a.dispatch, experts, good, 4, None, 1),
        (errors.InputError, a2a.dispatch, experts, good, 4, -1, 3),
        (errors.InputError, a2a.dispatch, experts, good, 4, -1, 2),  # float32 ids
    ]
    for exc_type, fn, *args in calls:
        _expect(exc_type, fn, *args)
        assert a2a.phase == "idle", f"{a2a.phase} after a refused call"
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    after = a2a.workspace.cpu()
    changed = (after != before).nonzero()
    assert changed.numel() == 0, f"rank {rank}: refused calls changed bytes (row, offset) {changed[:5].tolist()}"
    return len(calls)


def state_errors_then_rounds(rank: int, job: JobSpec, plan: Plan) -> dict:
    """Out-of-order calls and bad combine inputs raise and leave the round usable; then rounds run.

    Follows :func:`bad_inputs` on the same open job.
    """
    from a2ad.client import reference as ref

    a2a = _OPEN[job.name]
    dev = job.device(rank)
    tokens, rt, inputs, payloads = _round_inputs(job, plan, 0)
    mine = [p.to(dev) for p in payloads[rank]]
    experts = inputs[rank].experts.to(dev)
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, INVALID_ID, 1)
    got = a2a.dispatch(experts, mine, rt, INVALID_ID, 1)
    msg = _expect(errors.StateError, a2a.dispatch, experts, mine, rt)
    assert "twice" in msg, msg
    expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
    other_rt = rt + 1 if rt < job.max_num_tokens else rt - 1
    other_dev = "cpu" if dev.type == "cuda" else "meta"
    too_wide = torch.zeros(job.ep_size, rt, 64 * job.hidden, dtype=torch.float32, device=dev)
    for args, kwargs in [
        ((expert_out, other_rt), {}),
        ((expert_out.to(torch.int32), rt), {}),
        ((expert_out[:1], rt), {}),
        ((expert_out[0], rt), {}),
        ((expert_out, rt), {"payload_in_workspace": True}),
        ((expert_out, rt), {"payload_in_workspace": 1}),
        ((too_wide, rt), {}),
        ((expert_out.to(other_dev), rt), {}),
    ]:
        _expect(errors.InputError, a2a.combine, *args, **kwargs)
        assert a2a.phase == "dispatched"
    _expect(errors.InputError, a2a.get_combine_payload_tensor_in_workspace, rt, job.hidden, torch.int32)
    _expect(errors.InputError, a2a.get_combine_payload_tensor_in_workspace, other_rt, job.hidden, torch.bfloat16)
    out = a2a.combine(expert_out, rt)
    outputs = [
        ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
        for q, r in enumerate(received)
    ]
    _assert_combined(out, ref.combine(routings, outputs)[rank], job.backend, f"rank {rank} after refused calls")
    _expect(errors.StateError, a2a.combine, expert_out, rt)
    return run_rounds(rank, job, Plan(seed=plan.seed + 1, rounds=plan.rounds))


def _dispatch_until_it_raises(a2a, dev, experts, payloads, rt) -> None:
    """Dispatch; on CUDA the kernel's wait gives up asynchronously, so the next call raises."""
    a2a.dispatch(experts, payloads, rt)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        a2a.dispatch(experts, payloads, rt)
    raise AssertionError("dispatch without its peer did not raise")


def peer_silent(rank: int, job: JobSpec, silent_for: float) -> dict:
    """Rank 1 stays attached but never dispatches: rank 0 times out naming it, and says so again."""
    a2a = job.open(rank)
    dev = job.device(rank)
    try:
        if rank != 0:
            time.sleep(silent_for)
            return {}
        experts = torch.zeros(2, job.top_k, dtype=torch.int32, device=dev)
        hidden = torch.zeros(2, job.hidden, dtype=torch.bfloat16, device=dev)
        t0 = time.monotonic()
        try:
            _dispatch_until_it_raises(a2a, dev, experts, [hidden], 2)
        except errors.PeerTimeout as exc:
            first = exc
        waited = time.monotonic() - t0
        rec = a2a.attachment.control.status(rank)
        again = _expect(errors.PeerTimeout, a2a.dispatch, experts, [hidden], 2)
        return {
            "peer": first.peer,
            "phase": first.phase,
            "round": first.round,
            "waited": waited,
            "status": (rec.code, rec.peer, rec.phase, rec.round),
            "again": again,
        }
    finally:
        close_job(rank, job.name)


def peer_dies(rank: int, job: JobSpec, die_after: float) -> dict:
    """Rank 1 ends its process while rank 0 waits in dispatch: rank 0 raises PeerLost naming it."""
    a2a = job.open(rank)
    dev = job.device(rank)
    if rank != 0:
        time.sleep(die_after)
        os._exit(0)  # no close, no leave: the daemon sees the lease socket close
    try:
        experts = torch.zeros(2, job.top_k, dtype=torch.int32, device=dev)
        hidden = torch.zeros(2, job.hidden, dtype=torch.bfloat16, device=dev)
        t0 = time.monotonic()
        try:
            _dispatch_until_it_raises(a2a, dev, experts, [hidden], 2)
        except errors.PeerLost as exc:
            lost = exc
        return {"rank": lost.rank, "waited": time.monotonic() - t0, "generation": lost.generation}
    finally:
        close_job(rank, job.name)


# ---------------------------------------------------------------------------
# The hot path: no host sync, input errors found by the kernels, CUDA graphs
# ---------------------------------------------------------------------------
def _round_of(a2a, job: JobSpec, plan: Plan, rnd: int, rank: int, dev):
    """Everything one round needs on this rank: the inputs, the reference, what to compare."""
    from a2ad.client import reference as ref

    tokens, rt, inputs, payloads = _round_inputs(job, plan, rnd)
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, INVALID_ID, 1)
    outputs = [
        ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
        for q, r in enumerate(received)
    ]
    want = ref.combine(routings, outputs)[rank]
    mine = [p.to(dev) for p in payloads[rank]]
    return rt, inputs[rank].experts.to(dev), mine, want


def sync_free_rounds(rank: int, job: JobSpec, plan: Plan) -> dict:
    """Dispatch (with sanitize), the toy expert and combine, ``plan.rounds`` times, then check(),
    all under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises. The results
    are compared with the reference afterwards."""
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    rounds = [_round_of(a2a, job, plan, rnd, rank, dev) for rnd in range(plan.rounds)]
    torch.cuda.synchronize(dev)
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rt, experts, mine, _ in rounds:
            got = a2a.dispatch(experts, mine, rt, INVALID_ID, 1)
            expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
            outs.append(a2a.combine(expert_out, rt))
            a2a.check()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(dev)
    for rnd, (out, (_, _, _, want)) in enumerate(zip(outs, rounds)):
        _assert_combined(out, want, job.backend, f"rank {rank} sync-free round {rnd}")
    a2a.check()
    return {"rounds": len(outs)}


def bad_expert_ids_then_rounds(rank: int, job: JobSpec, plan: Plan) -> dict:
    """Rank 0 passes expert ids outside [0, num_experts) in one round (every rank runs that
    round). On CUDA the kernel routes them nowhere and the round completes for every rank;
    rank 0's next call raises InputError naming the first bad token and id, the other ranks
    raise nothing. On the host rank 0's dispatch raises at once and no rank runs the round.
    Then ``plan.rounds`` rounds are exact on every rank."""
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    rt, experts, mine, _ = _round_of(a2a, job, plan, 1000, rank, dev)
    bad_token, bad_id = 1, job.num_experts + 3
    info = {}
    if dev.type == "cuda":
        if rank == 0:
            assert experts.shape[0] > bad_token + 1
            experts = experts.clone()
            experts[bad_token, 0] = bad_id
            experts[bad_token + 1, 1] = -5  # a later token: the first one is reported
        got = a2a.dispatch(experts, mine, rt, INVALID_ID, 1)
        expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
        msg = _combine_then_check(a2a, dev, expert_out, rt)
        if rank == 0:
            assert msg is not None and f"expert id {bad_id}" in msg and f"token {bad_token}" in msg, msg
            info["message"] = msg
        else:
            assert msg is None, msg
        a2a.check()  # reported once
    elif rank == 0:
        experts = experts.clone()
        experts[bad_token, 0] = bad_id
        info["message"] = _expect(errors.InputError, a2a.dispatch, experts, mine, rt)
    info.update(run_rounds(rank, job, Plan(seed=plan.seed + 1, rounds=plan.rounds)))
    return info


def _combine_then_check(a2a, dev, payload, rt, zeros: bool = False) -> str | None:
    """Combine, then check(): the InputError a kernel reported (raised by combine itself, after
    launching it, when the dispatch had already finished; else by check() after a sync), or
    None. With ``zeros``, a combine that returned must have returned zeros."""
    try:
        out = a2a.combine(payload, rt)
    except errors.InputError as exc:
        assert a2a.phase == "idle"
        return str(exc)
    torch.cuda.synchronize(dev)
    if zeros:
        assert not bool(out.any()), "a round with mismatched runtime_max_tokens_per_rank returned data"
    try:
        a2a.check()
    except errors.InputError as exc:
        return str(exc)
    return None


def rt_mismatch_then_rounds(rank: int, job: JobSpec, plan: Plan) -> dict:
    """Rank 0 passes another runtime_max_tokens_per_rank than its peers in one round: every
    rank gets InputError naming the peer and its value (host: from dispatch; CUDA: from a
    later call, after a round whose combine returned zeros), and never a silently wrong
    result. Then ``plan.rounds`` rounds are exact on every rank."""
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    rt, experts, mine, _ = _round_of(a2a, job, plan, 2000, rank, dev)
    my_rt = rt + 1 if rank == 0 else rt
    assert my_rt <= job.max_num_tokens
    if dev.type == "cuda":
        got = a2a.dispatch(experts, mine, my_rt)
        expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
        msg = _combine_then_check(a2a, dev, expert_out, my_rt, zeros=True)
        assert msg is not None, f"rank {rank}: mismatched runtime_max_tokens_per_rank raised nothing"
    else:
        msg = _expect(errors.InputError, a2a.dispatch, experts, mine, my_rt)
        assert a2a.phase == "idle"
    assert "runtime_max_tokens_per_rank" in msg, msg
    other = 1 if rank == 0 else 0
    assert f"rank {other} passed runtime_max_tokens_per_rank={rt if rank == 0 else rt + 1}" in msg, msg
    stats = run_rounds(rank, job, Plan(seed=plan.seed + 1, rounds=plan.rounds))
    return {"message": msg, **stats}


def graph_replays(rank: int, job: JobSpec, tokens: int, replays: int) -> dict:
    """The public API (dispatch with sanitize, the toy expert, combine) captured in one CUDA
    graph, replayed ``replays`` times with fresh inputs copied into its static buffers; every
    replay is compared with the reference on every rank."""
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    plan = Plan(seed=4242, tokens=(tokens,) * job.ep_size, rt="max")
    rt = job.max_num_tokens

    def inputs(i):
        _, _, ins, payloads = _round_inputs(job, plan, i)
        routings, received = ref.dispatch([x.experts for x in ins], payloads, job.num_experts, rt, INVALID_ID, 1)
        outputs = [
            ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
            for q, r in enumerate(received)
        ]
        return ins[rank].experts, payloads[rank], ref.combine(routings, outputs)[rank]

    experts0, payloads0, _ = inputs(0)
    s_experts = experts0.to(dev)
    s_payloads = [p.to(dev) for p in payloads0]
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            got = a2a.dispatch(s_experts, s_payloads, rt, INVALID_ID, 1)
            expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
            s_out = a2a.combine(expert_out, rt)
    torch.cuda.current_stream(dev).wait_stream(stream)
    assert a2a.phase == "idle"
    for i in range(replays):
        experts, payloads, want = inputs(i + 1)
        s_experts.copy_(experts)
        for s, p in zip(s_payloads, payloads):
            s.copy_(p)
        graph.replay()
        _assert_combined(s_out, want, job.backend, f"rank {rank} replay {i}")
    a2a.check()
    return {"replays": replays}


def two_objects_one_rank(rank: int, job: JobSpec, plan: Plan) -> dict:
    """Two MoeAlltoAll of one job and rank in one process (one per layer, as FlashInfer users
    have them) share the attachment; their rounds alternate, each checked; closing one leaves
    the other working."""
    from a2ad.client import reference as ref

    first = job.open(rank)
    second = job.open(rank)  # the same job and rank: shares the first one's attachment
    assert second.workspace.data_ptr() == first.workspace.data_ptr()
    dev = job.device(rank)
    done = 0
    for rnd in range(plan.rounds):
        a2a = first if rnd % 2 == 0 else second
        rt, experts, mine, want = _round_of(a2a, job, plan, rnd, rank, dev)
        got = a2a.dispatch(experts, mine, rt, INVALID_ID, 1)
        out = a2a.combine(ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size), rt)
        _assert_combined(out, want, job.backend, f"rank {rank} round {rnd} on object {rnd % 2}")
        done += 1
    first.close()
    rt, experts, mine, want = _round_of(second, job, plan, plan.rounds, rank, dev)
    got = second.dispatch(experts, mine, rt, INVALID_ID, 1)
    out = second.combine(ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size), rt)
    _assert_combined(out, want, job.backend, f"rank {rank} after closing the first object")
    _OPEN[job.name] = second
    return {"rounds": done + 1}


def compiled_ops_rounds(rank: int, job: JobSpec, plan: Plan, backend: str) -> dict:
    """The functional ops (FlashInfer's names, torch.ops.a2ad.moe_a2a_*) in one step compiled
    with torch.compile(fullgraph=True): dispatch, sanitize, the toy expert, combine; every
    round compared with the reference."""
    import a2ad.client as c
    from a2ad.client import reference as ref

    a2a = _OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)

    def step(experts, hidden, scales, ws, meta, rt):
        got, cpo, _ = c.moe_a2a_dispatch(experts, [hidden, experts, scales], ws, meta, rt, rank, job.ep_size, job.top_k,
                                      job.num_experts)
        c.moe_a2a_sanitize_expert_ids(got[1], ws, meta, rank, INVALID_ID)
        y = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
        return c.moe_a2a_combine(y, experts.shape[0], ws, meta, rt, rank, job.ep_size, job.top_k, cpo)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for rnd in range(plan.rounds):
        rt, experts, mine, want = _round_of(a2a, job, plan, rnd, rank, dev)
        out = compiled(experts, mine[0], mine[2], a2a.workspace, a2a.metainfo, rt)
        assert a2a.phase == "idle"
        _assert_combined(out, want, job.backend, f"rank {rank} compiled round {rnd}")
    a2a.check()
    return {"rounds": plan.rounds}
