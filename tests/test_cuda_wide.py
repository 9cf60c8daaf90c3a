"""GPU tests of the CUDA kernels above 64 ranks (rank masks of several u64 words), every rank of
one job on one GPU in this process (the in-process job of test_cuda_kernels.py), checked
against ``a2ad.client.reference``; and the front end's refusals of what the binding no longer
checks in a production build.

How wide a job fits on one GPU in one process. Every rank's waiting kernel must be resident
with every other rank's: a dispatch's last block waits for every peer's ready word, a
combine's blocks for every peer's flag. On an H200 (132 SMs, compute capability 9.0):

- grids: at most 128 kernels are resident on a device at once, and a rank holds one while it
  waits (a second one for a moment: its next kernel, queued with programmatic dependent launch,
  or the expert computation between dispatch and combine), so ep_size <= 128 at the very most;
- blocks: dispatch and combine use up to 128 registers per thread with 256 threads, two blocks
  per SM, 264 on the device; these tests give every rank a one-SM budget, so a rank's grid
  is at most 2 blocks and 96 ranks wait with at most 192 blocks;
- streams: every rank needs a stream of its own; torch's pool has 32 per priority and hands
  them out round-robin, so the Job of test_cuda_kernels.py takes streams from the driver
  above 32 ranks (two ranks on one stream would wait for each other, one behind the other).

So the wide tests run ``EP_WIDE`` = 96 ranks (with 32 resident-grid slots and 72 blocks to
spare for torch's own kernels and the moments two kernels of a rank overlap), and 65 (the
smallest job with a second mask word) and 64 (the widest one-word job, every bit of the word
set). 128 ranks would fill every grid slot with waiting kernels and is not run here.
"""

from __future__ import annotations

import time

import pytest
import torch

from a2ad import errors, layout as L
from test_cuda_kernels import make_job  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EP_WIDE = 96
HIDDEN, TOP_K, RT = 64, 6, 8
#: the SMs a 96-rank job needs at two blocks per SM and one grid per rank (see the module doc)
MIN_SMS = EP_WIDE // 2 + 1


def _needs_sms(ep):
    from a2ad.client.cuda_plane import sm_count

    sms = sm_count()
    if ep > 64 and sms < MIN_SMS:
        pytest.skip(f"a {ep}-rank job in one process needs >= {MIN_SMS} SMs, this GPU has {sms}")


def _one_sm_each(job):
    """Every rank's grids sized for one SM: ep grids of (blocks per SM) blocks each stay
    resident together with room left for torch's kernels (the Job's own budget,
    sm_count // (ep + 1), gives 64 and 65 ranks two SMs each, which would fill the device)."""
    for p in job.planes:
        p.sm_budget = 1
    return job


def _inputs(seed, ep, num_experts, tokens=None):
    """Seeded inputs of every rank (CPU) and their device copies: [hidden bf16, ids int32, scales f32]."""
    from a2ad.client import reference as ref

    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(0, RT + 1, (ep,), generator=g).tolist()
        tokens[0] = RT  # a full rank
        tokens[ep - 1] = max(tokens[ep - 1], 1)  # the highest rank sends something
    ins = ref.make_round(seed, tokens, HIDDEN, TOP_K, num_experts, torch.bfloat16)
    cpu = [[i.hidden, i.experts, i.scales] for i in ins]
    dev = [[t.cuda() for t in p] for p in cpu]
    return ins, cpu, dev


def _widths():
    return [2 * HIDDEN, 4 * TOP_K, 4 * TOP_K]


