"""GPU tests of the CUDA data plane (the kernels of csrc/ through client/cuda_plane.py), no daemon.

Every test builds a whole job inside this process on one GPU: one contiguous
``[ep_size, row_stride]`` workspace (row q plays rank q's memory), a control
block in page-aligned host memory registered with the extension's helper, and
one CudaPlane and one CUDA stream per rank. Ranks run concurrently on their own
streams, exactly as separate processes would, so waits between ranks are real.
The SMs are split between the ranks (``sm_budget``) because combine sizes its
grid to be co-resident.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import time
from types import SimpleNamespace

import pytest
import torch

from a2ad import errors, layout as L
from a2ad.control import ControlBlock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _ops():
    from a2ad.client import _ext

    return _ext.load()


# ---------------------------------------------------------------------------
# An in-process job
# ---------------------------------------------------------------------------
#: Streams torch's pool hands out per priority, round-robin (c10's kStreamsPerPool).
TORCH_POOL_STREAMS = 32


def rank_streams(n):
    """n distinct CUDA streams, one per rank, and a function that destroys those it created.

    Up to TORCH_POOL_STREAMS come from torch's pool. Above that the pool would hand ranks 32
    apart the same stream, and a rank's kernel waiting for its peer would hold that peer's
    kernel back behind it on the one stream until the wait timed out; so a wider job gets
    streams of its own from the driver (non-blocking, as torch's are)."""
    if n <= TORCH_POOL_STREAMS:
        return [torch.cuda.Stream() for _ in range(n)], lambda: None
    torch.cuda.init()
    lib = ctypes.CDLL("libcuda.so.1")
    handles = []
    for _ in range(n):
        h = ctypes.c_void_p()
        rc = lib.cuStreamCreate(ctypes.byref(h), 1)  # CU_STREAM_NON_BLOCKING
        assert rc == 0, f"cuStreamCreate returned {rc}"
        handles.append(h.value)

    def destroy():
        for h in handles:
            lib.cuStreamDestroy_v2(ctypes.c_void_p(h))

    return [torch.cuda.ExternalStream(h) for h in handles], destroy


class Job:
    """``ep_size`` ranks of one job on one GPU, each with its own stream and CudaPlane."""

    def __init__(self, ep_size, max_tokens, top_k, num_experts, dispatch_bytes, combine_bytes, timeout=20.0,
                 on_peer_loss="raise", lines_tail=None):
        from a2ad.client.cuda_plane import CudaPlane, initialize_row, sm_count

        self.ep_size, self.max_tokens, self.top_k, self.num_experts = ep_size, max_tokens, top_k, num_experts
        self.on_peer_loss = on_peer_loss
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.aux = L.aux_layout(ep_size, max_tokens)
        self.size = L.workspace_size_per_rank(ep_size, max_tokens, dispatch_bytes, combine_bytes)
        # rows with a lines tail where the daemon's CUDA rows have one (lines_tail=False: as a
        # caller's workspace)
        if lines_tail is None:
            lines_tail = ep_size <= L.MAX_LINES_EP_SIZE
        self.row_stride = L.pad_up(L.row_bytes_with_tail(self.size) if lines_tail else self.size, 1 << 16)
        self.lines_tail = L.lines_tail_offset(self.size, self.row_stride) if lines_tail else 0
        self._buf = torch.empty(ep_size * self.row_stride, dtype=torch.uint8, device=self.device)
        self._buf.fill_(0xA5)  # payload areas start as garbage, never as zeros
        self.ws = self._buf.as_strided((ep_size, self.size), (self.row_stride, 1))
        self._mm = mmap.mmap(-1, L.CONTROL_BLOCK_SIZE)
        self.control = ControlBlock(self._mm, owner=self._mm)
        self.control.initialize(ep_size, L.POLICY_CODES[on_peer_loss])
        self._host = self.control.address()
        self.control_ptr = _ops().host_register(self._host, L.CONTROL_BLOCK_SIZE)
        self.streams, self._destroy_streams = rank_streams(ep_size)
        self.budget = max(1, sm_count() // (ep_size + 1))
        self.planes = [CudaPlane(self.att(r), timeout, sm_budget=self.budget) for r in range(ep_size)]
        for r in range(ep_size):
            initialize_row(self.ws, r, self.aux, lines_tail=self.lines_tail)
        torch.cuda.synchronize()

    def att(self, rank):
        return SimpleNamespace(
            job="test",
            ep_rank=rank,
            ep_size=self.ep_size,
            spec={"max_num_tokens": self.max_tokens, "top_k": self.top_k, "num_experts": self.num_experts,
                  "on_peer_loss": self.on_peer_loss},
            backend="cuda",
            device=self.device,
            workspace=self.ws,
            size_per_rank=self.size,
            row_stride=self.row_stride,
            aux=self.aux,
            lines_tail=self.lines_tail,
            control=self.control,
            generation=0,
        )

    def close(self):
        torch.cuda.synchronize()
        for p in self.planes:
            p.close()
        self.streams = []
        self._destroy_streams()
        _ops().host_unregister(self._host)
        self.control.close()

    def rearm(self):
        """What the daemon does job-wide after a failure: every row re-initialized, records cleared."""
        from a2ad.client.cuda_plane import initialize_row

        torch.cuda.synchronize()
        self.control.clear_abort()
        for r in range(self.ep_size):
            initialize_row(self.ws, r, self.aux, lines_tail=self.lines_tail)
            self.planes[r].reset_status()
        torch.cuda.synchronize()

    # --- views ------------------------------------------------------------------
    def i32(self, rank, offset, n):
        return self.ws[rank, offset : offset + 4 * n].view(torch.int32)

    def recv_counts(self, rank):
        return self.i32(rank, self.aux.recv_counters, self.ep_size).cpu()

    def flag_val(self, rank):
        return int(self.i32(rank, self.aux.flag_val, 1).item())

    def tail(self, rank):
        """``rank``'s lines tail (layout.ROW_TAIL_BYTES: the heads, then the lines), uint8."""
        from a2ad.client.cuda_plane import lines_tail_view

        return lines_tail_view(self.ws, rank, self.lines_tail)

    def region(self, rank, offset, nbytes):
        """``[ep_size, rt, nbytes]`` uint8 view of a payload region of ``rank``'s row."""
        rt = self.rt
        return self.ws[rank, offset : offset + self.ep_size * rt * nbytes].view(self.ep_size, rt, nbytes)

    def layout(self, rt, widths, combine_bytes=0):
        self.rt = rt
        return L.payload_layout(self.aux, self.size, rt, widths, combine_bytes)

    # --- running ranks on their streams ------------------------------------------
    def on_ranks(self, fn, ranks=None):
        """Run fn(rank) for each rank with that rank's stream current; returns the results."""
        main = torch.cuda.current_stream()
        out = {}
        for r in ranks if ranks is not None else range(self.ep_size):
            s = self.streams[r]
            s.wait_stream(main)
            with torch.cuda.stream(s):
                out[r] = fn(r)
        return out

    def join(self, ranks=None):
        main = torch.cuda.current_stream()
        for r in ranks if ranks is not None else range(self.ep_size):
            main.wait_stream(self.streams[r])


@pytest.fixture
def make_job():
    """Jobs of ranks in this process, closed after the test. While the test runs, Python's
    cyclic garbage collector is off (it collects once first): the ranks wait for each other
    inside their kernels, and a finalizer run in the middle of queuing a round (an earlier
    test's mapping or device memory freed: the driver synchronizes the device there) would
    wait for the kernels already queued, which wait for the ranks not queued yet, until their
    timeout."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    jobs = []

    def make(*args, **kwargs):
        j = Job(*args, **kwargs)
        jobs.append(j)
        return j

    try:
        yield make
    finally:
        try:
            for j in jobs:
                j.close()
        finally:
            if was_enabled:
                gc.enable()


# ---------------------------------------------------------------------------
# CPU references
# ---------------------------------------------------------------------------
def owners(num_experts, ep_size):
    return [L.expert_owner(e, num_experts, ep_size) for e in range(num_experts)]


def routes(experts_cpu, num_experts, ep_size):
    """Per token, its distinct target ranks in first-appearance order (invalid ids skipped)."""
    own = owners(num_experts, ep_size)
    out = []
    for row in experts_cpu.tolist():
        seen = []
        for e in row:
            if 0 <= e < num_experts and own[e] not in seen:
                seen.append(own[e])
        out.append(seen)
    return out


def rand_experts(T, top_k, num_experts, gen=None, device="cuda"):
    return torch.randint(0, num_experts, (T, top_k), dtype=torch.int32, device=device, generator=gen)


def rand_bytes(T, nbytes, device="cuda"):
    return torch.randint(0, 256, (T, nbytes), dtype=torch.uint8, device=device)


def check_dispatch(job, experts, payloads, pl):
    """Byte-exact check of every received region, the counters and the routing arrays."""
    ep, rt = job.ep_size, pl.runtime_max_tokens_per_rank
    torch.cuda.synchronize()
    own = owners(job.num_experts, ep)
    route = {s: routes(experts[s].cpu(), job.num_experts, ep) for s in range(ep)}
    regions = {
        (r, i): job.region(r, off, pl.dispatch_bytes_per_token[i]).cpu()
        for r in range(ep)
        for i, off in enumerate(pl.dispatch_offsets)
    }
    sent = {(s, i): payloads[s][i].cpu() for s in range(ep) for i in range(len(pl.dispatch_offsets))}
    for r in range(ep):
        counts = job.recv_counts(r)
        for s in range(ep):
            tokens = [t for t, tg in enumerate(route[s]) if r in tg]
            assert counts[s].item() == len(tokens), f"rank {r}: RECV_COUNTERS[{s}]"
            for i in range(len(pl.dispatch_offsets)):
                got = regions[r, i][s, : len(tokens)]
                want = sent[s, i][tokens] if tokens else got[:0]
                assert sorted(map(bytes, got.numpy())) == sorted(map(bytes, want.numpy())), (
                    f"rank {r} payload {i}: rows from source {s} differ (as sets)"
                )
    # routing arrays: each send names a slot at its target holding exactly that token's row;
    # repeats and out-of-range expert ids are -1
    for s in range(ep):
        T = experts[s].shape[0]
        tgt = job.i32(s, job.aux.topk_target_ranks, T * L.MAX_TOP_K).view(T, L.MAX_TOP_K)[:, : job.top_k].cpu()
        slot = job.i32(s, job.aux.topk_send_indices, T * L.MAX_TOP_K).view(T, L.MAX_TOP_K)[:, : job.top_k].cpu()
        ex = experts[s].cpu().tolist()
        for t in range(T):
            seen = set()
            for k in range(job.top_k):
                e = ex[t][k]
                q = own[e] if 0 <= e < job.num_experts else None
                if q is None or q in seen:
                    assert tgt[t, k] == -1 and slot[t, k] == -1, f"source {s} token {t} k {k}: not marked -1"
                    continue
                seen.add(q)
                assert tgt[t, k] == q, f"source {s} token {t} k {k}: target"
                j = slot[t, k].item()
                assert 0 <= j < rt
                for i in range(len(pl.dispatch_offsets)):
                    assert torch.equal(regions[q, i][s, j], sent[s, i][t]), f"source {s} token {t} payload {i}"


def expert_weight(q):
    """The test's expert computation on rank q multiplies every received row by this."""
    return float(q + 1)


def run_round(job, experts, payloads, pl, hidden_index, dtype, in_workspace=False):
    """dispatch -> expert computation (row * expert_weight(rank)) -> combine; returns outputs per rank.
    ``in_workspace``: for every rank, or a list with one entry per rank."""
    rt = pl.runtime_max_tokens_per_rank
    nb = pl.dispatch_bytes_per_token[hidden_index]
    hidden = nb // torch.tensor([], dtype=dtype).element_size()
    hb = hidden * torch.tensor([], dtype=dtype).element_size()

    def dispatch(r):
        job.planes[r].dispatch(experts[r], payloads[r], rt, pl, job.num_experts)

    def expert_and_combine(r):
        recv = job.region(r, pl.dispatch_offsets[hidden_index], nb).view(dtype)
        iw = in_workspace[r] if isinstance(in_workspace, (list, tuple)) else in_workspace
        if iw:
            comb = job.region(r, pl.combine_offset, hb).view(dtype)
            torch.mul(recv, expert_weight(r), out=comb)
        else:
            comb = (recv.float() * expert_weight(r)).to(dtype)
        return job.planes[r].combine(comb, experts[r].shape[0], rt, pl, iw)

    job.on_ranks(dispatch)
    outs = job.on_ranks(expert_and_combine)
    job.join()
    return outs


def combine_reference(job, experts, x):
    """float64: out[t] = x[t] * sum over the token's distinct targets q of expert_weight(q)."""
    route = routes(experts.cpu(), job.num_experts, job.ep_size)
    w = torch.tensor([sum(expert_weight(q) for q in tg) for tg in route], dtype=torch.float64)
    return x.cpu().double() * w[:, None]


def close(out, ref, dtype):
    """Every term (row * integer weight) and the result are rounded once to ``dtype``; with no
    cancellation (all terms are multiples of the same row) the relative error stays under 2
    unit roundoffs (bf16 2 * 2^-8, fp16 2 * 2^-11)."""
    rtol = {torch.bfloat16: 8e-3, torch.float16: 1.2e-3, torch.float32: 1e-5}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=rtol * 1e-2)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ep_size,top_k,num_experts", [(2, 2, 8), (4, 8, 32), (8, 8, 256), (5, 6, 384)])
def test_dispatch_byte_exact_and_combine(make_job, ep_size, top_k, num_experts):
    T, hidden, dtype = 48, 256, torch.bfloat16
    widths = [2 * hidden, 4 * top_k, 4 * top_k]
    job = make_job(ep_size, 64, top_k, num_experts, sum(widths), 2 * hidden)
    pl = job.layout(56, widths, 2 * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
    payloads = [
        [xs[r].view(torch.uint8), experts[r].view(torch.uint8), torch.rand(T, top_k, device="cuda").view(torch.uint8)]
        for r in range(ep_size)
    ]
    outs = run_round(job, experts, payloads, pl, 0, dtype)
    check_dispatch(job, experts, payloads, pl)
    for r in range(ep_size):
        ref = combine_reference(job, experts[r], xs[r])
        assert outs[r].shape == (T, hidden)
        close(outs[r], ref, dtype)
        assert job.flag_val(r) == L.INITIAL_ROUND + 1
        job.planes[r].check()  # no failure recorded


@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("T", [1, 9, 37])
@pytest.mark.parametrize("dtype,in_workspace", [("bf16", False), ("fp32", False), ("bf16", True)])
def test_one_and_many_block_launches(make_job, ep_size, T, dtype, in_workspace):
    """The launch shapes of the one kernel: one token (a one-block dispatch that numbers its
    sends in shared memory and loads payloads in warps that route nothing, a one-block
    combine), a few tokens (one block per token, the last block publishing the ready words),
    more; several rounds, so stale rows of an earlier round must never leak in."""
    dtype = DTYPES[dtype]
    top_k, num_experts, hidden = 4, 16, 1024
    es = torch.tensor([], dtype=dtype).element_size()
    job = make_job(ep_size, 40, top_k, num_experts, es * hidden + 4 * top_k, es * hidden)
    pl = job.layout(40, [es * hidden, 4 * top_k], es * hidden)
    for _ in range(3):
        experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
        xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
        outs = run_round(job, experts, payloads, pl, 0, dtype, in_workspace=in_workspace)
        check_dispatch(job, experts, payloads, pl)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
            # the ready word each peer wrote here carries this round, the count now in
            # RECV_COUNTERS and the peer's rt
            check_ready_words(job, r, 40)


def dispatch_forms(prof):
    """(mask words, pairs, plain, small, cluster) of every dispatch kernel a profile saw launched."""
    import re

    found = [re.search(r"dispatch_kernel<(\d+), (true|false), (true|false), (true|false), (true|false)>\(", e.name)
             for e in prof.events()]
    return [(int(m.group(1)),) + tuple(g == "true" for g in m.groups()[1:]) for m in found if m]


def test_this_process_loads_kernels_eagerly():
    """The jobs here run several ranks in this process, waiting for each other inside their
    kernels; tests/conftest.py initializes CUDA with eager module loading, so that no kernel's
    first launch (a torch op between two ranks' dispatches) loads its module while a dispatch
    waits for a rank not launched yet. The driver reports the mode it runs in; the environment
    the tests' own processes inherit does not carry the setting."""
    import conftest

    if conftest.MODULE_LOADING_SET_BY_CALLER:
        pytest.skip(f"{conftest.MODULE_LOADING} was set by the caller: this process loads modules as it asked")
    torch.cuda.init()
    libcuda = ctypes.CDLL("libcuda.so.1")
    mode = ctypes.c_int(0)
    assert libcuda.cuModuleGetLoadingMode(ctypes.byref(mode)) == 0
    assert mode.value == 1, f"module loading mode {mode.value} (1: eager, 2: lazy)"  # CU_MODULE_EAGER_LOADING
    assert conftest.MODULE_LOADING not in os.environ


def clusters_here():
    """Whether this GPU runs thread-block clusters (sm_90 and later): the one-token dispatch's cluster form."""
    return torch.cuda.get_device_capability()[0] >= 9


def test_dispatch_small_and_general_forms(make_job):
    """The plain dispatch has two forms: a launch whose tiles hold fewer tokens than a block has
    warps (small T) runs the one whose two copy passes share one loop, every other launch the
    general one. With two SMs per rank (at most 6 resident blocks) T = 1-7 take the small form
    and T = 61 and 64 the general one (full tiles of 8, and a partial last tile at 61, whose idle
    warps load early); T = 1 takes the small form's cluster variant (two blocks) where the GPU
    has clusters; the forms alternate over the rounds, each round byte-exact, its combine
    close. The dispatch kernel each round launched (torch's profiler) shows the form."""
    from torch.profiler import ProfilerActivity, profile

    dtype, ep_size, top_k, num_experts, hidden = torch.bfloat16, 2, 4, 16, 1024
    job = make_job(ep_size, 64, top_k, num_experts, 2 * hidden + 4 * top_k, 2 * hidden)
    for plane in job.planes:
        plane.sm_budget = 2
    pl = job.layout(64, [2 * hidden, 4 * top_k], 2 * hidden)
    for T in (1, 64, 5, 61, 7, 64):
        experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
        xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = run_round(job, experts, payloads, pl, 0, dtype)
            torch.cuda.synchronize()
        assert dispatch_forms(prof) == [(1, False, True, T <= 7, T == 1 and clusters_here())] * ep_size, T
        check_dispatch(job, experts, payloads, pl)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
            check_ready_words(job, r, 64)


@pytest.mark.parametrize("ep_size,budget,hidden,dtype", [
    (2, None, 7168, "bf16"),  # 7 + 2 items: a cluster of 2 blocks
    (2, 1, 2880, "bf16"),     # one SM: the one-block launch
    (4, 2, 1024, "fp32"),     # 2 + 2 items
    (8, None, 1001, "bf16"),  # a 2002-byte row (no 16-byte vectors: one item) + 2 items
])
def test_one_token_from_a_cluster(make_job, ep_size, budget, hidden, dtype):
    """A one-token dispatch runs as one cluster of blocks (two, where the launch may use two SMs
    or more), each copying its share of the token's items; the first block alone writes the
    routing arrays and a bad expert id's record, and publishes after the cluster's barrier. With
    one SM it is the one-block launch. Rounds of one token: random ids, every id on one rank, an
    id out of range, every id out of range (nothing sent; -3 reported); each byte-exact, its
    combine close, its ready words right, a bad id reported with its token and id, the form the
    one the launcher picks."""
    from torch.profiler import ProfilerActivity, profile

    dtype = DTYPES[dtype]
    es = torch.tensor([], dtype=dtype).element_size()
    top_k, num_experts = 8, 64
    widths = [es * hidden, 4 * top_k, 4 * top_k]
    job = make_job(ep_size, 8, top_k, num_experts, sum(widths), es * hidden)
    if budget is not None:
        for plane in job.planes:
            plane.sm_budget = budget
    pl = job.layout(8, widths, es * hidden)
    per_rank = num_experts // ep_size
    bad = num_experts + 5
    cases = [  # (what, expert ids of rank r, the bad id reported or None)
        ("random", lambda r: rand_experts(1, top_k, num_experts), None),
        ("one rank", lambda r: torch.arange(top_k, dtype=torch.int32, device="cuda").view(1, top_k) % per_rank
         + per_rank * ((r + 1) % ep_size), None),
        ("a bad id", lambda r: torch.cat([rand_experts(1, top_k - 1, num_experts),
                                          torch.full((1, 1), bad, dtype=torch.int32, device="cuda")], dim=1), bad),
        ("none valid", lambda r: torch.full((1, top_k), -3, dtype=torch.int32, device="cuda"), -3),
        ("random again", lambda r: rand_experts(1, top_k, num_experts), None),
    ]
    cluster = clusters_here() and budget != 1
    for what, make, reported in cases:
        experts = [make(r).contiguous() for r in range(ep_size)]
        xs = [torch.randn(1, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8),
                     torch.rand(1, top_k, device="cuda").view(torch.uint8)] for r in range(ep_size)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = run_round(job, experts, payloads, pl, 0, dtype)
            torch.cuda.synchronize()
        assert dispatch_forms(prof) == [(1, False, True, True, cluster)] * ep_size, what
        check_dispatch(job, experts, payloads, pl)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
            check_ready_words(job, r, 8)
            if job.lines_tail:  # every source's digest line of this round, in every row
                rounds, got = digest_lines(job, r)
                assert (rounds == job.flag_val(r) - 1).all() and got == [L.spec_digest(pl.spec)] * ep_size, (
                    what, r, rounds.tolist(), got)
            if reported is not None:
                with pytest.raises(errors.InputError) as ei:
                    job.planes[r].check_input()
                assert ei.value.details["token"] == 0 and ei.value.details["expert_id"] == reported, str(ei.value)
            job.planes[r].check_input()  # nothing (left) to report


def combine_paths(prof):
    """The kPath (last template argument) of every combine kernel a profile saw launched."""
    import re

    found = [re.search(r"combine_kernel<[^()]*, (\d+)>\(", e.name) for e in prof.events()]
    return [int(m.group(1)) for m in found if m]


def lines_words(job, r, ep, rt, row):
    """Rank r's lines (in its lines tail) of a round of rt slots of `row` bytes: the (round, data) halves of
    each line word, as ([ep - 1, rt, row / 4] rounds, [ep - 1, rt, row] data bytes)."""
    a = L.LINE_HEADS_BYTES
    words = job.tail(r)[a : a + 2 * (ep - 1) * rt * row].view(torch.int64).cpu().view(ep - 1, rt, row // 4)
    lo = words & 0xFFFFFFFF
    data = torch.where(lo >= 1 << 31, lo - (1 << 32), lo).to(torch.int32).contiguous().view(torch.uint8)
    return (words >> 32) & 0xFFFFFFFF, data.view(ep - 1, rt, row)


@pytest.mark.parametrize("ep_size", [2, 3])
def test_lines_with_ranks_that_stage_differently(make_job, ep_size):
    """A combine whose rows fit the lines (COMBINE_LINES_BYTES) stages them as lines (ranks 0 and 2 combine from
    their combine region, rank 1 from a tensor of its own); a round too big for them stages
    into the combine region and publishes before anyone pulls, as the plain path does. Rounds
    switch between the two: every combine completes, right; the ready words carry the round and
    the combine descriptor; after a lines round every rank's head (this rank's
    lines tail's heads, its own included) holds the round and the descriptor twice, and the lines hold the round
    beside each 4 bytes of every slot of the payload's rows for the peers. The combine kernel
    each round launched (torch's profiler) shows the path every rank took."""
    from torch.profiler import ProfilerActivity, profile

    dtype, top_k, num_experts, hidden = torch.bfloat16, 4, 16, 2048
    row = 2 * hidden
    job = make_job(ep_size, 136, top_k, num_experts, row + 4 * top_k, row)
    in_ws = [r % 2 == 0 for r in range(ep_size)]
    spec = L.combine_spec(hidden, dtype)
    last_lines_round = None
    # (9, 136): too big for the lines (2 * rt * row > COMBINE_LINES_BYTES), few tokens: the ranks' grids on
    # one GPU stay within their share of the SMs
    for T, rt in [(1, 1), (37, 40), (9, 136), (1, 1), (9, 12)]:
        lines = L.combine_lines_bytes(ep_size, rt, hidden, 2) <= L.COMBINE_LINES_BYTES
        assert lines == (rt != 136)
        pl = job.layout(rt, [row, 4 * top_k], row)
        experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
        xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = run_round(job, experts, payloads, pl, 0, dtype, in_workspace=in_ws)
            torch.cuda.synchronize()
        assert combine_paths(prof) == [2 if lines else 1] * ep_size, (T, rt)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
            round_ = job.flag_val(r) - 1
            words = job.ws[r, job.aux.combine_ready : job.aux.combine_ready + 8 * ep_size].view(torch.int64).cpu()
            heads = job.tail(r)[: 16 * ep_size].view(torch.int64).cpu().view(ep_size, 2)
            for q in range(ep_size):
                if q != r:
                    w = int(words[q]) & ((1 << 64) - 1)
                    assert (w & 0xFFFFFFFF, w >> 32) == (round_, spec), (T, r, q, hex(w))
                want = ((round_ if lines else last_lines_round) << 32) | spec  # (its own head too)
                assert [int(h) & ((1 << 64) - 1) for h in heads[q]] == [want, want], (T, r, q)
            if lines:
                rounds, data = lines_words(job, r, ep_size, rt, row)
                assert (rounds == round_).all(), (T, r)
                recv = job.region(r, pl.dispatch_offsets[0], row).view(dtype)
                comb = (recv.float() * expert_weight(r)).to(dtype).view(torch.uint8).view(ep_size, rt, row).cpu()
                others = [s for s in range(ep_size) if s != r]
                assert torch.equal(data, comb[others]), (T, r)
        if lines:
            last_lines_round = job.flag_val(0) - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lines_with_a_misaligned_payload_and_output(make_job, dtype):
    """A lines combine (rows a multiple of 16 bytes) whose payload and output start 2 or 4 bytes
    past a 16-byte boundary (views into larger tensors) on rank 1, aligned on rank 0: the
    staging reads the payload and the pull writes the output in pieces there, and both ranks
    combine right."""
    from torch.profiler import ProfilerActivity, profile

    ep_size, T, top_k, E, hidden = 2, 12, 4, 16, 64
    es = torch.tensor([], dtype=dtype).element_size()
    job = make_job(ep_size, T, top_k, E, es * hidden + 4 * top_k, es * hidden)
    pl = job.layout(T, [es * hidden, 4 * top_k], es * hidden)
    e = [rand_experts(T, top_k, E) for _ in range(ep_size)]
    x = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]

    def step(r):
        job.planes[r].dispatch(e[r], [x[r].view(torch.uint8), e[r].view(torch.uint8)], T, pl, E)
        recv = job.region(r, pl.dispatch_offsets[0], es * hidden).view(dtype)
        comb = (recv.float() * expert_weight(r)).to(dtype)
        out = torch.empty(T, hidden, dtype=dtype, device="cuda")
        if r == 1:
            big = torch.empty(ep_size * T * hidden + 1, dtype=dtype, device="cuda")
            big[1:].view(ep_size, T, hidden).copy_(comb)
            comb = big[1:].view(ep_size, T, hidden)
            out = torch.empty(T * hidden + 1, dtype=dtype, device="cuda")[1:].view(T, hidden)
            assert comb.data_ptr() % 16 != 0 and out.data_ptr() % 16 != 0
        got = job.planes[r].combine(comb, T, T, pl, False, output=out)
        assert got.data_ptr() == out.data_ptr()
        return out

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = job.on_ranks(step)
        job.join()
        torch.cuda.synchronize()
    assert combine_paths(prof) == [2, 2]
    for r in range(ep_size):
        job.planes[r].check()
        close(outs[r], combine_reference(job, e[r], x[r]), dtype)



def ready_word_high(count, rt, max_tokens):
    """The high half of a dispatch ready word: rt * (max_tokens + 1) + count when that fits
    32 bits for every rt and count (max_tokens <= 65535), else the count alone."""
    return rt * (max_tokens + 1) + count if (max_tokens + 1) ** 2 <= 1 << 32 else count


def digest_lines(job, r):
    """Rank r's dispatch digest lines (layout.DISPATCH_DIGESTS_OFFSET of its lines tail), one per
    source: ([ep_size, 2] rounds of the two words, [ep_size] digests from their low halves)."""
    a = L.DISPATCH_DIGESTS_OFFSET
    words = job.tail(r)[a : a + 16 * job.ep_size].view(torch.int64).cpu().view(job.ep_size, 2)
    lo = (words & 0xFFFFFFFF).tolist()
    return (words >> 32) & 0xFFFFFFFF, [lo[s][0] | lo[s][1] << 32 for s in range(job.ep_size)]


def check_ready_words(job, r, rt):
    words = job.ws[r, job.aux.dispatch_ready : job.aux.dispatch_ready + 8 * job.ep_size].view(torch.int64).cpu()
    counts = job.recv_counts(r)
    for s in range(job.ep_size):
        w = int(words[s]) & ((1 << 64) - 1)
        assert w & 0xFFFFFFFF == job.flag_val(r) - 1, (r, s, hex(w))
        assert w >> 32 == ready_word_high(int(counts[s]), rt, job.max_tokens), (r, s, hex(w))


@pytest.mark.parametrize("max_tokens", [65535, 65536])
def test_rt_travels_with_the_ready_word_or_apart(make_job, max_tokens):
    """Up to max_num_tokens 65535 the ready word carries the source's rt with the count and
    the target reads no RECV_RTS; from 65536 on rt travels in RECV_RTS. Both ways: exact
    rounds, and ranks that pass different rt get an InputError naming the peer and its rt,
    then the job goes on."""
    dtype = torch.bfloat16
    ep_size, top_k, num_experts, hidden, T = 2, 4, 16, 64, 5
    job = make_job(ep_size, max_tokens, top_k, num_experts, 2 * hidden + 4 * top_k, 2 * hidden)
    pl = job.layout(8, [2 * hidden, 4 * top_k], 2 * hidden)

    def exact_round():
        experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
        xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
        outs = run_round(job, experts, payloads, pl, 0, dtype)
        check_dispatch(job, experts, payloads, pl)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
            job.planes[r].check_input()  # nothing recorded
            check_ready_words(job, r, 8)

    exact_round()
    # rank 1 passes rt 9 against rank 0's 8: every rank sees the other's rt
    pl9 = L.payload_layout(job.aux, job.size, 9, [2 * hidden, 4 * top_k], 2 * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
    pls, rts = [pl, pl9], [8, 9]

    def dispatch(r):
        job.planes[r].dispatch(experts[r], [xs[r].view(torch.uint8), experts[r].view(torch.uint8)], rts[r], pls[r],
                               num_experts)

    def combine(r):
        comb = torch.ones(ep_size, rts[r], hidden, dtype=dtype, device="cuda")  # any data moved would show
        return job.planes[r].combine(comb, T, rts[r], pls[r], False)

    job.on_ranks(dispatch)
    outs = job.on_ranks(combine)
    job.join()
    torch.cuda.synchronize()
    for r in range(ep_size):
        assert torch.count_nonzero(outs[r]) == 0  # a round with a mismatch moves no data
        with pytest.raises(errors.InputError) as ei:
            job.planes[r].check_input()
        other = 1 - r
        assert ei.value.details["peer"] == other and ei.value.details["peer_value"] == rts[other], str(ei.value)
    exact_round()


@pytest.mark.parametrize("dtype,hidden", [("bf16", 8192), ("fp32", 4100), ("bf16", 8201)])
def test_overlapped_combine(make_job, dtype, hidden):
    """When a rank stages at least 16 MB of rows at least 8 KB wide, part of the combine grid
    stages slice by slice and flags each slice to its source while the rest already pulls, in
    the peer's slot order. Many slices, uneven token counts (a rank that sends nothing), rt > T,
    several rounds, aligned and unaligned rows; the slice flags show which path ran: a round
    with a small rt stages over the whole grid and flags no slice.

    Two ranks: with three or more ranks sharing one GPU at full-size grids, rank 0 times out
    on the plain path as well, so such jobs cannot run in one process here."""
    dtype = DTYPES[dtype]
    es = torch.tensor([], dtype=dtype).element_size()
    ep_size, top_k, num_experts, max_tokens = 2, 6, 8, 1100
    job = make_job(ep_size, max_tokens, top_k, num_experts, es * hidden + 4 * top_k, es * hidden)
    S = L.COMBINE_SLICE_ROWS
    for rnd, rt in enumerate([1090, 1090, 200, 1090]):
        pl = job.layout(rt, [es * hidden, 4 * top_k], es * hidden)
        overlapped = rt * es * hidden >= 16 << 20
        assert overlapped == (rt == 1090)
        tokens = [0 if r == 1 and rnd == 1 else min(rt, 1050) - 37 * r for r in range(ep_size)]
        experts = [rand_experts(t, top_k, num_experts) for t in tokens]
        xs = [torch.randn(t, hidden, device="cuda").to(dtype) for t in tokens]
        payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
        outs = run_round(job, experts, payloads, pl, 0, dtype)
        check_dispatch(job, experts, payloads, pl)
        for r in range(ep_size):
            assert outs[r].shape == (tokens[r], hidden)
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
            job.planes[r].check()
        # rank q staged slice by slice iff the round was large: then every slice it holds for
        # source s carries this round in s's COMBINE_SLICE_FLAGS[q] (the low half of each u64;
        # the high half is q's combine descriptor)
        this_round = L.INITIAL_ROUND + rnd
        nflags = ep_size * job.aux.combine_slices
        for s in range(ep_size):
            words = job.ws[s, job.aux.combine_slice_flags : job.aux.combine_slice_flags + 8 * nflags].view(torch.int64)
            flags = (words.cpu() & 0xFFFFFFFF).view(ep_size, job.aux.combine_slices)
            spec = L.combine_spec(hidden, dtype)
            assert all(int(w) >> 32 == spec for w, f in zip(words.cpu().tolist(), flags.flatten().tolist())
                       if f == this_round), f"round {rnd}: slice flags without the combine descriptor"
            for q in range(ep_size):
                if q == s:
                    continue
                n = int(job.recv_counts(q)[s])
                slices = (n + S - 1) // S
                staged = flags[q, :slices].tolist()
                if overlapped:
                    assert staged == [this_round] * slices, f"round {rnd}: rank {q} -> source {s} slice flags"
                else:
                    assert all(v != this_round for v in staged), f"round {rnd}: rank {q} flagged slices on the plain path"


def test_diagnostics_exist_only_in_the_timing_build(make_job):
    """The production build refuses a plan with diagnostic bits (they break the protocol), and
    the plane keeps working with none."""
    from a2ad.client import _ext, cuda_plane as cp

    if _ext.timing_build():
        pytest.skip("this process loaded the timing build (A2AD_KERNEL_TIMING is set)")
    ep_size, top_k, num_experts, hidden, T = 2, 4, 16, 512, 5
    job = make_job(ep_size, 8, top_k, num_experts, 2 * hidden, 2 * hidden)
    for p in job.planes:
        assert p.diag == 0
        with pytest.raises(RuntimeError, match="timing build"):
            p.diag = cp.DIAG_DOUBLE_FENCE
        assert p.diag == 0
        with pytest.raises(ValueError):
            p.diag = cp.DIAG_BITS + 1
    pl = job.layout(8, [2 * hidden], 2 * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(ep_size)]
    outs = run_round(job, experts, [[x.view(torch.uint8)] for x in xs], pl, 0, torch.bfloat16)
    check_dispatch(job, experts, [[x.view(torch.uint8)] for x in xs], pl)
    for r in range(ep_size):
        close(outs[r], combine_reference(job, experts[r], xs[r]), torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("in_workspace", [False, True])
def test_combine_dtypes(make_job, dtype, in_workspace):
    dtype = DTYPES[dtype]
    ep_size, top_k, num_experts, T, hidden = 4, 4, 16, 40, 1024
    es = torch.tensor([], dtype=dtype).element_size()
    job = make_job(ep_size, 40, top_k, num_experts, es * hidden, es * hidden)
    pl = job.layout(40, [es * hidden], es * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
    payloads = [[xs[r].view(torch.uint8)] for r in range(ep_size)]
    outs = run_round(job, experts, payloads, pl, 0, dtype, in_workspace=in_workspace)
    for r in range(ep_size):
        close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)


def test_sanitize(make_job):
    ep_size, top_k, num_experts, rt = 4, 8, 32, 24
    widths = [4 * top_k, 64]
    job = make_job(ep_size, 32, top_k, num_experts, sum(widths), 0)
    pl = job.layout(rt, widths)
    Ts = [20, 0, 24, 7]
    experts = [rand_experts(T, top_k, num_experts) for T in Ts]
    payloads = [[experts[r].view(torch.uint8), rand_bytes(Ts[r], 64)] for r in range(ep_size)]
    invalid = -7
    job.on_ranks(lambda r: job.planes[r].dispatch(experts[r], payloads[r], rt, pl, num_experts))
    job.on_ranks(
        lambda r: job.planes[r].sanitize(job.region(r, pl.dispatch_offsets[0], 4 * top_k).view(torch.int32), rt, invalid)
    )
    job.join()
    check_dispatch(job, experts, payloads, pl)
    for r in range(ep_size):
        ids = job.region(r, pl.dispatch_offsets[0], 4 * top_k).view(torch.int32).cpu()
        counts = job.recv_counts(r)
        for s in range(ep_size):
            n = counts[s].item()
            assert (ids[s, n:] == invalid).all(), f"rank {r}: slots >= {n} of source {s} not sanitized"
            assert not (ids[s, :n] == invalid).any()


def test_odd_widths_and_misaligned_sources(make_job):
    ep_size, top_k, num_experts, T, rt = 4, 3, 12, 33, 40
    widths = [7, 13, 4 * top_k, 3, 74, 40]
    job = make_job(ep_size, rt, top_k, num_experts, sum(widths), 4 * 37)
    pl = job.layout(rt, widths, 2 * 37)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    payloads = []
    for r in range(ep_size):
        ps = [rand_bytes(T, w) for w in widths]
        # a source that starts 1 byte past an aligned address (contiguous, misaligned)
        flat = torch.empty(T * 40 + 1, dtype=torch.uint8, device="cuda")
        ps[5] = flat[1:].view(T, 40)
        ps[5].copy_(rand_bytes(T, 40))
        payloads.append(ps)
    job.on_ranks(lambda r: job.planes[r].dispatch(experts[r], payloads[r], rt, pl, num_experts))
    job.join()
    check_dispatch(job, experts, payloads, pl)

    # combine with odd hidden sizes (the unvectorized path), then fp32 hidden 5
    for dtype, hidden in ((torch.float16, 37), (torch.float32, 5), (torch.bfloat16, 36)):
        es = torch.tensor([], dtype=dtype).element_size()
        job.rearm()
        pl2 = job.layout(rt, [es * hidden], es * hidden)
        xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(ep_size)]
        outs = run_round(job, experts, [[x.view(torch.uint8)] for x in xs], pl2, 0, dtype)
        for r in range(ep_size):
            close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)


def test_top_k_22_with_repeats(make_job):
    ep_size, top_k, num_experts, T, hidden = 4, 22, 64, 64, 512
    widths = [2 * hidden, 4 * top_k]
    job = make_job(ep_size, T, top_k, num_experts, sum(widths), 2 * hidden)
    pl = job.layout(T, widths, 2 * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(ep_size)]
    experts[0][:, :] = 5  # every k the same expert: one send per token
    experts[1][:, 1::2] = -1  # out-of-range ids are not routed (and marked -1)
    experts[2][:, 3] = num_experts
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(ep_size)]
    payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(ep_size)]
    outs = run_round(job, experts, payloads, pl, 0, torch.bfloat16)
    check_dispatch(job, experts, payloads, pl)
    for r in range(ep_size):
        close(outs[r], combine_reference(job, experts[r], xs[r]), torch.bfloat16)


