"""Degraded mode on the CUDA kernels (docs/PROTOCOL.md, "Degraded mode"), in one process.

A job of three ranks on one GPU (the in-process job of test_cuda_kernels.py, created with
``on_peer_loss="degrade"``): the daemon's side of degraded mode is played on the control
block directly (clearing a rank's bit, a replacement's ``ADMIT_JOINED`` and its row
re-initialized), the ranks' side by the kernels. Every round is checked against a float64
reference that counts exactly the ranks the combine reports, and the per-token indicator
against the tokens that had an expert elsewhere.
"""

from __future__ import annotations

import time

import pytest
import torch

from a2ad import errors, layout as L

from test_cuda_kernels import close, expert_weight, make_job, rand_experts, routes  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EP, T, TOP_K, EXPERTS, HIDDEN = 3, 24, 4, 12, 256
FULL = L.full_mask(EP)


def _job(make_job):
    job = make_job(EP, T, TOP_K, EXPERTS, 2 * HIDDEN, 2 * HIDDEN, on_peer_loss="degrade")
    pl = job.layout(T, [2 * HIDDEN], 2 * HIDDEN)
    return job, pl


def _inputs(gen):
    experts = rand_experts(T, TOP_K, EXPERTS, gen=gen)
    x = torch.randn(T, HIDDEN, device="cuda", generator=gen).bfloat16()
    return experts, x


def _reference(job, experts, x, counted: int):
    """(float64 output, bool indicator) when only the ranks in ``counted`` contribute."""
    route = routes(experts.cpu(), job.num_experts, job.ep_size)
    w = torch.tensor([sum(expert_weight(q) for q in tg if counted >> q & 1) for tg in route], dtype=torch.float64)
    lost = torch.tensor([any(not counted >> q & 1 for q in tg) for tg in route])
    return x.cpu().double() * w[:, None], lost


def _dispatch(job, pl, inputs):
    def run(r):
        experts, x = inputs[r]
        job.planes[r].dispatch(experts, [x.view(torch.uint8)], T, pl, job.num_experts)

    return run


def _combine(job, pl, inputs):
    def run(r):
        recv = job.region(r, pl.dispatch_offsets[0], 2 * HIDDEN).view(torch.bfloat16)
        comb = (recv.float() * expert_weight(r)).bfloat16()
        return job.planes[r].combine(comb, inputs[r][0].shape[0], T, pl, False)

    return run


def _round(job, pl, inputs, ranks):
    job.on_ranks(_dispatch(job, pl, inputs), ranks)
    outs = job.on_ranks(_combine(job, pl, inputs), ranks)
    job.join(ranks)
    # not torch.cuda.synchronize(): a replacement's stream may be waiting, in its kernel, to be let in
    torch.cuda.current_stream().synchronize()
    return outs


def _check(job, inputs, outs, ranks, counted):
    for r in ranks:
        experts, x = inputs[r]
        ref, lost = _reference(job, experts, x, counted)
        close(outs[r], ref, torch.bfloat16)
        assert job.planes[r].round_mask() == counted, (r, job.planes[r].round_mask(), counted)
        words = job.planes[r].round_mask_tensor()
        assert words.shape == (L.MASK_WORDS,) and L.mask_from_words(words.tolist()) == counted, r
        assert torch.equal(job.planes[r].degraded_tokens().cpu(), lost), r
        job.planes[r].check()


def _row_admit(job, rank):
    """Rank ``rank``'s row admit word (SLOT_ADMIT_ROUND of its BLOCK_COUNTERS), as an int32 view."""
    off = job.aux.block_counters + 4 * L.SLOT_ADMIT_ROUND
    return job.ws[rank, off: off + 4].view(torch.int32)