def _run_round(job, pl, dev, ranks, num_experts, caller_mask=None, also_combine=()):
    """dispatch -> toy expert on what each rank received -> combine, on ``ranks`` (and the
    combine of ``also_combine``, ranks that dispatched already); returns (what each rank
    received, a copy, per rank; outputs per rank)."""
    from a2ad.client import reference as ref

    ep = job.ep_size
    kw = {} if caller_mask is None else {"caller_mask": caller_mask}
    job.on_ranks(lambda r: job.planes[r].dispatch(dev[r][1], dev[r], RT, pl, num_experts, **kw), ranks)
    ranks = sorted(set(ranks) | set(also_combine))

    def received(r):
        hid = job.region(r, pl.dispatch_offsets[0], 2 * HIDDEN).view(torch.bfloat16)
        ids = job.region(r, pl.dispatch_offsets[1], 4 * TOP_K).view(torch.int32)
        sc = job.region(r, pl.dispatch_offsets[2], 4 * TOP_K).view(torch.float32)
        return [hid, ids, sc]

    recv = {r: received(r) for r in ranks}
    saved = {}

    def expert_and_combine(r):
        saved[r] = [t.clone() for t in recv[r]]
        y = ref.toy_expert(saved[r][0], saved[r][1], saved[r][2], r, num_experts, ep)
        return job.planes[r].combine(y, dev[r][1].shape[0], RT, pl, False, **kw)

    outs = job.on_ranks(expert_and_combine, ranks)
    job.join(ranks)
    torch.cuda.current_stream().synchronize()
    return saved, outs


def _records(job, ranks):
    """The non-OK status records of ``ranks``, each with what the rank's row says of the round
    it reached (its FLAG_VAL, the round of its view, or -1: it did not run it) and the peers
    whose dispatch ready word in its row is behind the record's round: a wait that gave up,
    told from every side."""
    def row(r):
        bc = job.i32(r, job.aux.block_counters, L.BLOCK_COUNTER_SLOTS).cpu()
        return f"flag_val {job.flag_val(r)}, view round {int(bc[L.SLOT_VIEW_ROUND])}"

    out, named = [], set()
    for r in ranks:
        rec = job.control.status(r)
        if rec.code == L.STATUS_OK:
            continue
        ready = job.ws[r, job.aux.dispatch_ready : job.aux.dispatch_ready + 8 * job.ep_size].view(torch.int64).cpu()
        behind = sum(1 << q for q in range(job.ep_size) if int(ready[q]) & 0xFFFFFFFF < rec.round)
        out.append(f"rank {r}: code {rec.code} peer {rec.peer} {rec.phase_name} round {rec.round} ({row(r)}, "
                   f"dispatch ready words behind that round from {L.format_ranks(behind)})")
        named.add(rec.peer)
    out += [f"rank {q} (waited for): code {job.control.status(q).code}, {row(q)}"
            for q in sorted(named) if 0 <= q < job.ep_size]
    return out


def _check_round(job, ins, cpu, saved, outs, ranks, num_experts, active=None, what=""):
    """Every rank of ``ranks``: what it received (per source, as sets) and its combine, against
    the reference of a round among ``active`` (None: every rank)."""
    from a2ad.client import reference as ref

    ep = job.ep_size
    routings, expected = ref.dispatch([i.experts for i in ins], cpu, num_experts, RT, active=active)
    outputs = [ref.toy_expert(e.payloads[0], e.payloads[1], e.payloads[2], q, num_experts, ep)
               for q, e in enumerate(expected)]
    combined = ref.combine(routings, outputs, active)
    gave_up = _records(job, ranks)
    assert not gave_up, f"{what}: waits that gave up: " + "; ".join(gave_up)
    for r in ranks:
        job.planes[r].check()
        problems = ref.dispatch_mismatches([t.cpu() for t in saved[r]], job.recv_counts(r), expected[r])
        assert not problems, f"{what} rank {r}: " + "; ".join(problems[:5])
        out, want = outs[r].cpu(), combined[r]
        assert out.shape == want.shape and out.dtype == want.dtype, (what, r, out.shape, want.shape)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{what} rank {r}: {m}")
        job.planes[r].check()
        job.planes[r].check_input()
    return routings


