"""GPU tests of the data-plane features of the CUDA kernels, several ranks of one job on one
GPU in this process (the harness of test_cuda_kernels): payload and combine descriptors that
differ between ranks (InputError on every rank, nothing misread), EPLB statistics gathered in
the dispatch (eager and in CUDA graphs), the FP8 combine (bit-exact against its definition,
host_plane.quantize_fp8, and its error against the bf16 combine), and the caller's
active-rank mask (a device tensor, in CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from a2ad import errors, layout as L
from test_cuda_kernels import (  # noqa: F401  (make_job is a fixture)
    check_dispatch,
    combine_paths,
    combine_reference,
    digest_lines,
    expert_weight,
    make_job,
    owners,
    rand_experts,
    routes,
    run_round,
    close,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _raises_on_every_rank(job, words):
    torch.cuda.synchronize()
    msgs = []
    for r in range(job.ep_size):
        with pytest.raises(errors.InputError) as info:
            job.planes[r].check_input()
        msgs.append(str(info.value))
        for w in words[r]:
            assert w in msgs[-1], msgs[-1]
        job.planes[r].check_input()  # raised once, then forgotten
    return msgs


def _good_round(job, T=8, hidden=64):
    """A correct round after an error: exact again."""
    e = [rand_experts(T, job.top_k, job.num_experts) for _ in range(job.ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(job.ep_size)]
    pl = job.layout(T, [2 * hidden, 4 * job.top_k], 2 * hidden)
    payloads = [[x[r].view(torch.uint8), e[r].view(torch.uint8)] for r in range(job.ep_size)]
    outs = run_round(job, e, payloads, pl, 0, torch.bfloat16)
    for r in range(job.ep_size):
        close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
        job.planes[r].check_input()


def _masked_step(job, e, x, pl, E, T, mask):
    """fn(r): rank r's dispatch of ``[x[r], e[r]]`` (rt = T) and the combine of its received rows
    times expert_weight(r), both under the caller's device mask ``mask``; returns the output."""
    hidden = x[0].shape[1]

    def step(r):
        job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E, caller_mask=mask)
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        comb = (recv.float() * expert_weight(r)).to(torch.bfloat16)
        return job.planes[r].combine(comb, T, T, pl, False, caller_mask=mask)

    return step


def _masked_reference(e_r, x_r, E, ep, active):
    """float64: each row of x_r times the sum of expert_weight over its distinct targets that are
    in ``active`` (a masked round's combine)."""
    tg = routes(e_r.cpu(), E, ep)
    w = torch.tensor([sum(expert_weight(q) for q in t if q in active) for t in tg], dtype=torch.float64)
    return x_r.cpu().double() * w[:, None]


@pytest.mark.parametrize("lines_tail", [True, False])
@pytest.mark.parametrize("ep_size", [2, 3])
def test_payload_width_mismatch_raises_on_every_rank(make_job, ep_size, lines_tail):
    """hidden 7 on rank 0, 8 on the others (bf16): every rank's check_input raises naming
    input_payloads[0] and both widths; the round's combine returns zeros; then exact rounds.
    Alike in rows with a lines tail (where the dispatch digests are: rank 0's differs from the
    others', so every rank compares the descriptors) and in a caller's rows without one."""
    T, top_k, E = 8, 2, 8
    job = make_job(ep_size, T, top_k, E, 2 * 64 + 4 * top_k, 2 * 64, lines_tail=lines_tail)
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    hid = [7 if r == 0 else 8 for r in range(ep_size)]
    x = [torch.randn(T, hid[r], device="cuda").to(torch.bfloat16) for r in range(ep_size)]
    pls = [L.payload_layout(job.aux, job.size, T, [2 * hid[r], 4 * top_k], 2 * hid[r],
                            dtypes=[torch.bfloat16, torch.int32]) for r in range(ep_size)]

    def dispatch(r):
        job.planes[r].dispatch(e[r], [x[r], e[r]], T, pls[r], E)

    def combine(r):
        payload = torch.ones(ep_size, T, hid[r], dtype=torch.bfloat16, device="cuda")
        return job.planes[r].combine(payload, T, T, pls[r], False)

    job.on_ranks(dispatch)
    outs = job.on_ranks(combine)
    job.join()
    for r in range(ep_size):
        assert not bool(outs[r].any()), f"rank {r}: a round with mismatched payloads returned data"
    if lines_tail:
        digests = [L.spec_digest(pl.spec) for pl in pls]
        assert digests[0] != digests[1]
        for r in range(ep_size):
            rounds, got = digest_lines(job, r)
            assert (rounds == L.INITIAL_ROUND).all() and got == digests, f"rank {r}: digest lines {got}"
    words = {0: ["input_payloads[0] bytes per token", "this rank 14", "16"]}
    for r in range(1, ep_size):
        words[r] = ["input_payloads[0] bytes per token", "this rank 16", "rank 0 14"]
    _raises_on_every_rank(job, words)
    _good_round(job)