def test_ranks_with_no_tokens(make_job):
    ep_size, top_k, num_experts, hidden = 4, 4, 16, 256
    job = make_job(ep_size, 32, top_k, num_experts, 2 * hidden, 2 * hidden)
    pl = job.layout(32, [2 * hidden], 2 * hidden)
    Ts = [0, 17, 0, 32]
    experts = [rand_experts(T, top_k, num_experts) for T in Ts]
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for T in Ts]
    outs = run_round(job, experts, [[x.view(torch.uint8)] for x in xs], pl, 0, torch.bfloat16)
    check_dispatch(job, experts, [[x.view(torch.uint8)] for x in xs], pl)
    for r in range(ep_size):
        assert outs[r].shape == (Ts[r], hidden)
        close(outs[r], combine_reference(job, experts[r], xs[r]), torch.bfloat16)
    # every rank with no tokens at all
    zero = [torch.empty(0, top_k, dtype=torch.int32, device="cuda") for _ in range(ep_size)]
    xz = [torch.empty(0, hidden, device="cuda").bfloat16() for _ in range(ep_size)]
    outs = run_round(job, zero, [[x.view(torch.uint8)] for x in xz], pl, 0, torch.bfloat16)
    assert all(o.shape == (0, hidden) for o in outs.values())
    assert all(job.flag_val(r) == L.INITIAL_ROUND + 2 for r in range(ep_size))