def _let_in_replacement(job, rank, in_row=False):
    """What the daemon does when a replacement joins a degrade job that serves: its row
    re-initialized, its admit round ADMIT_JOINED, then its bit set. ``in_row``: as in a job
    that spans nodes, the admit round in the replacement's row (ADMIT_JOINED there) and
    ADMIT_ROW in the control block."""
    from a2ad.client.cuda_plane import initialize_row

    torch.cuda.synchronize()
    initialize_row(job.ws, rank, job.aux, lines_tail=job.lines_tail)
    job.planes[rank].reset_status()
    if in_row:
        _row_admit(job, rank).fill_(L.ADMIT_JOINED)
    torch.cuda.synchronize()
    job.control.set_admit_round(rank, L.ADMIT_ROW if in_row else L.ADMIT_JOINED)
    job.control.set_active_mask(FULL, EP, time.monotonic_ns())


def _admit_round(job, rank):
    a = job.control.admit_round(rank)
    return int(_row_admit(job, rank).item()) if a == L.ADMIT_ROW else a


def _serve_until_admitted(job, pl, gen, ranks, rank, rounds=6):
    """Rounds among ``ranks`` (checked) until ``rank``'s admit round is set; returns it."""
    for _ in range(rounds):
        inputs = {r: _inputs(gen) for r in ranks}
        outs = _round(job, pl, inputs, ranks)
        _check(job, inputs, outs, ranks, FULL & ~(1 << rank))
        admit = _admit_round(job, rank)
        if admit >= 0:
            return admit
    raise AssertionError(f"rank {rank} was not let in within {rounds} rounds (admit round {admit})")


@pytest.mark.parametrize("in_row", [False, True], ids=["control-block", "row"])
def test_rounds_without_a_lost_rank_then_its_replacement(make_job, in_row):
    """A full round; rank 2 leaves the mask before a round: rounds among ranks 0 and 1 drop
    the tokens' sends to it, count nothing from it and mark exactly those tokens; a
    replacement joins as rank 2: its first dispatch waits (in the kernel) to be let in,
    the lowest rank lets it in at the next round, and that round runs on all three. With
    ``in_row`` its admit round is agreed in its row, as across nodes: the replacement asks
    there (ADMIT_READY), the lowest rank writes the round there, the control block keeps
    ADMIT_ROW."""
    job, pl = _job(make_job)
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = {r: _inputs(gen) for r in range(EP)}
    _check(job, inputs, _round(job, pl, inputs, range(EP)), range(EP), FULL)

    job.control.set_active_mask(FULL & ~(1 << 2), EP, time.monotonic_ns())
    for _ in range(3):
        inputs = {r: _inputs(gen) for r in (0, 1)}
        _check(job, inputs, _round(job, pl, inputs, [0, 1]), [0, 1], 0b011)
    # nothing was sent to rank 2: no send counted for it at the survivors
    assert all(int(job.recv_counts(r)[2]) == 0 for r in (0, 1))

    _let_in_replacement(job, 2, in_row)
    first = {2: _inputs(gen)}
    job.on_ranks(_dispatch(job, pl, first), [2])  # waits in its prologue until let in
    admit = _serve_until_admitted(job, pl, gen, [0, 1], 2)
    assert job.flag_val(0) == job.flag_val(1) == admit
    if in_row:
        assert job.control.admit_round(2) == L.ADMIT_ROW and int(_row_admit(job, 2).item()) == admit
    inputs = {0: _inputs(gen), 1: _inputs(gen), 2: first[2]}
    job.on_ranks(_dispatch(job, pl, inputs), [0, 1])
    outs = job.on_ranks(_combine(job, pl, inputs), range(EP))
    job.join(range(EP))
    torch.cuda.current_stream().synchronize()
    _check(job, inputs, outs, range(EP), FULL)
    assert all(job.flag_val(r) == admit + 1 for r in range(EP))
    inputs = {r: _inputs(gen) for r in range(EP)}
    _check(job, inputs, _round(job, pl, inputs, range(EP)), range(EP), FULL)