@pytest.mark.parametrize("ep", [64, 65, EP_WIDE])
def test_wide_job_rounds_match_the_reference(make_job, ep):
    """Rounds of a whole job of ``ep`` ranks (one-word masks at 64, four words above): uneven
    token counts (ranks with none), every rank's experts in use, three payloads; every rank's
    received rows and combine equal the reference's, and the ready words of every peer
    (ranks above 63 included) carry the round."""
    _needs_sms(ep)
    num_experts = 2 * ep
    job = make_job(ep, RT, TOP_K, num_experts, sum(_widths()), 2 * HIDDEN)
    _one_sm_each(job)
    pl = job.layout(RT, _widths(), 2 * HIDDEN)
    for rnd in range(2):
        ins, cpu, dev = _inputs(100 * ep + rnd, ep, num_experts)
        saved, outs = _run_round(job, pl, dev, range(ep), num_experts)
        _check_round(job, ins, cpu, saved, outs, range(ep), num_experts, what=f"ep {ep} round {rnd}")
        for r in (0, ep - 1):
            words = job.ws[r, job.aux.dispatch_ready : job.aux.dispatch_ready + 8 * ep].view(torch.int64).cpu()
            assert all(int(w) & 0xFFFFFFFF == L.INITIAL_ROUND + rnd for w in words.tolist()), (ep, r)
    assert all(job.flag_val(r) == L.INITIAL_ROUND + 2 for r in range(ep))


#: The ranks left out of the masked rounds: one below 64 and several above (a whole run of
#: the second word, its first and last rank among them).
LEFT_OUT = (5, 64, 65, 70, 71, 72, 80, EP_WIDE - 1)


@pytest.mark.parametrize("device_mask", [False, True], ids=["cpu-mask-4-words", "device-mask-2-words"])
def test_caller_mask_with_ranks_above_64(make_job, device_mask):
    """96 ranks, the caller's mask leaving out ranks 5, 64, 65, 70-72, 80 and 95 (which run
    nothing): the other ranks send them nothing, receive nothing from them, count nothing
    from them and do not wait for them; their rows stay as they were. The mask is a CPU tensor
    of MASK_WORDS words or a device tensor of ceil(96 / 64) = 2 words (the words past it count
    as zero); then a round of every rank without a mask."""
    _needs_sms(EP_WIDE)
    ep, num_experts = EP_WIDE, 2 * EP_WIDE
    job = make_job(ep, RT, TOP_K, num_experts, sum(_widths()), 2 * HIDDEN)
    _one_sm_each(job)
    pl = job.layout(RT, _widths(), 2 * HIDDEN)
    active = [r for r in range(ep) if r not in LEFT_OUT]
    mask_int = sum(1 << r for r in active)
    if device_mask:
        words = L.mask_words(mask_int, (ep + 63) // 64)
        mask = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words], dtype=torch.int64, device="cuda")
    else:
        words = L.mask_words(mask_int)
        mask = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words], dtype=torch.int64)
    torch.cuda.synchronize()
    rows = {q: job.ws[q].cpu().clone() for q in LEFT_OUT}
    for rnd in range(2):
        ins, cpu, dev = _inputs(7000 + rnd, ep, num_experts)
        saved, outs = _run_round(job, pl, dev, active, num_experts, caller_mask=mask)
        routings = _check_round(job, ins, cpu, saved, outs, active, num_experts, active=set(active),
                                what=f"masked round {rnd}")
        for r in active:
            counts = job.recv_counts(r)
            assert all(int(counts[q]) == 0 for q in LEFT_OUT), f"rank {r} counted tokens from a rank left out"
            # (t, k) whose target was left out got no slot
            slot = job.i32(r, job.aux.topk_send_indices, RT * L.MAX_TOP_K).view(RT, L.MAX_TOP_K).cpu()
            tg = routings[r].target
            for t in range(tg.shape[0]):
                for k in range(TOP_K):
                    if int(tg[t, k]) in LEFT_OUT:
                        assert int(slot[t, k]) == -1, f"rank {r} token {t} k {k}: a slot at rank {int(tg[t, k])}"
    for q in LEFT_OUT:
        assert torch.equal(job.ws[q].cpu(), rows[q]), f"the row of rank {q}, left out, was written"
    # the left-out ranks' rows are still at the job's first round: re-arm, then every rank
    job.rearm()
    ins, cpu, dev = _inputs(7100, ep, num_experts)
    saved, outs = _run_round(job, pl, dev, range(ep), num_experts)
    _check_round(job, ins, cpu, saved, outs, range(ep), num_experts, what="full round")