def test_dispatch_digests_carry_the_round_and_the_descriptor(make_job):
    """In rows with a lines tail every dispatch writes its digest line (R in both words,
    layout.spec_digest of its payload descriptor in their low halves) into the row of every rank
    of its round: after each round every row holds each source's line of that round (zeroed
    before the first); a round with another descriptor has another digest; a rank outside a
    round's caller mask neither writes a line nor gets one (the slots keep the round before);
    and every round is exact."""
    ep, T, top_k, E, hidden = 3, 8, 2, 12, 64
    job = make_job(ep, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden)
    assert job.lines_tail
    job.rt = T
    for r in range(ep):
        rounds, _ = digest_lines(job, r)
        assert not rounds.any(), f"rank {r}: digest lines before the first round"
    plain = L.payload_layout(job.aux, job.size, T, [2 * hidden, 4 * top_k], 2 * hidden)
    typed = L.payload_layout(job.aux, job.size, T, [2 * hidden, 4 * top_k], 2 * hidden,
                             dtypes=[torch.bfloat16, torch.int32])
    assert L.spec_digest(plain.spec) != L.spec_digest(typed.spec)
    for R, pl in ((1, plain), (2, typed)):
        e = [rand_experts(T, top_k, E) for _ in range(ep)]
        x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep)]
        outs = run_round(job, e, [[x[r].view(torch.uint8), e[r].view(torch.uint8)] for r in range(ep)], pl, 0,
                         torch.bfloat16)
        torch.cuda.synchronize()
        for r in range(ep):
            job.planes[r].check_input()
            close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
            rounds, got = digest_lines(job, r)
            assert (rounds == R).all(), f"round {R}, rank {r}: digest line rounds {rounds.tolist()}"
            assert got == [L.spec_digest(pl.spec)] * ep, f"round {R}, rank {r}: digests {got}"
    # round 3 on ranks 0 and 1 only (rank 2 runs nothing)
    active, mask = [0, 1], torch.tensor([0b011], dtype=torch.int64, device="cuda")
    e = [rand_experts(T, top_k, E) for _ in range(ep)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep)]
    outs = job.on_ranks(_masked_step(job, e, x, plain, E, T, mask), ranks=active)
    job.join(ranks=active)
    torch.cuda.synchronize()
    for r in active:
        job.planes[r].check_input()
        close(outs[r], _masked_reference(e[r], x[r], E, ep, active), torch.bfloat16)
    want_rounds = {0: [3, 3, 2], 1: [3, 3, 2], 2: [2, 2, 2]}
    want_digests = {0: [L.spec_digest(plain.spec)] * 2 + [L.spec_digest(typed.spec)],
                    1: [L.spec_digest(plain.spec)] * 2 + [L.spec_digest(typed.spec)],
                    2: [L.spec_digest(typed.spec)] * 3}
    for r in range(ep):
        rounds, got = digest_lines(job, r)
        assert rounds.tolist() == [[v, v] for v in want_rounds[r]], f"round 3, rank {r}: {rounds.tolist()}"
        assert got == want_digests[r], f"round 3, rank {r}: digests {got}"


def test_payload_dtype_mismatch_names_both_dtypes(make_job):
    T, top_k, E, hidden = 8, 2, 8, 64
    job = make_job(2, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden)
    e = [rand_experts(T, top_k, E) for _ in range(2)]
    dts = [torch.bfloat16, torch.float16]
    x = [torch.randn(T, hidden, device="cuda").to(dts[r]) for r in range(2)]
    pls = [L.payload_layout(job.aux, job.size, T, [2 * hidden, 4 * top_k], 2 * hidden, dtypes=[dts[r], torch.int32])
           for r in range(2)]
    job.on_ranks(lambda r: job.planes[r].dispatch(e[r], [x[r], e[r]], T, pls[r], E))
    job.on_ranks(lambda r: job.planes[r].combine(torch.zeros(2, T, hidden, dtype=torch.bfloat16, device="cuda"), T, T,
                                                 pls[r], False))
    job.join()
    _raises_on_every_rank(job, {0: ["input_payloads[0] dtype", "bfloat16", "float16"],
                                1: ["input_payloads[0] dtype", "float16", "bfloat16"]})
    _good_round(job)