def test_a_rank_lost_while_the_others_wait_for_it(make_job):
    """Rank 2 stops before its dispatch while ranks 0 and 1 already wait for its ready word
    (their view still holds it): once its bit is cleared their waits let it go without a
    failure, the round completes counting only 0 and 1, and the tokens routed to rank 2 are
    marked. Rank 2 itself, still running, is then told it is no longer active."""
    job, pl = _job(make_job)
    gen = torch.Generator(device="cuda").manual_seed(8)
    inputs = {r: _inputs(gen) for r in range(EP)}
    _check(job, inputs, _round(job, pl, inputs, range(EP)), range(EP), FULL)

    inputs = {r: _inputs(gen) for r in (0, 1)}
    job.on_ranks(_dispatch(job, pl, inputs), [0, 1])
    time.sleep(0.3)
    assert not job.streams[0].query(), "rank 0's dispatch should still wait for rank 2"
    t0 = time.monotonic()
    job.control.set_active_mask(FULL & ~(1 << 2), EP, time.monotonic_ns())
    outs = job.on_ranks(_combine(job, pl, inputs), [0, 1])
    job.join([0, 1])
    torch.cuda.synchronize()
    let_go = time.monotonic() - t0
    print(f"\nthe waits let rank 2 go {let_go * 1e3:.1f} ms after its bit was cleared")
    assert let_go < 5.0
    _check(job, inputs, outs, [0, 1], 0b011)
    assert all(int(job.recv_counts(r)[2]) == 0 for r in (0, 1))

    job.on_ranks(_dispatch(job, pl, {2: _inputs(gen)}), [2])
    job.join([2])
    torch.cuda.synchronize()
    with pytest.raises(errors.PeerLost, match="no longer one of the job's active ranks"):
        job.planes[2].check()


def _rank_on_a_second_node(job, rank, timeout):
    """Rank ``rank``'s plane on a control block of its own (its own node's): the first node's
    block can clear its bit while its own keeps it. Returns the block and a closer."""
    import mmap

    from a2ad.client.cuda_plane import CudaPlane
    from a2ad.control import ControlBlock

    mm = mmap.mmap(-1, L.CONTROL_BLOCK_SIZE)
    cb = ControlBlock(mm, owner=mm)
    cb.initialize(job.ep_size, L.POLICY_CODES["degrade"])
    att = job.att(rank)
    att.control = cb
    torch.cuda.synchronize()
    job.planes[rank].close()
    job.planes[rank] = CudaPlane(att, timeout, sm_budget=job.budget)

    def close():
        torch.cuda.synchronize()
        job.planes[rank].close()
        cb.close()

    return cb, close