def _exact_inputs(job, T, hidden, gen):
    """Small-integer hidden states: every sum the test makes is exact in bfloat16."""
    experts = torch.randint(0, job.num_experts, (T, job.top_k), dtype=torch.int32, device="cuda", generator=gen)
    x = torch.randint(-4, 5, (T, hidden), device="cuda", generator=gen).bfloat16()
    return experts, x


def _exact_reference(job, experts, x, owner_table, weights):
    """On the GPU: x * sum of expert_weight over the token's distinct targets."""
    own = owner_table[experts.long()]  # [T, top_k]
    hit = torch.zeros(experts.shape[0], job.ep_size, device="cuda")
    hit.scatter_(1, own, 1.0)
    return x.float() * (hit @ weights)[:, None]


@pytest.mark.slow
def test_1000_consecutive_rounds(make_job):
    ep_size, top_k, num_experts, hidden, rt = 4, 6, 32, 128, 32
    job = make_job(ep_size, rt, top_k, num_experts, 2 * hidden + 4 * top_k, 2 * hidden)
    pl = job.layout(rt, [2 * hidden, 4 * top_k], 2 * hidden)
    owner_table = torch.tensor(owners(num_experts, ep_size), device="cuda")
    weights = torch.tensor([expert_weight(q) for q in range(ep_size)], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for rnd in range(1000):
        Ts = [int(t) for t in torch.randint(0, rt + 1, (ep_size,)).tolist()]
        inputs = [_exact_inputs(job, T, hidden, gen) for T in Ts]
        experts = [e for e, _ in inputs]
        payloads = [[x.view(torch.uint8), e.view(torch.uint8)] for e, x in inputs]
        outs = run_round(job, experts, payloads, pl, 0, torch.bfloat16, in_workspace=bool(rnd % 2))
        for r in range(ep_size):
            ref = _exact_reference(job, experts[r], inputs[r][1], owner_table, weights)
            bad += (outs[r].float() != ref).sum()
        if rnd % 100 == 99:
            assert bad.item() == 0, f"mismatches by round {rnd + 1}"
            for p in job.planes:
                p.check()
    torch.cuda.synchronize()
    assert all(job.flag_val(r) == L.INITIAL_ROUND + 1000 for r in range(ep_size))


def test_cuda_graph_replay_with_fresh_inputs(make_job):
    ep_size, top_k, num_experts, hidden, T = 4, 4, 16, 512, 24
    job = make_job(ep_size, T, top_k, num_experts, 2 * hidden + 4 * top_k, 2 * hidden)
    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    owner_table = torch.tensor(owners(num_experts, ep_size), device="cuda")
    weights = torch.tensor([expert_weight(q) for q in range(ep_size)], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(2)
    static = [_exact_inputs(job, T, hidden, gen) for _ in range(ep_size)]

    def step(r):
        e, x = static[r]
        job.planes[r].dispatch(e, [x.view(torch.uint8), e.view(torch.uint8)], T, pl, num_experts)
        recv = job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(torch.bfloat16)
        comb = job.region(r, pl.combine_offset, 2 * hidden).view(torch.bfloat16)
        torch.mul(recv, expert_weight(r), out=comb)
        return job.planes[r].combine(comb, T, T, pl, True)

    for _ in range(3):  # warm up outside capture (builds, occupancy queries, allocator)
        job.on_ranks(step)
        job.join()
    torch.cuda.synchronize()
    graphs, outs = [], []
    for r in range(ep_size):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=job.streams[r]):
            outs.append(step(r))
        graphs.append(g)
    torch.cuda.synchronize()
    start_round = job.flag_val(0)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for it in range(100):
        fresh = [_exact_inputs(job, T, hidden, gen) for _ in range(ep_size)]

        def replay(r):
            static[r][0].copy_(fresh[r][0])
            static[r][1].copy_(fresh[r][1])
            graphs[r].replay()

        job.on_ranks(replay)
        job.join()
        for r in range(ep_size):
            ref = _exact_reference(job, fresh[r][0], fresh[r][1], owner_table, weights)
            bad += (outs[r].float() != ref).sum()
    torch.cuda.synchronize()
    assert bad.item() == 0
    assert all(job.flag_val(r) == start_round + 100 for r in range(ep_size))
    for p in job.planes:
        p.check()


def _one_round(job, T=8, hidden=64):
    pl = job.layout(T, [2 * hidden], 2 * hidden)
    experts = [rand_experts(T, job.top_k, job.num_experts) for _ in range(job.ep_size)]
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(job.ep_size)]
    outs = run_round(job, experts, [[x.view(torch.uint8)] for x in xs], pl, 0, torch.bfloat16)
    for r in range(job.ep_size):
        close(outs[r], combine_reference(job, experts[r], xs[r]), torch.bfloat16)
    return pl