def test_combine_width_mismatch_reads_nothing_from_the_peer(make_job):
    """Same dispatch, combine hidden 64 on rank 0 and 32 on rank 1: each rank's output holds only
    its own contributions (nothing pulled from the other) and check_input raises on both."""
    T, top_k, E, hidden = 8, 2, 8, 64
    job = make_job(2, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden)
    e = [rand_experts(T, top_k, E) for _ in range(2)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(2)]
    hid = [64, 32]
    pls = [job.layout(T, [2 * hidden, 4 * top_k], 2 * hid[r]) for r in range(2)]
    payload = [torch.ones(2, T, hid[r], dtype=torch.bfloat16, device="cuda") for r in range(2)]
    job.on_ranks(lambda r: job.planes[r].dispatch(e[r], [x[r], e[r]], T, pls[r], E))
    outs = job.on_ranks(lambda r: job.planes[r].combine(payload[r], T, T, pls[r], False))
    job.join()
    own = owners(E, 2)
    for r in range(2):
        mine = torch.tensor([1.0 if r in {own[k] for k in row} else 0.0 for row in e[r].cpu().tolist()])
        want = mine[:, None].expand(T, hid[r])
        assert torch.equal(outs[r].float().cpu(), want), f"rank {r}: pulled from a peer that disagreed"
    _raises_on_every_rank(job, {0: ["the combine payload", "hidden=64", "hidden=32"],
                                1: ["the combine payload", "hidden=32", "hidden=64"]})
    _good_round(job)


@pytest.mark.parametrize("ep_size,num_stats", [(2, 7), (4, 256)])
def test_eplb_stats_gathered_eager_and_in_graphs(make_job, ep_size, num_stats):
    T, top_k, E, hidden = 16, 4, 32, 128
    # the EPLB region comes first in the payload area: room for it in the dispatch bytes
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k + 4 * num_stats, 2 * hidden)
    pl = L.payload_layout(job.aux, job.size, T, [2 * hidden, 4 * top_k], 2 * hidden,
                          eplb_stats_num_experts=num_stats)
    job.rt = T
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep_size)]
    stats = [torch.zeros(num_stats, dtype=torch.int32, device="cuda") for _ in range(ep_size)]
    gathered = [torch.full((ep_size, num_stats), -1, dtype=torch.int32, device="cuda") for _ in range(ep_size)]

    def step(r):
        job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E, eplb_local_stats=stats[r], eplb_gathered=gathered[r])
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        comb = (recv.float() * expert_weight(r)).to(torch.bfloat16)
        return job.planes[r].combine(comb, T, T, pl, False)

    def values(it):
        return [torch.arange(num_stats, dtype=torch.int32) * (r + 1) + 100 * it - r for r in range(ep_size)]

    for it in range(3):  # eager
        vals = values(it)
        for r in range(ep_size):
            stats[r].copy_(vals[r])
        outs = job.on_ranks(step)
        job.join()
        torch.cuda.synchronize()
        for r in range(ep_size):
            assert torch.equal(gathered[r].cpu(), torch.stack(vals)), f"rank {r} eager round {it}"
            close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
            job.planes[r].check_input()
    graphs, outs = [], []
    for r in range(ep_size):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=job.streams[r]):
            outs.append(step(r))
        graphs.append(g)
    torch.cuda.synchronize()
    for it in range(3, 8):  # replays: the statistics of the moment, no host sync in the round
        vals = values(it)
        for r in range(ep_size):
            stats[r].copy_(vals[r])
        job.on_ranks(lambda r: graphs[r].replay())
        job.join()
        torch.cuda.synchronize()
        for r in range(ep_size):
            assert torch.equal(gathered[r].cpu(), torch.stack(vals)), f"rank {r} replay {it}"
            close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)


def _fp8_reference(job, experts, x):
    """The FP8 combine by its definition (host_plane.quantize_fp8): token t's rows at its
    targets q (bf16(x[t] * expert_weight(q))) quantized unless q is the token's own rank, summed
    in float32 over ascending k, bf16 out. ``experts[s]``, ``x[s]`` per source s."""
    from a2ad.client.host_plane import dequantize_fp8, quantize_fp8

    hidden = x[0].shape[1]
    out = []
    for s in range(job.ep_size):
        xs = x[s].cpu()
        acc = torch.zeros(xs.shape[0], hidden, dtype=torch.float32)
        for t, tg in enumerate(routes(experts[s].cpu(), job.num_experts, job.ep_size)):
            for q in tg:
                row = (xs[t].float() * expert_weight(q)).to(torch.bfloat16)
                acc[t] += row.float() if q == s else dequantize_fp8(quantize_fp8(row[None]), hidden)[0]
        out.append(acc.to(torch.bfloat16))
    return out