@pytest.mark.parametrize("part", ["let-go-in-dispatch", "left-behind"])
def test_a_rank_dropped_while_alive_never_completes_a_round_with_outputs_not_meant_for_it(make_job, part):
    """Three ranks, two nodes (ranks 0 and 1 on the job's control block, rank 2 on a block of
    its own); the first node counts rank 2 lost (its bit cleared there) while rank 2 runs on
    with a whole view, as when its daemon stalls. let-go-in-dispatch: ranks 0 and 1 let rank 2
    go in their dispatch before its tokens came, so their combine flags it with the void
    descriptor: rank 2's combine ends at once (well within its 1 s timeout) counting only
    itself, instead of pulling rows computed from slots it never filled, and marks the tokens
    that had an expert on ranks 0 or 1 (as on the host plane, tests/test_degraded.py).
    left-behind: ranks 0 and 1 finish a round with rank 2 (its tokens came), then run the next
    round without it, restaging their regions, before rank 2 pulls: rank 2's next dispatch
    does not run, and it raises PeerLost "left behind" naming rank 0."""
    job, pl = _job(make_job)
    gen = torch.Generator(device="cuda").manual_seed(12)
    cb2, close2 = _rank_on_a_second_node(job, 2, timeout=1.0)
    try:
        inputs = {r: _inputs(gen) for r in range(EP)}
        _check(job, inputs, _round(job, pl, inputs, range(EP)), range(EP), FULL)
        inputs = {r: _inputs(gen) for r in range(EP)}
        if part == "let-go-in-dispatch":
            job.on_ranks(_dispatch(job, pl, inputs), [0, 1])
            time.sleep(0.3)
            assert not job.streams[0].query(), "rank 0's dispatch should still wait for rank 2"
            job.control.set_active_mask(0b011, EP, time.monotonic_ns())
            job.on_ranks(_combine(job, pl, inputs), [0, 1])
            job.join([0, 1])
            torch.cuda.synchronize()
            t = time.monotonic()
            job.on_ranks(_dispatch(job, pl, inputs), [2])  # 0 and 1 flagged their sends to it
            outs = job.on_ranks(_combine(job, pl, inputs), [2])
            job.join([2])
            torch.cuda.synchronize()
            took = time.monotonic() - t
            assert took < 0.5, f"rank 2's round took {took:.2f} s: its combine waited for a flag (timeout 1 s)"
            _check(job, inputs, outs, [2], 0b100)  # its own part only; tokens sent to 0 or 1 marked
            job.planes[2].check_input()  # the void descriptor is no combine mismatch
            return
        job.on_ranks(_dispatch(job, pl, inputs), range(EP))
        job.join(range(EP))
        torch.cuda.synchronize()
        job.on_ranks(_combine(job, pl, inputs), [0, 1])  # they wait for rank 2's combine flag
        time.sleep(0.3)
        assert not job.streams[0].query(), "rank 0's combine should still wait for rank 2"
        job.control.set_active_mask(0b011, EP, time.monotonic_ns())  # let go of rank 2
        job.join([0, 1])
        torch.cuda.synchronize()
        nxt = {r: _inputs(gen) for r in (0, 1)}
        outs = _round(job, pl, nxt, [0, 1])  # their regions restaged, without rank 2
        _check(job, nxt, outs, [0, 1], 0b011)
        job.on_ranks(_combine(job, pl, inputs), [2])  # pulls what was restaged
        job.join([2])
        torch.cuda.synchronize()
        job.planes[2].check()  # the combine itself completed: every flag it waited for came
        flag = job.flag_val(2)
        job.on_ranks(_dispatch(job, pl, {2: _inputs(gen)}), [2])
        job.join([2])
        torch.cuda.synchronize()
        with pytest.raises(errors.PeerLost) as lost:
            job.planes[2].check()
        assert lost.value.details["reason_name"] == "left behind" and lost.value.rank == 0, lost.value
        assert f"went on to round {flag}" in str(lost.value), lost.value
        published = int(job.i32(0, job.aux.dispatch_completion_flags, EP)[2])
        assert published == flag - 1, f"rank 2 published its dispatch of round {published}: that round must not run"
    finally:
        close2()