def test_degraded_mode_with_lost_ranks_above_64_and_a_replacement(make_job):
    """96 ranks of a degrade job: ranks 5, 64, 65, 70-72, 80 and 95 leave the job's active mask
    (bits of both words cleared): rounds among the others drop the sends to them, count
    nothing from them, report exactly the other ranks (round_mask, the MASK_WORDS words of
    round_mask_tensor) and mark exactly the tokens that had an expert on a lost rank. Then a
    replacement joins as rank 70 and asks to be let in: the lowest rank (0) lets it in from the
    next round (its prologue finds rank 70 in the second mask word), the replacement's first
    dispatch starts at that round, and that round counts it too.

    The replacement's request (ADMIT_READY) is written here, as its first dispatch would write
    it, and that dispatch is queued once it is let in: 96 streams share the device's few
    hardware queues, and a kernel that waits inside its prologue for rounds queued after it
    would hold back, on its queue, the other ranks' kernels of those rounds (a job of one rank
    per process or GPU has no such queue; the 3-rank test of test_cuda_degraded.py covers the
    wait in the prologue itself)."""
    from a2ad.client import reference as ref
    from a2ad.client.cuda_plane import initialize_row

    _needs_sms(EP_WIDE)
    ep, num_experts = EP_WIDE, 2 * EP_WIDE
    job = make_job(ep, RT, TOP_K, num_experts, sum(_widths()), 2 * HIDDEN, on_peer_loss="degrade")
    _one_sm_each(job)
    pl = job.layout(RT, _widths(), 2 * HIDDEN)
    full = L.full_mask(ep)

    def check(ins, cpu, saved, outs, ranks, counted, what):
        routings = _check_round(job, ins, cpu, saved, outs, ranks, num_experts, active=set(L.mask_ranks(counted)),
                                what=what)
        for r in ranks:
            plane = job.planes[r]
            assert plane.round_mask() == counted, (what, r, L.format_ranks(plane.round_mask()))
            words = plane.round_mask_tensor()
            assert words.shape == (L.MASK_WORDS,), words.shape
            assert L.mask_from_words(words.tolist()) == counted, (what, r)
            lost = ref.lost_tokens(routings[r], L.mask_ranks(counted))
            assert torch.equal(plane.degraded_tokens().cpu(), lost), (what, r)

    ins, cpu, dev = _inputs(9000, ep, num_experts)
    saved, outs = _run_round(job, pl, dev, range(ep), num_experts)
    check(ins, cpu, saved, outs, range(ep), full, "full round")

    counted = full & ~sum(1 << q for q in LEFT_OUT)
    job.control.set_active_mask(counted, ep, time.monotonic_ns())
    survivors = L.mask_ranks(counted)
    for rnd in range(2):
        ins, cpu, dev = _inputs(9100 + rnd, ep, num_experts)
        saved, outs = _run_round(job, pl, dev, survivors, num_experts)
        check(ins, cpu, saved, outs, survivors, counted, f"degraded round {rnd}")
        assert all(int(job.recv_counts(r)[q]) == 0 for r in survivors for q in LEFT_OUT)

    # a replacement for rank 70: what the daemon does (row re-initialized, ADMIT_JOINED, bit
    # set), then its request to be let in
    torch.cuda.synchronize()
    initialize_row(job.ws, 70, job.aux, lines_tail=job.lines_tail)
    job.planes[70].reset_status()
    torch.cuda.synchronize()
    job.control.set_admit_round(70, L.ADMIT_JOINED)
    with_70 = counted | 1 << 70
    job.control.set_active_mask(with_70, ep, time.monotonic_ns())
    job.control.set_admit_round(70, L.ADMIT_READY)
    ins, cpu, dev = _inputs(9200, ep, num_experts)
    saved, outs = _run_round(job, pl, dev, survivors, num_experts)  # rank 70 is not in this round yet
    check(ins, cpu, saved, outs, survivors, counted, "the round that lets the replacement in")
    admit = job.control.admit_round(70)
    assert admit == job.flag_val(0) == L.INITIAL_ROUND + 4, f"rank 70's admit round {admit}"
    # its first round: every rank of the mask, rank 70's dispatch queued first (its prologue
    # finds every other rank done with the round before and starts at the admit round)
    members = L.mask_ranks(with_70)
    ins, cpu, dev = _inputs(9300, ep, num_experts)
    job.on_ranks(lambda r: job.planes[r].dispatch(dev[r][1], dev[r], RT, pl, num_experts), [70])
    saved, outs = _run_round(job, pl, dev, survivors, num_experts, also_combine=[70])
    check(ins, cpu, saved, outs, members, with_70, "the replacement's first round")
    assert job.flag_val(70) == admit + 1
    # and one more full round of the mask
    ins, cpu, dev = _inputs(9400, ep, num_experts)
    saved, outs = _run_round(job, pl, dev, members, num_experts)
    check(ins, cpu, saved, outs, members, with_70, "the round after")