def _context_usable():
    torch.cuda.synchronize()
    assert (torch.arange(10, device="cuda") * 2).sum().item() == 90


def _usable_after_rearm(job):
    """After a failed wait: the context still works, and after a re-arm rank 0's records are
    clear and a round completes on every rank."""
    _context_usable()
    job.rearm()
    job.planes[0].check()
    _one_round(job)


def test_peer_never_arrives_dispatch_times_out(make_job):
    job = make_job(2, 16, 2, 8, 128, 128, timeout=0.5)
    pl = _one_round(job)  # round 1 completes on both ranks
    experts = rand_experts(8, 2, 8)
    x = torch.randn(8, 64, device="cuda").bfloat16()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    job.on_ranks(lambda r: job.planes[r].dispatch(experts, [x.view(torch.uint8)], 8, pl, 8), ranks=[0])
    job.streams[0].synchronize()
    elapsed = time.monotonic() - t0
    assert 0.4 < elapsed < 10.0, elapsed
    rec = job.control.status(0)
    assert rec.code == L.STATUS_TIMEOUT
    assert rec.peer == 1 and rec.round == L.INITIAL_ROUND + 1 and rec.phase == L.PHASE_DISPATCH
    assert rec.waited_ns >= 0.45e9
    with pytest.raises(errors.PeerTimeout) as info:
        job.planes[0].check()
    assert info.value.peer == 1 and info.value.phase == "dispatch" and info.value.round == L.INITIAL_ROUND + 1
    job.planes[1].check()  # rank 1 never waited
    _usable_after_rearm(job)


