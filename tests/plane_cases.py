"""Scenarios of the data-plane feature tests (payload agreement, EPLB statistics, the FP8
combine, the caller's active-rank mask), each run by every rank of a job in its own
process (see ``dataplane_cases``, whose jobs and seeded inputs these reuse).

The payload-agreement scenario goes through ``MoeAlltoAll``, as a user would; the others
drive the job's data plane directly (``Plane.dispatch`` / ``Plane.combine`` with their
keyword arguments), since that is the interface these features are built on.
"""

from __future__ import annotations

import torch

import dataplane_cases as dc
from a2ad import errors, layout as L


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def payload_width_mismatch(rank: int, job: dc.JobSpec, plan: dc.Plan) -> dict:
    """Rank 0 sends hidden states of hidden - 1 elements, its peers of hidden: every rank gets
    InputError naming input_payloads[0] and both widths in bytes, and the round moves no data
    (CUDA: the combine returns zeros). Then ``plan.rounds`` rounds are exact on every rank."""
    from a2ad.client import reference as ref

    a2a = dc._OPEN.get(job.name) or job.open(rank)
    dev = job.device(rank)
    rt, experts, mine, _ = dc._round_of(a2a, job, plan, 3000, rank, dev)
    hidden = job.hidden - 1 if rank == 0 else job.hidden
    mine = [mine[0][:, :hidden].contiguous(), *mine[1:]]
    try:
        got = a2a.dispatch(experts, mine, rt)
    except errors.InputError as exc:  # host: the dispatch itself
        msg = str(exc)
    else:  # CUDA: found by the kernel, raised by a later call; the round's combine returns zeros
        expert_out = ref.toy_expert(got[0], got[1], got[2], rank, job.num_experts, job.ep_size)
        msg = dc._combine_then_check(a2a, dev, expert_out, rt, zeros=True)
    assert msg is not None, f"rank {rank}: payloads of different widths raised nothing"
    assert "input_payloads[0] bytes per token" in msg, msg
    mine_b, theirs_b = 2 * hidden, 2 * (job.hidden if rank == 0 else job.hidden - 1)
    assert f"this rank {mine_b}" in msg and f"{theirs_b}" in msg, msg
    assert a2a.phase == "idle", a2a.phase
    stats = dc.run_rounds(rank, job, dc.Plan(seed=plan.seed + 1, rounds=plan.rounds))
    return {"message": msg, **stats}


def _plane(a2a):
    return a2a._att, a2a._plane


def _received(att, rank, rt, pl, like):
    """This rank's received payloads (views of its row where ``pl`` says), typed like the
    reference's ``like`` ([ep_size, rt, ...] each), and its RECV_COUNTERS (CPU)."""
    ep = att.workspace.shape[0]
    got = [att.workspace[rank, off : off + ep * rt * nb].view(ep, rt, nb)
           for off, nb in zip(pl.dispatch_offsets, pl.dispatch_bytes_per_token)]
    recv = [t.view(w.dtype).view(*w.shape) for t, w in zip(got, like)]
    off = att.aux.recv_counters
    counts = att.workspace[rank, off : off + 4 * ep].cpu().view(torch.int32).clone()
    return recv, counts


def _slot_order(recv, counts, expected, sources) -> dict[int, list[int]]:
    """Per source s in ``sources``: for each slot j < count of the received rows, the slot of
    the reference (``expected``, a ``reference.Received``) holding the same row. The CUDA
    dispatch numbers the sends to a target in the order its blocks get there, the reference
    (and the host plane) in token order: the same rows, maybe in another order."""
    from a2ad.client import reference as ref

    got = ref.slot_bytes(recv)
    want = ref.slot_bytes(expected.payloads)
    order = {}
    for s in sources:
        n = int(counts[s])
        assert n == int(expected.recv_counts[s]), f"{n} rows from {s}, the reference has {int(expected.recv_counts[s])}"
        perm = []
        for j in range(n):
            hits = (want[s, :n] == got[s, j]).all(1).nonzero().flatten().tolist()
            assert len(hits) == 1, f"slot {j} from {s} matches reference slots {hits} (want exactly one)"
            perm.append(hits[0])
        assert sorted(perm) == list(range(n)), f"rows from {s} are not the reference's rows: {perm}"
        order[s] = perm
    return order


def _layout(att, rt, payloads, eplb=0, combine_bytes=0):
    widths = [dc._bytes_per_token(p) for p in payloads]
    return L.payload_layout(att.aux, att.size_per_rank, rt, widths, combine_bytes,
                            dtypes=[p.dtype for p in payloads], eplb_stats_num_experts=eplb)