@pytest.mark.parametrize("lines_tail", [True, False], ids=["tail", "no-tail"])
def test_small_combine_lines_only_where_rows_have_a_tail(make_job, lines_tail):
    """Rows without a lines tail (a caller-owned workspace; make_plan's lines_tail 0): a small
    combine takes the plain path and leaves everything past the rows as it was; with one, the
    lines path. Both combine right: bf16, and FP8 bit for bit to its definition."""
    from torch.profiler import ProfilerActivity, profile

    ep_size, T, top_k, E, hidden = 2, 8, 4, 16, 256
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden + L.fp8_row_bytes(hidden),
                   lines_tail=lines_tail)
    assert (job.lines_tail != 0) == lines_tail
    past = [job._buf[r * job.row_stride + job.size : (r + 1) * job.row_stride].clone() for r in range(ep_size)]
    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    for low_precision in (False, True):
        e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
        x = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(ep_size)]

        def step(r):
            job.planes[r].dispatch(e[r], [x[r].view(torch.uint8), e[r].view(torch.uint8)], T, pl, E)
            recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
            comb = (recv.float() * expert_weight(r)).bfloat16()
            return job.planes[r].combine(comb, T, T, pl, False, low_precision=low_precision)

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = job.on_ranks(step)
            job.join()
            torch.cuda.synchronize()
        assert combine_paths(prof) == [2 if lines_tail else 1] * ep_size, low_precision
        for r in range(ep_size):
            job.planes[r].check()
            if low_precision:
                assert torch.equal(outs[r].cpu(), _fp8_reference(job, e, x)[r]), r
            else:
                close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
    if not lines_tail:
        for r in range(ep_size):
            assert torch.equal(job._buf[r * job.row_stride + job.size : (r + 1) * job.row_stride], past[r]), r


def _fp8_round_inputs(make_job, ep_size, hidden, T, top_k=4, E=16):
    """A job sized for the FP8 combine's rows and a round of T bf16 tokens on every rank: (job,
    layout, expert ids, x, E)."""
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden + L.fp8_row_bytes(hidden))
    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep_size)]
    return job, pl, e, x, E


def _lines_words(job, r, n):
    """The first n u64 words of rank r's lines (past its lines tail's heads): (rounds, data halves as
    uint8 [n, 4])."""
    a = L.LINE_HEADS_BYTES
    words = job.tail(r)[a : a + 8 * n].view(torch.int64).cpu()
    lo = words & 0xFFFFFFFF
    data = torch.where(lo >= 1 << 31, lo - (1 << 32), lo).to(torch.int32).contiguous().view(torch.uint8)
    return (words >> 32) & 0xFFFFFFFF, data.view(n, 4)


# (2, 2880, 96): lines as FP8 (622 KB), not as bf16 (1.1 MB); (2, 2880, 128): neither (FP8 829 KB);
# (3, 256, 5): two sources per rank
@pytest.mark.parametrize("ep_size,hidden,T", [(2, 2880, 8), (3, 256, 5), (2, 2880, 96), (2, 2880, 128)])
def test_fp8_lines_carry_quantize_fp8(make_job, ep_size, hidden, T):
    """An FP8 combine whose lines fit (layout.combine_lines_bytes, COMBINE_LINES_FP8_BYTES) stages
    FP8 lines: rank r's lines hold, for every other source s (source index s - (s > r)) and every
    slot, host_plane.quantize_fp8's e4m3 bytes of its payload row, 4 beside the round in each word,
    and past them a scale word per 32-element block, the round beside its scale byte; the output is exact to its definition. One
    whose FP8 lines do not fit takes the plain path, exact too. The bf16 combine of the same rows
    takes the lines only where its own (twice the bytes) fit."""
    from torch.profiler import ProfilerActivity, profile

    from a2ad.client.host_plane import quantize_fp8

    job, pl, e, x, E = _fp8_round_inputs(make_job, ep_size, hidden, T)
    payload = {}
    for low in (True, False):

        def step(r):
            job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E)
            recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
            payload[r] = (recv.float() * expert_weight(r)).to(torch.bfloat16)
            return job.planes[r].combine(payload[r], T, T, pl, False, low_precision=low)

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = job.on_ranks(step)
            job.join()
            torch.cuda.synchronize()
        limit = L.COMBINE_LINES_FP8_BYTES if low else L.COMBINE_LINES_BYTES
        fits = L.combine_lines_bytes(ep_size, T, hidden, 2, low_precision=low) <= limit
        assert fits == (T < 96 or (low and T == 96))
        assert combine_paths(prof) == [2 if fits else 1] * ep_size, low
        if not low or not fits:
            for r in range(ep_size):
                job.planes[r].check()
                if low:
                    assert torch.equal(outs[r].cpu(), _fp8_reference(job, e, x)[r]), r
                else:
                    close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
            continue
        want_out = _fp8_reference(job, e, x)
        n = (ep_size - 1) * T * hidden // 8  # lines, each two words
        blocks = hidden // L.FP8_BLOCK
        for r in range(ep_size):
            job.planes[r].check()
            assert torch.equal(outs[r].cpu(), want_out[r]), r
            round_ = job.flag_val(r) - 1
            rounds, data = _lines_words(job, r, 2 * n + n // 4)
            assert (rounds == round_).all(), r
            others = [s for s in range(ep_size) if s != r]
            want = quantize_fp8(payload[r].cpu())[others]  # [ep - 1, T, fp8_row_bytes]
            assert torch.equal(data[: 2 * n].reshape(ep_size - 1, T, hidden), want[..., :hidden]), r
            scale_words = data[2 * n :]
            assert not scale_words[:, 1:].any(), r  # (the scale byte alone)
            scale_bytes = scale_words[:, 0].reshape(ep_size - 1, T, blocks)
            assert torch.equal(scale_bytes, want[..., hidden : hidden + blocks]), r


@pytest.mark.parametrize("in_workspace", [False, True], ids=["staged", "in-workspace"])
# (2, 2880, 512): more pull items than warps (a warp pulls several tokens) and a staging of
# more than one pass over the grid.
@pytest.mark.parametrize("ep_size,hidden,T", [(2, 2880, 33), (2, 7168, 5), (4, 4096, 64), (2, 256, 0),
                                              (2, 2880, 512)])
def test_fp8_combine_exact_to_its_definition(make_job, in_workspace, ep_size, hidden, T):
    top_k, E = 4, 16
    rt = max(T, 1)
    job = make_job(ep_size, rt, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden + L.fp8_row_bytes(hidden))
    pl = job.layout(rt, [2 * hidden, 4 * top_k], 2 * hidden)
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep_size)]

    def dispatch(r):
        job.planes[r].dispatch(e[r], [x[r], e[r]], rt, pl, E)

    def combine(r, low):
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        if in_workspace:
            comb = job.region(r, pl.combine_offset, 2 * hidden).view(torch.bfloat16)
            torch.mul(recv, expert_weight(r), out=comb)
        else:
            comb = (recv.float() * expert_weight(r)).to(torch.bfloat16)
        out = torch.empty(T, hidden, dtype=torch.bfloat16, device="cuda")
        got = job.planes[r].combine(comb, T, rt, pl, in_workspace, output=out, low_precision=low)
        assert got.data_ptr() == out.data_ptr()
        return out

    results = {}
    for low in (False, True):
        job.on_ranks(dispatch)
        results[low] = job.on_ranks(lambda r: combine(r, low))
        job.join()
    torch.cuda.synchronize()
    want = _fp8_reference(job, e, x)
    worst = 0.0
    for r in range(ep_size):
        job.planes[r].check_input()
        got = results[True][r].cpu()
        differ = int((got != want[r]).sum())
        assert differ == 0, f"rank {r}: {differ} elements of the FP8 combine differ from its definition"
        bf = results[False][r].cpu().float()
        if T:
            worst = max(worst, float((got.float() - bf).abs().max()) / max(float(bf.abs().max()), 1e-30))
    print(f"FP8 combine (CUDA, ep {ep_size}, hidden {hidden}, T {T}): max error / max |bf16 output| {worst:.4g}")
    assert worst <= 0.0625