@pytest.mark.parametrize("collector", ["off", "on"])
def test_a_synchronizing_finalizer_mid_round(make_job, collector):
    """Garbage whose finalizer synchronizes the device (as an earlier test's mapping or device
    memory freed does) made between rank 0's dispatch and rank 1's, with the collector's
    threshold at one object. "on" (the collector turned back on): it runs before rank 1's
    dispatch is queued, waits for rank 0's, which waits for rank 1 until its timeout: rank 0
    reports PeerTimeout naming rank 1. "off" (make_job's own setting): the round completes and
    is exact, and the finalizer runs only at the next collection."""
    T, top_k, num_experts, hidden, dtype = 4, 2, 4, 256, torch.bfloat16
    job = make_job(2, T, top_k, num_experts, 2 * hidden + 4 * top_k, 2 * hidden, timeout=1.0)
    assert not gc.isenabled()
    ran = []

    class Synchronizes:
        def __del__(self):
            torch.cuda.synchronize()
            ran.append(time.monotonic())

    def garbage():
        a, b = Synchronizes(), Synchronizes()
        a.other, b.other = b, a  # a cycle: only a collection frees it

    pl = job.layout(T, [2 * hidden, 4 * top_k], 2 * hidden)
    experts = [rand_experts(T, top_k, num_experts) for _ in range(2)]
    xs = [torch.randn(T, hidden, device="cuda").to(dtype) for _ in range(2)]
    payloads = [[xs[r].view(torch.uint8), experts[r].view(torch.uint8)] for r in range(2)]
    torch.cuda.synchronize()

    def dispatch(r):
        job.planes[r].dispatch(experts[r], payloads[r], T, pl, num_experts)
        if r == 0:
            garbage()

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    if collector == "on":
        gc.enable()
    try:
        t0 = time.monotonic()
        job.on_ranks(dispatch)
        queued = time.monotonic() - t0
    finally:
        gc.disable()
        gc.set_threshold(*threshold)
    job.join()
    torch.cuda.synchronize()
    if collector == "on":
        assert len(ran) == 2 and queued > 0.9, (ran, queued)  # it ran while rank 1 was not queued yet
        with pytest.raises(errors.PeerTimeout) as info:
            job.planes[0].check()
        assert info.value.peer == 1 and info.value.phase == "dispatch", info.value
        return
    assert ran == [] and queued < 0.9, (ran, queued)
    outs = job.on_ranks(lambda r: job.planes[r].combine(
        (job.region(r, pl.dispatch_offsets[0], 2 * hidden).view(dtype).float() * expert_weight(r)).to(dtype),
        T, T, pl, False))
    job.join()
    torch.cuda.synchronize()
    for r in range(2):
        job.planes[r].check()
        close(outs[r], combine_reference(job, experts[r], xs[r]), dtype)
    gc.collect()
    assert len(ran) == 2