def eplb_gather(rank: int, job: dc.JobSpec, rounds: int, num_stats: int) -> dict:
    """Every rank's int32 statistics gathered into ``[ep_size, num_stats]`` on every rank, each
    round with other values; the tokens still arrive (the dispatch is otherwise checked by
    the round's exact combine)."""
    from a2ad.client import reference as ref

    a2a = dc._OPEN.get(job.name) or job.open(rank)
    att, plane = _plane(a2a)
    dev = job.device(rank)
    plan = dc.Plan(seed=11, rounds=rounds, in_workspace="no")
    for rnd in range(rounds):
        tokens, rt, inputs, payloads = dc._round_inputs(job, plan, rnd)
        routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, None, None)
        stats_of = [torch.arange(num_stats, dtype=torch.int32) * (q + 1) + 1000 * rnd - 7 * q for q in range(job.ep_size)]
        mine = [p.to(dev) for p in payloads[rank]]
        pl = _layout(att, rt, mine, eplb=num_stats, combine_bytes=2 * job.hidden)
        gathered = torch.full((job.ep_size, num_stats), -1, dtype=torch.int32, device=dev)
        plane.dispatch(inputs[rank].experts.to(dev), mine, rt, pl, job.num_experts,
                       eplb_local_stats=stats_of[rank].to(dev), eplb_gathered=gathered)
        _sync(dev)
        plane.check_input()
        want = torch.stack(stats_of)
        assert torch.equal(gathered.cpu(), want), f"rank {rank} round {rnd}: gathered {gathered.cpu()} != {want}"
        # the received payloads are where the layout (after the EPLB region) says: the
        # reference's rows from every source (as sets: CUDA numbers the slots in arrival order)
        recv, counts = _received(att, rank, rt, pl, received[rank].payloads)
        problems = ref.dispatch_mismatches(recv, counts, received[rank])
        assert not problems, f"rank {rank} round {rnd}: " + "; ".join(problems)
        expert_out = ref.toy_expert(recv[0], recv[1], recv[2], rank, job.num_experts, job.ep_size)
        out = plane.combine(expert_out.contiguous(), tokens[rank], rt, pl, False)
        _sync(dev)
        plane.check_input()
        outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
                   for q, r in enumerate(received)]
        dc._assert_combined(out.cpu(), ref.combine(routings, outputs)[rank], job.backend, f"rank {rank} round {rnd}")
    return {"rounds": rounds}


def _fp8_expected(routings, outputs, rank: int) -> torch.Tensor:
    """The FP8 combine's result by its definition: the rows a target q != rank staged for this
    rank quantized (host_plane.quantize_fp8) and dequantized, this rank's own exact, summed in
    float32 over ascending k, rounded to bfloat16."""
    from a2ad.client import reference as ref
    from a2ad.client.host_plane import dequantize_fp8, quantize_fp8

    hidden = outputs[0].shape[2]
    # in float32 so that the dequantized values are summed unrounded
    f32 = []
    for q, o in enumerate(outputs):
        v = o.float().clone()
        if q != rank:
            v[rank] = dequantize_fp8(quantize_fp8(o[rank]), hidden)
        f32.append(v)
    return ref.combine(routings, f32)[rank].to(torch.bfloat16)