def test_caller_mask_device_tensor_in_graphs(make_job):
    """Ranks 0-2 of 4 run rounds with a device mask without rank 3 (which runs nothing), eager
    and captured in CUDA graphs: tokens for rank 3's experts go nowhere, nobody waits for it."""
    ep_size, T, top_k, E, hidden = 4, 16, 4, 16, 128
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden)
    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    active = [0, 1, 2]
    mask = torch.tensor([0b0111], dtype=torch.int64, device="cuda")
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep_size)]
    step = _masked_step(job, e, x, pl, E, T, mask)

    def reference(r):
        return _masked_reference(e[r], x[r], E, ep_size, active)

    outs = job.on_ranks(step, ranks=active)
    job.join(ranks=active)
    torch.cuda.synchronize()
    for r in active:
        close(outs[r], reference(r), torch.bfloat16)
    graphs, gouts = {}, {}
    for r in active:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=job.streams[r]):
            gouts[r] = step(r)
        graphs[r] = g
    for _ in range(3):
        job.on_ranks(lambda r: graphs[r].replay(), ranks=active)
        job.join(ranks=active)
        torch.cuda.synchronize()
        for r in active:
            close(gouts[r], reference(r), torch.bfloat16)
            job.planes[r].check()
            job.planes[r].check_input()


# ---------------------------------------------------------------------------
# Narrow checks: each names one stage (which region, which record, which bytes)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ep_size", [2, 3])
def test_dispatch_error_raised_before_the_combine_is_the_rounds_only_error(make_job, ep_size):
    """As a client does it: the dispatch's spec mismatch is raised (and cleared) before the
    round's combine runs; that combine (whose widths differ too) returns zeros and leaves no
    second record: the next check raises nothing and the next round is exact."""
    T, top_k, E = 8, 2, 8
    job = make_job(ep_size, T, top_k, E, 2 * 64 + 4 * top_k, 2 * 64)
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    hid = [7 if r == 0 else 8 for r in range(ep_size)]
    x = [torch.randn(T, hid[r], device="cuda").to(torch.bfloat16) for r in range(ep_size)]
    pls = [L.payload_layout(job.aux, job.size, T, [2 * hid[r], 4 * top_k], 2 * hid[r],
                            dtypes=[torch.bfloat16, torch.int32]) for r in range(ep_size)]
    job.on_ranks(lambda r: job.planes[r].dispatch(e[r], [x[r], e[r]], T, pls[r], E))
    job.join()
    words = {r: ["input_payloads[0] bytes per token"] for r in range(ep_size)}
    _raises_on_every_rank(job, words)  # raised and cleared before any combine
    outs = job.on_ranks(lambda r: job.planes[r].combine(
        torch.ones(ep_size, T, hid[r], dtype=torch.bfloat16, device="cuda"), T, T, pls[r], False))
    job.join()
    torch.cuda.synchronize()
    for r in range(ep_size):
        assert not bool(outs[r].any()), f"rank {r}: a round with mismatched payloads returned data"
        job.planes[r].check_input()  # no second record (the combine's) from the same round
    _good_round(job)