def test_peer_never_arrives_combine_times_out(make_job):
    job = make_job(2, 256, 4, 8, 2048, 2048, timeout=0.5)
    T, hidden = 256, 1024
    pl = job.layout(T, [2 * hidden], 2 * hidden)
    experts = [rand_experts(T, 4, 8) for _ in range(2)]
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(2)]
    job.on_ranks(lambda r: job.planes[r].dispatch(experts[r], [xs[r].view(torch.uint8)], T, pl, 8))
    job.join()
    torch.cuda.synchronize()
    comb = torch.randn(2, T, hidden, device="cuda").bfloat16()
    job.on_ranks(lambda r: job.planes[r].combine(comb, T, T, pl, False), ranks=[0])  # many blocks wait
    job.streams[0].synchronize()
    rec = job.control.status(0)
    assert rec.code == L.STATUS_TIMEOUT and rec.peer == 1 and rec.phase == L.PHASE_COMBINE
    assert rec.round == L.INITIAL_ROUND
    with pytest.raises(errors.PeerTimeout) as info:
        job.planes[0].check()
    assert info.value.phase == "combine"
    _context_usable()
    job.rearm()
    _one_round(job)


@pytest.mark.parametrize("how", ["timeout", "abort"])
def test_lines_that_never_come_end_the_wait(make_job, how):
    """A peer whose head came but whose lines never do (as if it had died while staging): the
    pullers spin on the lines and end at the timeout (this one-block launch's pullers are the
    poller's; twice the timeout in other blocks) with a timeout record naming the peer, or at
    the job's abort word (aborted, naming the peer); the job is usable after a re-arm."""
    timeout = 0.5 if how == "timeout" else 60.0
    job = make_job(2, 16, 2, 8, 128, 128, timeout=timeout)
    pl = _one_round(job)
    T, hidden = 8, 64
    experts = [torch.tensor([[4, 5]] * T, dtype=torch.int32, device="cuda"), rand_experts(T, 2, 8)]  # all to rank 1
    xs = [torch.randn(T, hidden, device="cuda").bfloat16() for _ in range(2)]
    job.on_ranks(lambda r: job.planes[r].dispatch(experts[r], [xs[r].view(torch.uint8)], T, pl, 8))
    job.join()
    torch.cuda.synchronize()
    round_ = job.flag_val(0)
    head = (round_ << 32) | L.combine_spec(hidden, torch.bfloat16)
    job.tail(0)[16:32].view(torch.int64).copy_(torch.tensor([head, head], dtype=torch.int64))  # rank 0's head of 1
    comb = torch.randn(2, T, hidden, device="cuda").bfloat16()
    t0 = time.monotonic()
    job.on_ranks(lambda r: job.planes[r].combine(comb, T, T, pl, False), ranks=[0])
    if how == "abort":
        time.sleep(0.2)
        job.control.set_abort(L.ABORT_PEER_LOST, rank=1)
    job.streams[0].synchronize()
    elapsed = time.monotonic() - t0
    rec = job.control.status(0)
    assert rec.peer == 1 and rec.phase == L.PHASE_COMBINE and rec.round == round_, rec
    if how == "timeout":
        assert rec.code == L.STATUS_TIMEOUT and rec.waited_ns >= 0.45e9, rec
        assert 0.45 < elapsed < 10.0, elapsed
        with pytest.raises(errors.PeerTimeout) as info:
            job.planes[0].check()
        assert info.value.peer == 1 and info.value.phase == "combine"
    else:
        assert rec.code == L.STATUS_ABORTED, rec
        assert elapsed < 10.0, elapsed
        with pytest.raises(errors.PeerLost) as info:
            job.planes[0].check()
        assert info.value.rank == 1
    _usable_after_rearm(job)