# ---------------------------------------------------------------------------
# The front end raises what the binding checks only in the debug build
# ---------------------------------------------------------------------------
def test_front_end_names_the_argument_of_what_the_binding_no_longer_checks():
    """A one-rank caller-owned CUDA workspace (the front end over a CudaPlane): the conditions
    the binding checks only in its debug build (a payload with no bytes per token, an invalid
    id that does not fit int32, hidden 0, payload_in_workspace with another tensor), and the
    ones it keeps (more tokens than runtime_max_tokens_per_rank, ids neither int32 nor int64,
    a payload of another token count, a combine payload of another dtype), are refused by the
    front end with InputError naming the argument, before anything is launched; then a good
    round is exact."""
    from a2ad.client import local, reference as ref

    ep, top_k, num_experts, max_tokens, hidden = 1, 2, 4, 8, 64
    size = L.workspace_size_per_rank(ep, max_tokens, 2 * hidden + 4 * top_k, 2 * hidden)
    ws = torch.zeros(ep, size, dtype=torch.uint8, device="cuda")
    front, _ = local.initialize(ws, 0, ep, max_tokens, timeout=20.0)
    owner = object()
    try:
        T = 6
        experts = torch.randint(0, num_experts, (T, top_k), dtype=torch.int32, device="cuda")
        x = torch.randn(T, hidden, device="cuda").bfloat16()

        def refused(argument, fn):
            with pytest.raises(errors.InputError) as info:
                fn()
            assert info.value.details["argument"] == argument, (argument, str(info.value))

        # dispatch: nothing runs, no round opens
        refused("token_selected_experts", lambda: front.dispatch(owner, experts, [x], 5, top_k, num_experts))
        refused("token_selected_experts",
                lambda: front.dispatch(owner, experts.float(), [x], T, top_k, num_experts))
        refused("input_payloads[0]", lambda: front.dispatch(owner, experts, [x[:5]], T, top_k, num_experts))
        refused("input_payloads[1]", lambda: front.dispatch(
            owner, experts, [x, torch.empty(T, 0, device="cuda")], T, top_k, num_experts))
        refused("invalid_token_expert_id", lambda: front.dispatch(
            owner, experts, [x, experts], T, top_k, num_experts, invalid_id=1 << 31, ids_index=1))
        torch.cuda.synchronize()
        assert int(ws[0, front.att.aux.flag_val : front.att.aux.flag_val + 4].view(torch.int32)) == L.INITIAL_ROUND
        # a good dispatch, then combines refused while its round stays open
        recv, layout, _ = front.dispatch(owner, experts, [x, experts], T, top_k, num_experts)
        refused("invalid_expert_id", lambda: front.sanitize(recv[1], -(1 << 31) - 1))
        y = (recv[0].float() * 2).bfloat16()
        refused("payload", lambda: front.combine(owner, y.view(torch.int16).to(torch.int32), T))
        refused("payload", lambda: front.combine(owner, y[:, :, :0], T))
        refused("payload", lambda: front.combine(owner, y[:, :5], T))
        refused("payload_in_workspace", lambda: front.combine(owner, y.clone(), T, True))
        out = front.combine(owner, y, T)
        torch.cuda.synchronize()
        routings, _ = ref.dispatch([experts.cpu()], [[x.cpu()]], num_experts, T)
        want = ref.combine(routings, [(x.cpu().float() * 2).bfloat16().view(1, T, hidden)])[0]
        # one rank: every token's sends are all to rank 0 (one send), so out is 2x
        torch.testing.assert_close(out.cpu().float(), want.float(), rtol=0, atol=0)
    finally:
        torch.cuda.synchronize()
        front.close()
        local.forget(ws)