@pytest.mark.parametrize("ep_size,num_stats,hidden", [(1, 5, 64), (2, 1, 20), (2, 7, 64), (4, 256, 128)])
def test_dispatch_with_eplb_bytes_of_every_region(make_job, ep_size, num_stats, hidden):
    """One dispatch with the EPLB region (one rank to itself too; widths not a multiple of 16):
    the payload regions (after the EPLB region) hold every token's bytes at the slot its
    source's routing names, RECV_SPECS of every row hold every source's descriptor, the raw EPLB
    region of every row holds every source's statistics, the gathered tensor is that region,
    and the round's combine is exact."""
    torch.manual_seed(1234 + ep_size * 10 + num_stats)
    T, top_k, E = 12, 4, 16
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k + 4 * num_stats, 2 * hidden)
    pl = L.payload_layout(job.aux, job.size, T, [2 * hidden, 4 * top_k], 2 * hidden,
                          dtypes=[torch.bfloat16, torch.int32], eplb_stats_num_experts=num_stats)
    assert pl.eplb_offset == job.aux.payload_data and pl.dispatch_offsets[0] >= pl.eplb_offset + 4 * ep_size * num_stats
    job.rt = T
    tokens = [T - r for r in range(ep_size)]
    e = [rand_experts(tokens[r], top_k, E) for r in range(ep_size)]
    x = [torch.randn(tokens[r], hidden, device="cuda").to(torch.bfloat16) for r in range(ep_size)]
    vals = [torch.arange(num_stats, dtype=torch.int32, device="cuda") * (r + 3) - 50 * r for r in range(ep_size)]
    gathered = [torch.full((ep_size, num_stats), -1, dtype=torch.int32, device="cuda") for _ in range(ep_size)]
    job.on_ranks(lambda r: job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E, eplb_local_stats=vals[r],
                                                  eplb_gathered=gathered[r]))
    job.join()
    torch.cuda.synchronize()
    for r in range(ep_size):
        job.planes[r].check_input()
    payloads = [[x[r].view(torch.uint8).view(tokens[r], -1), e[r].view(torch.uint8).view(tokens[r], -1)]
                for r in range(ep_size)]
    check_dispatch(job, e, payloads, pl)
    want_stats = torch.stack([v.cpu() for v in vals])
    spec = torch.tensor(pl.spec, dtype=torch.int32)
    for r in range(ep_size):
        specs = job.i32(r, job.aux.recv_specs, L.SPEC_WORDS * ep_size).cpu().view(ep_size, L.SPEC_WORDS)
        for s in range(ep_size):
            assert torch.equal(specs[s], spec), f"rank {r}: RECV_SPECS[{s}] {specs[s].tolist()} != {pl.spec}"
        region = job.i32(r, pl.eplb_offset, ep_size * num_stats).cpu().view(ep_size, num_stats)
        assert torch.equal(region, want_stats), f"rank {r}: the EPLB region of its row"
        assert torch.equal(gathered[r].cpu(), want_stats), f"rank {r}: eplb_gathered"

    def combine(r):
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        return job.planes[r].combine((recv.float() * expert_weight(r)).to(torch.bfloat16), tokens[r], T, pl, False)

    outs = job.on_ranks(combine)
    job.join()
    torch.cuda.synchronize()
    for r in range(ep_size):
        close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)
        job.planes[r].check_input()