def test_abort_word_ends_a_wait_early(make_job):
    job = make_job(2, 16, 2, 8, 128, 128, timeout=60.0)
    pl = _one_round(job)
    experts = rand_experts(8, 2, 8)
    x = torch.randn(8, 64, device="cuda").bfloat16()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    job.on_ranks(lambda r: job.planes[r].dispatch(experts, [x.view(torch.uint8)], 8, pl, 8), ranks=[0])
    time.sleep(0.2)
    job.control.set_abort(L.ABORT_PEER_LOST, rank=1)
    job.streams[0].synchronize()
    assert time.monotonic() - t0 < 10.0
    rec = job.control.status(0)
    assert rec.code == L.STATUS_ABORTED and rec.peer == 1 and rec.phase == L.PHASE_DISPATCH
    with pytest.raises(errors.PeerLost) as info:
        job.planes[0].check()
    assert info.value.rank == 1
    _usable_after_rearm(job)


def test_bad_inputs_are_refused_before_launch(make_job):
    """What the binding checks in every build, straight below the planes (a call that bypasses
    the front end): more tokens than rt, ids of another element size, a payload of another
    token count, a combine payload of another dtype (each keeps the kernels inside their
    tensors). What only the front end refuses in a production build (payload_in_workspace
    with another tensor, ...) is in test_cuda_wide.py; the front end refuses these too."""
    job = make_job(2, 16, 2, 8, 128, 128)
    pl = job.layout(8, [128], 128)
    p = job.planes[0]
    good = rand_experts(8, 2, 8)
    with pytest.raises(RuntimeError, match="runtime_max_tokens_per_rank"):
        p.dispatch(rand_experts(9, 2, 8), [rand_bytes(9, 128)], 8, pl, 8)
    with pytest.raises(RuntimeError, match="int32"):
        p.dispatch(good.long(), [rand_bytes(8, 128)], 8, pl, 8)
    with pytest.raises(RuntimeError, match="input_payloads"):
        p.dispatch(good, [rand_bytes(7, 128)], 8, pl, 8)
    with pytest.raises(RuntimeError, match="payload"):
        p.combine(torch.zeros(2, 8, 64, dtype=torch.int32, device="cuda"), 8, 8, pl, False)
    torch.cuda.synchronize()
    assert all(job.flag_val(r) == L.INITIAL_ROUND for r in range(2))  # nothing ran


def test_ops_trace_under_torch_compile(make_job):
    """Single-rank job (it needs no peers): dispatch + combine compiled with fullgraph."""
    job = make_job(1, 16, 2, 4, 2 * 64, 2 * 64)
    pl = job.layout(16, [2 * 64], 2 * 64)
    plane = job.planes[0]

    def step(experts, x):
        plane.dispatch(experts, [x.view(torch.uint8)], 16, pl, 4)
        recv = job.region(0, pl.dispatch_offsets[0], 2 * 64).view(torch.bfloat16)
        return plane.combine(recv * 2.0, experts.shape[0], 16, pl, False)

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        experts = rand_experts(16, 2, 4)
        x = torch.randn(16, 64, device="cuda").bfloat16()
        out = compiled(experts, x)
        torch.testing.assert_close(out.float(), x.float() * 2.0)