def test_graphs_captured_before_the_loss_serve_through_it_and_the_replacement(make_job):
    """Dispatch + expert + combine of every rank captured in CUDA graphs while all three
    serve; the graphs are replayed, unchanged, through the loss of rank 2 (rounds among 0
    and 1) and the replacement's admission (its own graph, replayed once its row was
    re-initialized, waits inside the replay to be let in)."""
    job, pl = _job(make_job)
    gen = torch.Generator(device="cuda").manual_seed(9)
    static = {r: _inputs(gen) for r in range(EP)}

    def step(r):
        _dispatch(job, pl, static)(r)
        return _combine(job, pl, static)(r)

    for _ in range(2):  # warm up outside capture
        job.on_ranks(step)
        job.join()
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for r in range(EP):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=job.streams[r]):
            outs[r] = step(r)
        graphs[r] = g
    torch.cuda.synchronize()

    def replay(ranks):
        for r in ranks:  # fresh inputs, on the main stream (every rank's stream waits for it)
            e, x = _inputs(gen)
            static[r][0].copy_(e)
            static[r][1].copy_(x)
        job.on_ranks(lambda r: graphs[r].replay(), ranks)

    def finish(ranks):
        job.join(ranks)
        torch.cuda.current_stream().synchronize()  # only what ranks did: rank 2 may wait to be let in

    for _ in range(3):
        replay(range(EP))
        finish(range(EP))
        _check(job, static, outs, range(EP), FULL)
    job.control.set_active_mask(FULL & ~(1 << 2), EP, time.monotonic_ns())
    for _ in range(5):
        replay([0, 1])
        finish([0, 1])
        _check(job, static, outs, [0, 1], 0b011)

    _let_in_replacement(job, 2)
    replay([2])  # its first round: waits in the graph's prologue until let in
    admit = None
    for _ in range(6):
        replay([0, 1])
        finish([0, 1])
        _check(job, static, outs, [0, 1], 0b011)
        admit = job.control.admit_round(2)
        if admit >= 0:
            break
    assert admit is not None and admit >= 0, "the replacement was not let in"
    replay([0, 1])  # round `admit`: all three
    finish(range(EP))
    _check(job, static, outs, range(EP), FULL)
    for _ in range(3):
        replay(range(EP))
        finish(range(EP))
        _check(job, static, outs, range(EP), FULL)
    assert len({job.flag_val(r) for r in range(EP)}) == 1


# ---------------------------------------------------------------------------
# With the daemon: kill -9 of a rank process whose peers replay CUDA graphs
# ---------------------------------------------------------------------------
D_HIDDEN, D_TOP_K, D_EXPERTS, D_T = 64, 2, 8, 16