@pytest.mark.parametrize("device_mask", [False, True], ids=["cpu-mask", "device-mask"])
def test_caller_mask_dispatch_bytes_and_untouched_row(make_job, device_mask):
    """Ranks 0-2 of 4 dispatch with a mask without rank 3 (which runs nothing): at each active
    rank the rows from each active source are that source's tokens for it, at the slots its
    routing names; nothing comes from rank 3 (count 0); rank 3's whole row is left as it was."""
    torch.manual_seed(77)
    ep_size, T, top_k, E, hidden = 4, 10, 4, 16, 32
    job = make_job(ep_size, T, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden)
    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    active = [0, 1, 2]
    mask = torch.tensor([0b0111], dtype=torch.int64, device="cuda" if device_mask else "cpu")
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(torch.bfloat16) for _ in range(ep_size)]
    torch.cuda.synchronize()
    row3 = job.ws[3].cpu().clone()
    job.on_ranks(lambda r: job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E, caller_mask=mask), ranks=active)
    job.join(ranks=active)
    torch.cuda.synchronize()
    own = owners(E, ep_size)
    for r in active:
        counts = job.recv_counts(r)
        assert counts[3].item() == 0, f"rank {r}: RECV_COUNTERS[3] = {counts[3].item()} from the excluded rank"
        region = job.region(r, pl.dispatch_offsets[0], 2 * hidden).cpu()
        for s in active:
            toks = [t for t, tg in enumerate(routes(e[s].cpu(), E, ep_size)) if r in tg]
            assert counts[s].item() == len(toks), f"rank {r}: RECV_COUNTERS[{s}]"
            slot = job.i32(s, job.aux.topk_send_indices, T * L.MAX_TOP_K).view(T, L.MAX_TOP_K).cpu()
            tgt = job.i32(s, job.aux.topk_target_ranks, T * L.MAX_TOP_K).view(T, L.MAX_TOP_K).cpu()
            xs = x[s].cpu().view(torch.uint8).view(T, -1)
            for t in toks:
                ks = [k for k in range(top_k) if int(tgt[t, k]) == r]
                assert len(ks) == 1, f"source {s} token {t}: {ks} sends to {r}"
                j = int(slot[t, ks[0]])
                assert 0 <= j < counts[s].item(), f"source {s} token {t}: slot {j} at {r}"
                assert torch.equal(region[s, j], xs[t]), f"rank {r}: slot {j} from {s} is not token {t}"
        # tokens for rank 3's experts got no slot
        for t in range(T):
            for k in range(top_k):
                if own[int(e[r][t, k])] == 3:
                    sl = int(job.i32(r, job.aux.topk_send_indices, T * L.MAX_TOP_K).view(T, L.MAX_TOP_K)[t, k])
                    assert sl == -1, f"rank {r} token {t} k {k}: slot {sl} at the excluded rank"
    assert torch.equal(job.ws[3].cpu(), row3), "the excluded rank's row was written"
    # the round's combine among the active ranks (clears the round for the fixture's close)
    outs = job.on_ranks(lambda r: job.planes[r].combine(
        (job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16).float() * expert_weight(r)).to(
            torch.bfloat16), T, T, pl, False, caller_mask=mask), ranks=active)
    job.join(ranks=active)
    torch.cuda.synchronize()
    for r in active:
        close(outs[r], _masked_reference(e[r], x[r], E, ep_size, active), torch.bfloat16)
    assert torch.equal(job.ws[3].cpu(), row3), "the excluded rank's row was written by the combine"


def _staged_sources(job, r, payload):
    """For every source s != r of rank r: (s, the rows s sent to r (RECV_COUNTERS), rank r's
    combine payload rows of s on the CPU): what r's staging copies for s."""
    counts = job.recv_counts(r)
    src = payload.cpu()
    return [(s, counts[s].item(), src[s]) for s in range(job.ep_size) if s != r]


@pytest.mark.parametrize("in_workspace", [False, True], ids=["staged", "in-workspace"])
# (T: a round too big for the FP8 combine lines, layout.combine_lines_bytes > COMBINE_LINES_FP8_BYTES:
# only such a round stages FP8 rows into the FP8 region; a smaller one stages them as lines,
# which test_fp8_lines_carry_quantize_fp8 checks)
@pytest.mark.parametrize("ep_size,hidden,T", [(2, 256, 2056), (3, 2880, 96)])
def test_fp8_staged_rows_are_quantize_fp8(make_job, in_workspace, ep_size, hidden, T):
    """After an FP8 combine, each rank's FP8 region (layout.fp8_combine_offset) holds, for every
    source s != itself and every row s sent (RECV_COUNTERS), exactly host_plane.quantize_fp8 of
    the bf16 payload row: a difference here is the staging (quantizer), elsewhere the pull."""
    from a2ad.client.host_plane import quantize_fp8

    assert L.combine_lines_bytes(ep_size, T, hidden, 2, low_precision=True) > L.COMBINE_LINES_FP8_BYTES
    torch.manual_seed(99 + hidden)
    job, pl, e, x, E = _fp8_round_inputs(make_job, ep_size, hidden, T)
    payload = {}

    def step(r):
        job.planes[r].dispatch(e[r], [x[r], e[r]], T, pl, E)
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        if in_workspace:
            comb = job.region(r, pl.combine_offset, 2 * hidden).view(torch.bfloat16)
            torch.mul(recv, expert_weight(r), out=comb)
        else:
            comb = (recv.float() * expert_weight(r)).to(torch.bfloat16)
        payload[r] = comb
        return job.planes[r].combine(comb, T, T, pl, in_workspace, low_precision=True)

    job.on_ranks(step)
    job.join()
    torch.cuda.synchronize()
    row8 = L.fp8_row_bytes(hidden)
    for r in range(ep_size):
        job.planes[r].check_input()
        off = L.fp8_combine_offset(pl, ep_size, hidden, in_workspace)
        fp8 = job.ws[r, off : off + ep_size * T * row8].view(ep_size, T, row8).cpu()
        for s, n, src in _staged_sources(job, r, payload[r]):
            want = quantize_fp8(src[:n])
            assert want.shape == (n, row8)
            bad = (fp8[s, :n] != want).any(1).nonzero().flatten().tolist()
            assert not bad, f"rank {r}: FP8 rows {bad} staged for source {s} differ from quantize_fp8"