def fp8_combine(rank: int, job: dc.JobSpec, rounds: int, in_workspace: bool) -> dict:
    """The FP8 combine against its definition (bit-exact) and against the bf16 combine of
    the same round inputs: max abs error, max error relative to the largest output, and the
    bound asserted per element: |fp8 - bf16| <= 2^-4 * sum_k |contribution_k| + 2^-7 * |bf16|
    + 1e-6 (e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 of each pulled value;
    the outputs are bf16: 2^-8 each)."""
    from a2ad.client import reference as ref

    a2a = dc._OPEN.get(job.name) or job.open(rank)
    att, plane = _plane(a2a)
    dev = job.device(rank)
    plan = dc.Plan(seed=21, rounds=rounds, in_workspace="no")
    worst_abs = worst_rel = 0.0
    differing = 0
    for rnd in range(rounds):
        tokens, rt, inputs, payloads = dc._round_inputs(job, plan, rnd)
        routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, None, None)
        # expert outputs: seeded normal bf16 values (not the toy expert: every element differs)
        gen = torch.Generator().manual_seed(1000 + rnd)
        outputs = [torch.randn(job.ep_size, rt, job.hidden, generator=gen).to(torch.bfloat16) for _ in range(job.ep_size)]
        results = {}
        for low in (False, True):
            mine = [p.to(dev) for p in payloads[rank]]
            pl = _layout(att, rt, mine, combine_bytes=2 * job.hidden)
            plane.dispatch(inputs[rank].experts.to(dev), mine, rt, pl, job.num_experts)
            _sync(dev)
            # row (s, j) of the payload: the output the reference has for the token the
            # dispatch put in slot j from s (CUDA numbers a target's slots in arrival order)
            recv, counts = _received(att, rank, rt, pl, received[rank].payloads)
            payload = outputs[rank].clone()
            for s, perm in _slot_order(recv, counts, received[rank], range(job.ep_size)).items():
                if perm:
                    payload[s, : len(perm)] = outputs[rank][s, perm]
            payload = payload.to(dev)
            if in_workspace:
                region = att.workspace[rank, pl.combine_offset : pl.combine_offset + job.ep_size * rt * 2 * job.hidden]
                payload_ws = region.view(torch.bfloat16).view(job.ep_size, rt, job.hidden)
                payload_ws.copy_(payload)
                payload = payload_ws
            out = torch.empty(tokens[rank], job.hidden, dtype=torch.bfloat16, device=dev)
            got = plane.combine(payload, tokens[rank], rt, pl, in_workspace, output=out, low_precision=low)
            _sync(dev)
            plane.check_input()
            assert got.data_ptr() == out.data_ptr()
            results[low] = out.cpu()
        want_bf16 = ref.combine(routings, outputs)[rank]
        dc._assert_combined(results[False], want_bf16, job.backend, f"rank {rank} round {rnd} bf16")
        want_fp8 = _fp8_expected(routings, outputs, rank)
        diff = (results[True].float() - want_fp8.float()).abs()
        differing += int((results[True] != want_fp8).sum())
        if job.backend == "host":  # the same bits by construction
            assert torch.equal(results[True], want_fp8), (
                f"rank {rank} round {rnd}: FP8 combine differs from its definition (max {float(diff.max()):.3g})")
        else:
            dc._assert_combined(results[True], want_fp8, job.backend, f"rank {rank} round {rnd} FP8")
        # accuracy against the bf16 combine
        absum = ref.combine(routings, [o.float().abs() for o in outputs])[rank]
        err = (results[True].float() - results[False].float()).abs()
        bound = 2.0 ** -4 * absum + 2.0 ** -7 * results[False].float().abs() + 1e-6
        assert bool((err <= bound).all()), f"rank {rank} round {rnd}: FP8 error {float((err - bound).max())} over the bound"
        if err.numel():
            worst_abs = max(worst_abs, float(err.max()))
            worst_rel = max(worst_rel, float(err.max()) / max(float(results[False].float().abs().max()), 1e-30))
    return {"max_abs_err": worst_abs, "max_err_rel_to_max_out": worst_rel, "differing_from_definition": differing}


def caller_mask_round(rank: int, job: dc.JobSpec, excluded: int, device_mask: bool) -> dict:
    """Every rank but ``excluded`` runs a round with an active-rank mask without it (the
    excluded rank runs nothing, as a failed rank would): tokens for its experts go nowhere,
    every other contribution arrives, nobody waits for it."""
    from a2ad.client import reference as ref

    a2a = dc._OPEN.get(job.name) or job.open(rank)  # every rank attaches (the job's rendezvous)
    if rank == excluded:
        return {"skipped": True}
    att, plane = _plane(a2a)
    dev = job.device(rank)
    plan = dc.Plan(seed=31, rounds=1, in_workspace="no")
    tokens, rt, inputs, payloads = dc._round_inputs(job, plan, 0)
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, job.num_experts, rt, None, None)
    active = [q for q in range(job.ep_size) if q != excluded]
    bits = sum(1 << q for q in active)
    mask = torch.tensor([bits], dtype=torch.int64, device=dev if device_mask else "cpu")
    mine = [p.to(dev) for p in payloads[rank]]
    pl = _layout(att, rt, mine, combine_bytes=2 * job.hidden)
    plane.dispatch(inputs[rank].experts.to(dev), mine, rt, pl, job.num_experts, caller_mask=mask)
    # the received rows of the active sources are right (the ref routes to every rank; the
    # slots at an active target are the same, since sends to the excluded one come last nowhere)
    _sync(dev)
    recv, counts = _received(att, rank, rt, pl, received[rank].payloads)
    outputs = [
        ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, job.num_experts, job.ep_size)
        for q, r in enumerate(received)
    ]
    # only what active sources sent is defined; the rows as sets (CUDA: arrival order)
    got_rows, want_rows = ref.slot_bytes(recv), ref.slot_bytes(received[rank].payloads)
    for s in active:
        n = int(received[rank].recv_counts[s])
        assert int(counts[s]) == n, f"rank {rank}: {int(counts[s])} rows from {s}, expected {n}"
        assert ref.same_rows(got_rows[s, :n], want_rows[s, :n]), f"rank {rank}: rows from {s} differ"
    expert_out = ref.toy_expert(recv[0], recv[1], recv[2], rank, job.num_experts, job.ep_size)
    payload = expert_out.contiguous()
    out = plane.combine(payload, tokens[rank], rt, pl, False, caller_mask=mask)
    _sync(dev)
    plane.check_input()
    want = ref.combine(routings, outputs, active=set(active))[rank]
    dc._assert_combined(out.cpu(), want, job.backend, f"rank {rank} masked round")
    return {"skipped": False, "tokens": tokens[rank]}