def serve_cuda(rank, ep, runtime_dir, job, shared, results, seed, pace=0.0):
    """A rank of a degrade job on CUDA (tests/test_degraded.py's protocol of reports): two
    eager rounds (a replacement's first one is its admission), then dispatch + expert +
    combine captured in one CUDA graph and replayed with fresh inputs until the shared stop
    round; every round checked against the ranks its combine counted, and the indicator."""
    import time as _time

    from test_degraded import _bits, _now, after_round, check_round

    try:
        from a2ad.client import MoeAlltoAll

        torch.set_num_threads(1)
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)

        class M:
            moe_ep_rank, moe_ep_size = rank, ep

        size = L.workspace_size_per_rank(ep, D_T, D_HIDDEN * 4, D_HIDDEN * 4)
        a2a = MoeAlltoAll(M(), D_T, D_TOP_K, D_EXPERTS, size, job=job, runtime_dir=runtime_dir, timeout=20.0,
                          on_peer_loss="degrade", device=dev)
        att = a2a.attachment
        flag = att.workspace[rank, att.aux.flag_val : att.aux.flag_val + 4].view(torch.int32)
        results.put((rank, "attached", _now(), (a2a.generation, a2a.active_ranks)))
        g = torch.Generator().manual_seed(seed)
        s_experts = torch.zeros(D_T, D_TOP_K, dtype=torch.int32, device=dev)
        s_hidden = torch.zeros(D_T, D_HIDDEN, dtype=torch.float32, device=dev)

        def fill():
            experts = torch.rand(D_T, D_EXPERTS, generator=g).argsort(dim=1)[:, :D_TOP_K].to(torch.int32)
            hidden = torch.randint(-8, 9, (D_T, D_HIDDEN), generator=g).to(torch.float32)
            s_experts.copy_(experts)
            s_hidden.copy_(hidden)
            return experts, hidden

        def step():
            (recv,) = a2a.dispatch(s_experts, [s_hidden], D_T)
            return a2a.combine(recv * float(rank + 1), D_T)

        records, n, graph, out = [], 0, None, None
        while True:
            experts, hidden = fill()
            if n < 2:
                out = step()
            else:
                if graph is None:
                    stream = torch.cuda.Stream(dev)
                    stream.wait_stream(torch.cuda.current_stream(dev))
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.stream(stream):
                        with torch.cuda.graph(graph, stream=stream):
                            out = step()
                    torch.cuda.current_stream(dev).wait_stream(stream)
                graph.replay()
            torch.cuda.synchronize(dev)
            done = _now()
            a2a.check()
            rnd = int(flag.item()) - 1
            counted = _bits(a2a.last_round_active_ranks)
            assert L.mask_from_words(a2a.last_round_active_mask.tolist()) == counted
            lost = check_round(rank, rnd, experts, hidden, out.cpu(), a2a.last_round_degraded.cpu(), counted, ep,
                               D_EXPERTS)
            records.append((rnd, done, counted, counted, lost, D_T))
            stop = after_round(rank, n, rnd, done, counted, shared, results)
            n += 1
            if stop:
                break
            if pace:
                _time.sleep(pace)
        results.put((rank, "records", _now(), records))
        a2a.close()
        results.put((rank, "done", _now(), None))
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback

        results.put((rank, "error", 0.0, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@pytest.mark.parametrize("ep", [4, 8])
def test_kill9_while_graphs_replay_then_a_replacement(runtime_dir, ep):
    """4 or 8 ranks of a degrade job on the CUDA backend (sharing the GPUs), each replaying a
    CUDA graph captured before anything died: kill -9 of rank 2 while rounds run; the
    survivors' graphs keep completing rounds without it (longest gap printed); a replacement
    joins as rank 2 and every rank's rounds count all of them again; every round verified."""
    from helpers import DaemonProcess, reap_keeper, wait_for
    from test_degraded import Group, check_sequence, _now

    daemon = DaemonProcess(runtime_dir, "--backend", "cuda", "--grace", "5").start()
    victim, job, full = 2, f"cudadegrade{ep}", L.full_mask(ep)
    grp = Group(ep, runtime_dir, job)
    try:
        for r in range(ep):
            grp.start(r, seed=300 + r, target=serve_cuda, pace=0.001)
        grp.expect("attached", range(ep), timeout=120)
        survivors = [r for r in range(ep) if r != victim]
        grp.wait_rounds(range(ep), 40, timeout=120)
        t_kill = _now()
        grp.kill(victim)
        wait_for(lambda: all(not grp.shared["mask"][r] >> victim & 1 for r in survivors), 20, "survivors without rank 2")
        grp.wait_rounds(survivors, 60, what="degraded rounds", timeout=60)
        info = daemon.request("job_info", job=job)
        assert info["state"] == "degraded" and info["abort"] == "none" and info["active_ranks"] == survivors, info
        grp.shared["stop_after"].value = 60
        grp.start(victim, seed=900, target=serve_cuda, pace=0.001)
        (_, first), = grp.expect("first", [victim], timeout=120).values()
        stop = grp.shared["stop"].value
        recs = {r: v for r, (_, v) in grp.expect("records", range(ep), timeout=120).items()}
        grp.expect("done", range(ep), timeout=60)
        total, worst = 0, 0.0
        for r in survivors:
            switch, rejoin = check_sequence(recs[r], r, victim, first, stop)
            times = [x[1] for x in recs[r]]
            worst = max([worst] + [b - a for a, b in zip(times, times[1:]) if b >= t_kill and a <= t_kill + 1.0])
            assert sum(x[4] for x in recs[r][switch:rejoin]) > 0
            total += len(recs[r])
        assert [x[0] for x in recs[victim]] == list(range(first, stop))
        assert all(x[2] == full and x[4] == 0 for x in recs[victim])
        total += len(recs[victim])
        print(f"\ncuda, {ep} ranks on {torch.cuda.device_count()} GPU(s), graphs captured before the death: longest gap "
              f"between two completed rounds across the kill -9 of rank {victim}: {worst * 1e3:.1f} ms; the "
              f"replacement's first round {first}; {total} verified rounds")
        assert worst < 2.0, f"the survivors stalled {worst:.3f} s across the death"
        assert total >= 200
        assert daemon.stop() == 0
    finally:
        grp.close()
        daemon.kill9()
        reap_keeper(runtime_dir)