#: A plain staging of more bytes than this (csrc/combine.cu, kStageAllSlotsBytes) copies only the
#: rows each source sent (RECV_COUNTERS), not every slot.
STAGE_ALL_SLOTS_BYTES = 1 << 20


@pytest.mark.parametrize("low_precision", [False, True], ids=["bf16", "fp8"])
# (hidden 2048: every staging thread's or warp's share is loaded before the count; 7168: a bf16
# thread has more vectors than the 8 it loads before the count, an FP8 warp two or three items,
# of which only the first is loaded before it, so the copies after the count run too)
@pytest.mark.parametrize("hidden", [2048, 7168], ids=["h2048", "h7168"])
def test_plain_staging_stores_exactly_the_received_rows(make_job, low_precision, hidden):
    """A plain combine that stages more than every slot's worth allows copies, for each source s,
    the rows s sent (RECV_COUNTERS), its first loads issued before that count is in: what they
    read past it is dropped. Uneven token counts (a rank that sends nothing, one that sends a
    few, rt > T), two rounds with the counts moved between ranks: each rank's combine region
    (bf16, or the FP8 region) holds the payload's rows [0, n) of every other source s, as
    host_plane.quantize_fp8 gives them for FP8, and its slots past n keep what they held before
    the round; the outputs match the reference (FP8: bit for bit its definition)."""
    from torch.profiler import ProfilerActivity, profile

    from a2ad.client.host_plane import quantize_fp8

    ep_size, top_k, E, rt = 4, 4, 16, 128
    assert STAGE_ALL_SLOTS_BYTES < (ep_size - 1) * rt * 2 * hidden < 16 << 20  # neither every slot nor overlapped
    row8 = L.fp8_row_bytes(hidden)
    job = make_job(ep_size, rt, top_k, E, 2 * hidden + 4 * top_k, 2 * hidden + row8)
    pl = job.layout(rt, [2 * hidden, 4 * top_k], 2 * hidden)
    if low_precision:
        off, width = L.fp8_combine_offset(pl, ep_size, hidden, False), row8
    else:
        off, width = pl.combine_offset, 2 * hidden
    sentinel = 0x5A
    for tokens in ([rt, 5, 0, 77], [0, rt - 1, 77, 5]):
        e = [rand_experts(t, top_k, E) for t in tokens]
        x = [torch.randn(t, hidden, device="cuda").bfloat16() for t in tokens]
        for r in range(ep_size):
            job.region(r, off, width).fill_(sentinel)
        payload = {}

        # Every rank's dispatch is queued before any rank's torch ops, as run_round does. Queued
        # between rank 0's dispatch and rank 1's, the process's first bf16 -> float conversion (when
        # this test ran first in its process) kept rank 1's dispatch from running while rank 0's
        # waited for it in its kernel, until that wait timed out, eager module loading or not.
        def dispatch(r):
            job.planes[r].dispatch(e[r], [x[r].view(torch.uint8), e[r].view(torch.uint8)], rt, pl, E)

        def combine(r):
            recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
            payload[r] = (recv.float() * expert_weight(r)).bfloat16()
            return job.planes[r].combine(payload[r], tokens[r], rt, pl, False, low_precision=low_precision)

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            job.on_ranks(dispatch)
            outs = job.on_ranks(combine)
            job.join()
            torch.cuda.synchronize()
        assert combine_paths(prof) == [1] * ep_size, f"tokens {tokens}: not the plain combine"
        want_fp8 = _fp8_reference(job, e, x) if low_precision else None
        for r in range(ep_size):
            job.planes[r].check()
            region = job.region(r, off, width).cpu()
            for s, n, src in _staged_sources(job, r, payload[r]):
                assert n == sum(1 for tg in routes(e[s].cpu(), E, ep_size) if r in tg), (tokens, r, s)
                want = quantize_fp8(src[:n]) if low_precision else src[:n].contiguous().view(torch.uint8)
                assert torch.equal(region[s, :n], want), f"tokens {tokens}: rank {r}, the rows staged for source {s}"
                assert bool((region[s, n:] == sentinel).all()), (
                    f"tokens {tokens}: rank {r} wrote slots past the {n} rows source {s} sent")
            assert outs[r].shape == (tokens[r], hidden)
            if low_precision:
                assert torch.equal(outs[r].cpu(), want_fp8[r]), f"tokens {tokens}: rank {r}, FP8 combine"
            else:
                close(outs[r], combine_reference(job, e[r], x[r]), torch.bfloat16)

