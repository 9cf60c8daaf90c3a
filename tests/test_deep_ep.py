"""``a2ad.deep_ep``, DeepEP's low-latency API, with real processes on a real daemon.

The multi-rank scenarios run in the shared pool of rank processes (``_helpers_dataplane``)
against the session's host-backend daemon; each rank makes a gloo process group (the
``group`` DeepEP callers pass), builds a ``Buffer`` and checks every result against a
one-process reference computed from the seeded inputs of every rank: the rows of each
expert (per source block, and as sets), ``recv_count``, ``src_info`` / ``layout_range``, the
FP8 values and scales, and the weighted combine, exact on small integers.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from _helpers_dataplane import dataplane_daemons, rank_pool  # noqa: F401  (fixtures)
from a2ad import errors

HIDDEN = 512
NUM_MAX = 6
TOPK = 4


# ---------------------------------------------------------------------------
# The reference (every rank computes it for every rank from the same seed)
# ---------------------------------------------------------------------------
def make_inputs(seed, ep, num_experts, topk=TOPK, num_max=NUM_MAX, hidden=HIDDEN, minus_ones=True, floats=False):
    """Per rank: (x bf16 [T, H], topk_idx int64 [T, topk], weights float32 [T, topk]). Values are
    small integers (exact sums) unless ``floats``; about a fifth of the ids are -1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ep):
        t = int(torch.randint(0, num_max + 1, (1,), generator=g))
        idx = torch.rand(t, num_experts, generator=g).argsort(dim=1)[:, :topk].to(torch.int64)
        if minus_ones:
            idx[torch.rand(t, topk, generator=g) < 0.2] = -1
        if floats:  # blocks of very different magnitudes, some tiny (the amax floor)
            mag = torch.exp2(torch.randint(-20, 8, (t, hidden // 128, 1), generator=g).float())
            x = (torch.randn(t, hidden // 128, 128, generator=g) * mag).view(t, hidden).to(torch.bfloat16)
        else:
            x = torch.randint(-4, 5, (t, hidden), generator=g).to(torch.bfloat16)
        w = torch.randint(1, 5, (t, topk), generator=g).float() * 0.5
        out.append((x, idx, w))
    return out


def expert_factor(e: int) -> int:
    return 1 + e % 3


def expected_combine(inputs, rank, num_experts, ep, alive=None, magnitude=False):
    """bf16 [T, H]: sum over k of w * factor(e) * x, in float32, rounded once; experts of ranks
    outside ``alive`` contribute nothing. ``magnitude``: the float32 sum of the terms' absolute
    values instead (a bound's scale)."""
    x, idx, w = inputs[rank]
    lx = num_experts // ep
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0 or (alive is not None and e // lx not in alive):
                continue
            term = w[t, k] * expert_factor(e) * x[t].float()
            acc[t] += term.abs() if magnitude else term
    return acc if magnitude else acc.to(torch.bfloat16)


def check_dispatch(rank, ep, inputs, num_experts, recv_x, recv_count, handle, alive=None, what=""):
    """recv_x (bf16, or the dequantized FP8) against every source's tokens."""
    from a2ad.client import reference as ref

    src_info, layout_range, num_max, hidden, ne = handle
    assert (num_max, ne) == (NUM_MAX, num_experts) and hidden == inputs[0][0].shape[1], (what, handle[2:])
    lx = num_experts // ep
    assert recv_x.shape == (lx, ep * NUM_MAX, hidden) and recv_count.shape == (lx,), what
    assert recv_count.dtype == torch.int32 and src_info.dtype == torch.int32 and layout_range.dtype == torch.int64
    assert src_info.shape == (lx, ep * NUM_MAX) and layout_range.shape == (lx, ep), what
    for le in range(lx):
        e = rank * lx + le
        total = 0
        blocks = []
        want_rows = []
        for s in range(ep):
            x, idx, _ = inputs[s]
            tokens = sorted(int(t) for t in (idx == e).any(1).nonzero().flatten()) if x.shape[0] else []
            if alive is not None and s not in alive:
                tokens = []
            lr = int(layout_range[le, s])
            begin, count = lr >> 32, lr & 0xFFFFFFFF
            assert count == len(tokens), f"{what} rank {rank} expert {e} source {s}: count {count} != {len(tokens)}"
            got_tokens = src_info[le, begin:begin + count].tolist()
            assert sorted(got_tokens) == tokens, f"{what} expert {e} source {s}: src_info {got_tokens} != {tokens}"
            for i, t in enumerate(got_tokens):
                assert torch.equal(recv_x[le, begin + i], x[t]), f"{what} expert {e} source {s} token {t}: row differs"
            if count:
                blocks.append((begin, count))
            want_rows.extend(x[t] for t in tokens)
            total += count
        assert int(recv_count[le]) == total, f"{what} expert {e}: recv_count {int(recv_count[le])} != {total}"
        pos = 0  # the blocks tile [0, total)
        for begin, count in sorted(blocks):
            assert begin == pos, f"{what} expert {e}: blocks {sorted(blocks)} do not tile [0, {total})"
            pos += count
        if total:  # and the rows of the expert, as a set
            got = recv_x[le, :total].contiguous().view(torch.uint8)
            want = torch.stack(want_rows).contiguous().view(torch.uint8)
            assert ref.same_rows(got, want), f"{what} expert {e}: rows differ as a set"


def expert_outputs(recv_x, rank, num_experts, ep):
    """bf16 [L, R * num_max, H]: expert e multiplies by factor(e)."""
    lx = num_experts // ep
    f = torch.tensor([expert_factor(rank * lx + le) for le in range(lx)], dtype=torch.float32)
    return (recv_x.float() * f.view(lx, 1, 1)).to(torch.bfloat16)


def dequant(data, scales, ue8m0):
    """float32 values of FP8 recv_x with DeepEP's scales ([L, N, H/128] float32, or packed int32)."""
    if ue8m0:
        b = scales.contiguous().reshape(-1).view(torch.uint8).view(*scales.shape[:-1], -1).int()
        scales = torch.exp2(b.float() - 127)
    lx, n, h = data.shape
    return (data.float().view(lx, n, h // 128, 128) * scales.unsqueeze(-1)).view(lx, n, h)


def check_fp8(rank, ep, inputs, num_experts, recv, recv_count, handle, round_scale, ue8m0, what):
    data, scales = recv
    lx, n, h = data.shape
    assert data.dtype == torch.float8_e4m3fn, what
    if ue8m0:
        assert scales.dtype == torch.int32 and scales.shape == (lx, n, h // 512), what
    else:
        assert scales.dtype == torch.float32 and scales.shape == (lx, n, h // 128), what
    assert scales.stride() == (scales.shape[2] * n, 1, n), f"{what}: scales not column-major: {scales.stride()}"
    src_info, layout_range = handle[0], handle[1]
    if ue8m0:
        fs = torch.exp2(scales.contiguous().reshape(-1).view(torch.uint8).view(lx, n, -1).float() - 127)
    else:
        fs = scales
    vals = dequant(data, scales, ue8m0)
    for le in range(lx):
        e = rank * lx + le
        for s in range(ep):
            lr = int(layout_range[le, s])
            begin, count = lr >> 32, lr & 0xFFFFFFFF
            x, idx, _ = inputs[s]
            want_tokens = sorted(int(t) for t in (idx == e).any(1).nonzero().flatten()) if x.shape[0] else []
            assert count == len(want_tokens) and sorted(src_info[le, begin:begin + count].tolist()) == want_tokens
            for i in range(count):
                t = int(src_info[le, begin + i])
                xf = x[t].float().view(-1, 128)
                amax = xf.abs().amax(1).clamp_min(1e-4)
                exact = amax / 448.0
                sc = fs[le, begin + i]
                if round_scale:
                    pow2 = torch.log2(sc) == torch.round(torch.log2(sc))
                    assert bool(pow2.all()), f"{what}: scale not a power of 2"
                    assert bool((sc >= exact).all() and (sc < 2 * exact).all()), f"{what}: rounded scale out of range"
                else:
                    assert torch.allclose(sc, exact, rtol=1e-6, atol=0), f"{what}: scale {sc} != amax/448 {exact}"
                got = vals[le, begin + i].view(-1, 128)
                bound = xf.abs() * 2.0 ** -4 + sc.unsqueeze(1) * 2.0 ** -9 + 1e-30
                assert bool(((got - xf).abs() <= bound).all()), f"{what}: FP8 value out of bound at token {t}"
        assert int(recv_count[le]) == sum(int(layout_range[le, s]) & 0xFFFFFFFF for s in range(ep))


# ---------------------------------------------------------------------------
# Rank bodies
# ---------------------------------------------------------------------------
def _group(rank, ep, init_file):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ep)
    return dist.group.WORLD


def _ungroup():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _buffer(group, ep, num_experts, runtime_dir, **kw):
    import a2ad.deep_ep as deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(NUM_MAX, HIDDEN, ep, num_experts)
    kw.setdefault("explicitly_destroy", True)
    return deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, runtime_dir=runtime_dir, timeout=20.0,
                          **kw)


def _round(buf, rank, ep, inputs, num_experts, dev, what, **dispatch_kw):
    """One bf16 round checked end to end; returns the combine output (CPU)."""
    x, idx, w = (t.to(dev) for t in inputs[rank])
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_MAX, num_experts, use_fp8=False,
                                                                       **dispatch_kw)
    assert hook is None
    check_dispatch(rank, ep, inputs, num_experts, recv_x.cpu(), recv_count.cpu(), [handle[0].cpu(), handle[1].cpu(),
                   *handle[2:]], what=what)
    y = expert_outputs(recv_x.cpu(), rank, num_experts, ep).to(dev)
    out, ev, h = buf.low_latency_combine(y, idx, w, handle)
    assert h is None and ev is None
    want = expected_combine(inputs, rank, num_experts, ep)
    assert out.dtype == torch.bfloat16 and torch.equal(out.cpu(), want), f"{what} rank {rank}: combine differs"
    return out


def ll_rounds(rank, ep, runtime_dir, init_file, device="cpu", kernels=False):
    """Every path of dispatch and combine on one Buffer, each checked, then the error cases.
    ``kernels``: the CUDA Buffer runs the extension's kernels around a2ad's."""
    import a2ad.deep_ep as deep_ep

    dev = torch.device(device if device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = _group(rank, ep, init_file)
    E = 2 * ep
    try:
        buf = _buffer(group, ep, E, runtime_dir, kernels=kernels)
        assert buf.kernels is kernels
        assert (buf.rank, buf.group_size, buf.group) == (rank, ep, group)
        assert buf.low_latency_mode and buf.explicitly_destroy and not buf.enable_shrink
        assert buf.num_rdma_bytes > 0 and buf.num_nvl_bytes == 0 and buf.runtime is not None
        assert deep_ep.Buffer.num_sms == 20 and deep_ep.topk_idx_t == torch.int64
        n = 0
        try:
            # 1. bf16 with -1 ids, cumulative stats, out=
            stats = torch.zeros(2, dtype=torch.int32, device=dev)
            total = torch.zeros(2, dtype=torch.int32)
            for rnd in range(3):
                inputs = make_inputs(100 + rnd, ep, E)
                x, idx, w = (t.to(dev) for t in inputs[rank])
                recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
                    x, idx, NUM_MAX, E, cumulative_local_expert_recv_stats=stats, use_fp8=False)
                assert event is None and hook is None
                check_dispatch(rank, ep, inputs, E, recv_x.cpu(), recv_count.cpu(),
                               [handle[0].cpu(), handle[1].cpu(), *handle[2:]], what=f"bf16 round {rnd}")
                total += recv_count.cpu()
                assert torch.equal(stats.cpu(), total), "cumulative_local_expert_recv_stats"
                y = expert_outputs(recv_x.cpu(), rank, E, ep).to(dev)
                out = torch.full((x.shape[0], HIDDEN), 7.0, dtype=torch.bfloat16, device=dev)
                res, ev, h = buf.low_latency_combine(y, idx, w, handle, out=out)
                assert res is out and ev is None and h is None
                assert torch.equal(out.cpu(), expected_combine(inputs, rank, E, ep)), f"out= round {rnd}"
                n += 1

            # 2. the receive hooks
            inputs = make_inputs(200, ep, E)
            x, idx, w = (t.to(dev) for t in inputs[rank])
            recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False,
                                                                               return_recv_hook=True)
            assert event is None and callable(hook)
            hook()
            check_dispatch(rank, ep, inputs, E, recv_x.cpu(), recv_count.cpu(),
                           [handle[0].cpu(), handle[1].cpu(), *handle[2:]], what="hook")
            y = expert_outputs(recv_x.cpu(), rank, E, ep).to(dev)
            res, ev, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
            assert ev is None and callable(h)
            h()
            assert torch.equal(res.cpu(), expected_combine(inputs, rank, E, ep)), "combine hook"
            n += 1

            # 3. async_finish: EventOverlap (a context manager too)
            inputs = make_inputs(300, ep, E)
            x, idx, w = (t.to(dev) for t in inputs[rank])
            recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False,
                                                                               async_finish=True)
            assert isinstance(event, deep_ep.EventOverlap) and hook is None
            event.current_stream_wait()
            check_dispatch(rank, ep, inputs, E, recv_x.cpu(), recv_count.cpu(),
                           [handle[0].cpu(), handle[1].cpu(), *handle[2:]], what="async")
            y = expert_outputs(recv_x.cpu(), rank, E, ep).to(dev)
            res, ev, h = buf.low_latency_combine(y, idx, w, handle, async_finish=True)
            with ev:
                pass
            assert torch.equal(res.cpu(), expected_combine(inputs, rank, E, ep)), "combine async"
            n += 1

            # 4. zero_copy: the outputs written into get_next_low_latency_combine_buffer
            inputs = make_inputs(400, ep, E)
            x, idx, w = (t.to(dev) for t in inputs[rank])
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
            zbuf = buf.get_next_low_latency_combine_buffer(handle)
            assert zbuf.shape == (2, ep * NUM_MAX, HIDDEN) and zbuf.dtype == torch.bfloat16
            zbuf.copy_(expert_outputs(recv_x.cpu(), rank, E, ep).to(dev))
            res, _, _ = buf.low_latency_combine(zbuf, idx, w, handle, zero_copy=True)
            assert torch.equal(res.cpu(), expected_combine(inputs, rank, E, ep)), "zero_copy"
            n += 1

            # 5. two rounds open at once (DeepEP's double buffer), combined in either order
            ins = [make_inputs(500 + i, ep, E) for i in range(2)]
            opened = []
            for i in range(2):
                x, idx, w = (t.to(dev) for t in ins[i][rank])
                opened.append((buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False), idx, w))
            with pytest.raises(errors.StateError, match="double buffer"):
                buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
            for i in (1, 0):
                (recv_x, recv_count, handle, _, _), idx, w = opened[i]
                check_dispatch(rank, ep, ins[i], E, recv_x.cpu(), recv_count.cpu(),
                               [handle[0].cpu(), handle[1].cpu(), *handle[2:]], what=f"double buffer {i}")
                y = expert_outputs(recv_x.cpu(), rank, E, ep).to(dev)
                res, _, _ = buf.low_latency_combine(y, idx, w, handle)
                assert torch.equal(res.cpu(), expected_combine(ins[i], rank, E, ep)), f"double buffer {i}"
                with pytest.raises(errors.StateError, match="already combined"):
                    buf.low_latency_combine(y, idx, w, handle)
            n += 2

            # 6. FP8: plain, round_scale, round_scale + UE8M0; combine within FP8's bound
            for rnd, (rs, ue) in enumerate([(False, False), (True, False), (True, True)]):
                inputs = make_inputs(600 + rnd, ep, E, floats=True)
                x, idx, w = (t.to(dev) for t in inputs[rank])
                (data, scales), recv_count, handle, _, _ = buf.low_latency_dispatch(
                    x, idx, NUM_MAX, E, round_scale=rs, use_ue8m0=ue)
                what = f"fp8 round_scale={rs} ue8m0={ue}"
                check_fp8(rank, ep, inputs, E, (data.cpu(), scales.cpu()), recv_count.cpu(),
                          [handle[0].cpu(), handle[1].cpu()], rs, ue, what)
                vals = dequant(data.cpu(), scales.cpu(), ue)
                y = expert_outputs(vals.to(torch.bfloat16), rank, E, ep).to(dev)
                res, _, _ = buf.low_latency_combine(y, idx, w, handle)
                want = expected_combine(inputs, rank, E, ep).float()
                bound = expected_combine(inputs, rank, E, ep, magnitude=True) * 2.0 ** -3 + 1e-6
                assert bool(((res.cpu().float() - want).abs() <= bound).all()), f"{what}: combine"
                n += 1

            # 7. a token with no expert at all, and zero tokens on every rank
            inputs = make_inputs(700, ep, E)
            for _, i_, _ in inputs:
                if i_.shape[0]:
                    i_[0] = -1
            _round(buf, rank, ep, inputs, E, dev, "token without experts")
            empty = [(torch.zeros(0, HIDDEN, dtype=torch.bfloat16), torch.zeros(0, TOPK, dtype=torch.int64),
                      torch.zeros(0, TOPK)) for _ in range(ep)]
            out = _round(buf, rank, ep, empty, E, dev, "no tokens")
            assert out.shape == (0, HIDDEN)
            n += 2

            # 7b. CUDA: an expert id past num_experts is routed nowhere, the round completes, and a
            # later call raises it, naming the (token, k) pair (t * topk + k) and the id
            if dev.type == "cuda":
                x = torch.ones(2, HIDDEN, dtype=torch.bfloat16, device=dev)
                idx = torch.tensor([[0, -1], [E, 1]], dtype=torch.int64, device=dev)
                w = torch.ones(2, 2, device=dev)
                recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
                raised = []
                try:
                    buf.low_latency_combine(torch.zeros_like(recv_x), idx, w, handle)
                except errors.InputError as exc:
                    raised.append(exc)
                torch.cuda.synchronize()
                if not raised:
                    with pytest.raises(errors.InputError) as got:
                        buf.low_latency_dispatch(x, idx.clamp(max=E - 1), NUM_MAX, E, use_fp8=False)
                    raised.append(got.value)
                assert raised[0].details["expert_id"] == E and raised[0].details["token"] == 2, raised[0].details
                _round(buf, rank, ep, make_inputs(701, ep, E), E, dev, "after a bad id")
                n += 1

            # 8. the rest of the surface
            buf.clean_low_latency_buffer(NUM_MAX, HIDDEN, E)  # a barrier
            scratch = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
            assert scratch.numel() == buf.num_rdma_bytes and scratch.dtype == torch.int8
            # vLLM's clean_buffers zeroes the whole buffer: no memory of num_rdma_bytes behind it
            assert scratch.untyped_storage().nbytes() < 4096, scratch.untyped_storage().nbytes()
            scratch.zero_()
            assert not bool(scratch.any())
            with pytest.raises(RuntimeError, match="single memory location"):
                scratch.copy_(torch.arange(scratch.numel(), device=dev).to(torch.int8))
            part = buf.get_local_buffer_tensor(torch.float32, (4, 8), offset=128, use_rdma_buffer=True)
            assert part.shape == (4, 8) and part.dtype == torch.float32
            part.copy_(torch.arange(32, dtype=torch.float32, device=dev).view(4, 8))
            again = buf.get_local_buffer_tensor(torch.float32, (4, 8), offset=128, use_rdma_buffer=True)
            assert torch.equal(again, part) and again.untyped_storage().nbytes() == 128 + 4 * 32
            assert isinstance(deep_ep.Buffer.capture(), deep_ep.EventOverlap)
            stream = buf.get_comm_stream()
            assert (stream is None) == (dev.type == "cpu")
            _round(buf, rank, ep, make_inputs(800, ep, E), E, dev, "after clean")
            n += 1
            n += bad_inputs(buf, rank, ep, E, dev)
        finally:
            buf.destroy()
        with pytest.raises(errors.StateError, match="destroyed"):
            buf.low_latency_dispatch(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64),
                                     NUM_MAX, E)
        if dev.type == "cpu":  # the kernels are CUDA's: asked for on the host backend, refused
            with pytest.raises(errors.InputError, match="kernels=True needs the cuda backend") as got:
                _buffer(group, ep, E, runtime_dir, kernels=True)
            assert got.value.details["argument"] == "kernels"
        # a Buffer made for the normal mode, and one without explicitly_destroy
        nb = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, runtime_dir=runtime_dir, timeout=20.0)
        try:
            with pytest.raises(deep_ep.NotSupported, match="low_latency_mode=True"):
                nb.low_latency_dispatch(torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=dev),
                                        torch.zeros(1, 1, dtype=torch.int64, device=dev), NUM_MAX, E)
            with pytest.raises(errors.StateError, match="explicitly_destroy=True"):
                nb.destroy()
        finally:
            nb._close()
        # comm= (an mpi4py-shaped communicator: Get_rank, Get_size, bcast) instead of group
        cb = deep_ep.Buffer(None, num_rdma_bytes=buf.num_rdma_bytes, low_latency_mode=True, explicitly_destroy=True,
                            comm=deep_ep._Comm(group), runtime_dir=runtime_dir, timeout=20.0)
        try:
            assert (cb.rank, cb.group_size) == (rank, ep) and cb.job != buf.job
            _round(cb, rank, ep, make_inputs(850, ep, E), E, dev, "comm=")
        finally:
            cb.destroy()
        return n + 1
    finally:
        _ungroup()


def bad_inputs(buf, rank, ep, E, dev) -> int:
    """Every refusal names its argument; none of them is a collective (no round starts)."""
    import a2ad.deep_ep as deep_ep

    x = torch.ones(3, HIDDEN, dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, 1], [2, -1], [-1, -1]], dtype=torch.int64, device=dev)
    cases = [
        (dict(x=torch.ones(NUM_MAX + 1, HIDDEN, dtype=torch.bfloat16, device=dev),
              topk_idx=torch.zeros(NUM_MAX + 1, 2, dtype=torch.int64, device=dev)), errors.InputError, "x"),
        (dict(num_experts=2 * ep + 1), errors.InputError, "num_experts"),
        (dict(topk_idx=torch.zeros(3, 12, dtype=torch.int64, device=dev)), errors.InputError, "topk_idx"),
        (dict(x=x.float()), errors.InputError, "x"),
        (dict(x=torch.ones(3, 200, dtype=torch.bfloat16, device=dev), use_fp8=True), errors.InputError, "x"),
        (dict(use_fp8=True, use_ue8m0=True), errors.InputError, "use_ue8m0"),
        (dict(async_finish=True, return_recv_hook=True), errors.InputError, "return_recv_hook"),
        (dict(use_nvfp4=True), deep_ep.NotSupported, "use_nvfp4"),
        (dict(topk_idx=idx.float()), errors.InputError, "topk_idx"),
        (dict(cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32, device=dev)), errors.InputError,
         "cumulative_local_expert_recv_stats"),
    ]
    if dev.type == "cpu":  # ids are read on the host only for CPU tensors
        cases += [
            (dict(topk_idx=torch.tensor([[0, E], [1, 2], [3, 0]], device=dev)), errors.InputError, "topk_idx"),
            (dict(topk_idx=torch.tensor([[1, 1], [1, 2], [3, 0]], device=dev)), errors.InputError, "topk_idx"),
        ]
    n = 0
    for kw, exc, arg in cases:
        args = dict(x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=NUM_MAX, num_experts=E, use_fp8=False) | kw
        with pytest.raises(exc) as got:
            buf.low_latency_dispatch(**args)
        assert got.value.details.get("argument") == arg, (kw.keys(), got.value.details, str(got.value))
        n += 1
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        with pytest.raises(deep_ep.NotSupported, match="low_latency_mode=True.*MoeAlltoAll"):
            getattr(buf, name)(x)
    for name in ("get_dispatch_config", "get_combine_config"):
        with pytest.raises(deep_ep.NotSupported):
            getattr(deep_ep.Buffer, name)(ep)
    for call in (lambda: buf.low_latency_update_mask_buffer(0, True),
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(ep, dtype=torch.int32)),
                 buf.low_latency_clean_mask_buffer):
        with pytest.raises(errors.StateError, match="enable_shrink=True"):
            call()
    # combine's refusals, on an open round (then the round is combined properly)
    w = torch.ones(3, 2, device=dev)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
    y = torch.zeros_like(recv_x)
    for kw, exc, arg in [
        (dict(use_logfmt=True), deep_ep.NotSupported, "use_logfmt"),
        (dict(overlap=True, num_sms=3), deep_ep.NotSupported, "overlap"),
        (dict(overlap=False, comp_signal=torch.zeros(1)), deep_ep.NotSupported, "comp_signal"),
        (dict(x=y.float()), errors.InputError, "x"),
        (dict(topk_weights=w.double()), errors.InputError, "topk_weights"),
        (dict(topk_idx=idx[:2]), errors.InputError, "topk_idx"),
        (dict(out=torch.zeros(3, HIDDEN, device=dev)), errors.InputError, "out"),
        (dict(handle=tuple(handle)), errors.InputError, "handle"),
    ]:
        args = dict(x=y, topk_idx=idx, topk_weights=w, handle=handle) | kw
        with pytest.raises(exc) as got:
            buf.low_latency_combine(**args)
        assert got.value.details.get("argument") == arg, (kw.keys(), got.value.details)
        n += 1
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        buf.low_latency_combine(y, idx, w, handle, bogus=1)
    # overlap arguments that ask for nothing are accepted
    out, _, _ = buf.low_latency_combine(y, idx, w, handle, overlap=False, packed_recv_count=None)
    assert torch.equal(out.cpu(), torch.zeros(3, HIDDEN, dtype=torch.bfloat16))
    return n


def shrink_kill(rank, ep, runtime_dir, init_file, victim, stamp, device="cpu", kernels=False):
    """enable_shrink: the victim dies by SIGKILL between rounds; the survivors see it masked
    through low_latency_query_mask_buffer (returned: seconds from the kill), and their rounds
    go on without it."""
    dev = torch.device(device if device == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = _group(rank, ep, init_file)
    E = 2 * ep
    try:
        buf = _buffer(group, ep, E, runtime_dir, enable_shrink=True, kernels=kernels)
        try:
            status = torch.full((ep,), 5, dtype=torch.int32)
            buf.low_latency_query_mask_buffer(status)
            assert status.tolist() == [0] * ep
            other = (rank + 1) % ep
            buf.low_latency_update_mask_buffer(other, True)
            buf.low_latency_query_mask_buffer(status)
            assert status.tolist() == [int(r == other) for r in range(ep)], status
            buf.low_latency_update_mask_buffer(other, False)
            buf.low_latency_update_mask_buffer(other, True)
            buf.low_latency_clean_mask_buffer()
            buf.low_latency_query_mask_buffer(status)
            assert status.tolist() == [0] * ep
            with pytest.raises(errors.InputError, match="itself"):
                buf.low_latency_update_mask_buffer(rank, True)
            _round(buf, rank, ep, make_inputs(900, ep, E), E, dev, "before the loss")
            buf.clean_low_latency_buffer(NUM_MAX, HIDDEN, E)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if rank == victim:
                Path(stamp).write_text(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while True:
                buf.low_latency_query_mask_buffer(status)
                if status[victim] == 1:
                    break
                assert time.monotonic() < deadline, "the lost rank never showed in the mask"
                time.sleep(0.0005)
            seen = time.monotonic()
            died = float(Path(stamp).read_text())
            assert status.tolist() == [int(r == victim) for r in range(ep)], status
            alive = [r for r in range(ep) if r != victim]
            for rnd in range(2):
                inputs = make_inputs(1000 + rnd, ep, E)
                x, idx, w = (t.to(dev) for t in inputs[rank])
                recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
                recv_x, recv_count, host_handle = recv_x.cpu(), recv_count.cpu(), [handle[0].cpu(), handle[1].cpu(),
                                                                                 *handle[2:]]
                check_dispatch(rank, ep, inputs, E, recv_x, recv_count, host_handle, alive=alive, what=f"shrunk {rnd}")
                assert int((host_handle[1][:, victim] & 0xFFFFFFFF).sum()) == 0
                y = expert_outputs(recv_x, rank, E, ep).to(dev)
                out, _, _ = buf.low_latency_combine(y, idx, w, handle)
                assert torch.equal(out.cpu(), expected_combine(inputs, rank, E, ep, alive=alive)), \
                    f"shrunk combine {rnd}"
            buf.clean_low_latency_buffer(NUM_MAX, HIDDEN, E)
            # a geometry not dispatched before the loss cannot be set up: refused at once
            t0 = time.monotonic()
            with pytest.raises(errors.StateError, match="lost"):
                buf.low_latency_dispatch(x, idx[:, :2], NUM_MAX, E, use_fp8=False)  # another topk
            assert time.monotonic() - t0 < 1.0
            return seen - died
        finally:
            buf.destroy()
    finally:
        _ungroup()


def no_shrink_kill(rank, ep, runtime_dir, init_file, victim):
    """Without enable_shrink a dead peer is a2ad's PeerLost, not a hang."""
    group = _group(rank, ep, init_file)
    E = 2 * ep
    try:
        buf = _buffer(group, ep, E, runtime_dir)
        try:
            _round(buf, rank, ep, make_inputs(1100, ep, E), E, torch.device("cpu"), "before the loss")
            buf.clean_low_latency_buffer(NUM_MAX, HIDDEN, E)
            if rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.2)
            x, idx, w = make_inputs(1101, ep, E)[rank]
            t0 = time.monotonic()
            with pytest.raises(errors.PeerLost):
                buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False)
            took = time.monotonic() - t0
            with pytest.raises(errors.PeerLost):  # a new geometry too, at once
                buf.low_latency_dispatch(x, idx[:, :2], NUM_MAX, E, use_fp8=False)  # another topk
            return max(took, time.monotonic() - t0)
        finally:
            buf.destroy()
    finally:
        _ungroup()


def sync_free(rank, ep, runtime_dir, init_file, kernels=False):
    """CUDA: once a geometry's job exists, dispatch (bf16 and FP8, hook or not) and combine
    never synchronize with the host (torch.cuda.set_sync_debug_mode("error") raises on any
    sync); the results are checked afterwards."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    group = _group(rank, ep, init_file)
    E = 2 * ep
    try:
        buf = _buffer(group, ep, E, runtime_dir, kernels=kernels)
        assert buf.kernels is kernels
        try:
            _round(buf, rank, ep, make_inputs(1200, ep, E), E, dev, "warm-up")
            inputs = make_inputs(1201, ep, E)
            x, idx, w = (t.to(dev) for t in inputs[rank])
            # (a tensor made from a Python list is a host-to-device copy: before the checked part)
            factors = torch.tensor([expert_factor(rank * (E // ep) + le) for le in range(E // ep)],
                                   device=dev, dtype=torch.float32)
            torch.cuda.synchronize(dev)
            torch.cuda.set_sync_debug_mode("error")
            try:
                recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False,
                                                                               return_recv_hook=True)
                hook()
                y = (recv_x.float() * factors.view(-1, 1, 1)).to(torch.bfloat16)
                out, _, _ = buf.low_latency_combine(y, idx, w, handle)
                (q, sc), _, h8, _, _ = buf.low_latency_dispatch(x, idx, NUM_MAX, E, round_scale=True, use_ue8m0=True)
                buf.low_latency_combine(torch.zeros(q.shape, dtype=torch.bfloat16, device=dev), idx, w, h8)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(dev)
            check_dispatch(rank, ep, inputs, E, recv_x.cpu(), recv_count.cpu(),
                           [handle[0].cpu(), handle[1].cpu(), *handle[2:]], what="sync-free")
            assert torch.equal(out.cpu(), expected_combine(inputs, rank, E, ep)), "sync-free combine"
        finally:
            buf.destroy()
        # the mask API of enable_shrink (vLLM queries it every step) into a device tensor
        sb = _buffer(group, ep, E, runtime_dir, enable_shrink=True, kernels=kernels)
        try:
            other = (rank + 1) % ep
            status = torch.full((ep,), 7, dtype=torch.int32, device=dev)
            seen = []
            torch.cuda.synchronize(dev)
            torch.cuda.set_sync_debug_mode("error")
            try:
                sb.low_latency_query_mask_buffer(status)
                seen.append(status.clone())
                sb.low_latency_update_mask_buffer(other, True)
                sb.low_latency_query_mask_buffer(status)
                seen.append(status.clone())
                sb.low_latency_clean_mask_buffer()
                sb.low_latency_query_mask_buffer(status)
                seen.append(status.clone())
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(dev)
            # no rank leaves the job (destroy) before every rank read the mask: a rank that left
            # is masked in its peers' view, as it should be
            torch.distributed.barrier(group)
            assert [t.tolist() for t in seen] == [[0] * ep, [int(r == other) for r in range(ep)], [0] * ep], seen
            return True
        finally:
            sb.destroy()
    finally:
        _ungroup()


def _full_inputs(seed, ep, E):
    """Inputs with NUM_MAX tokens on every rank (static shapes for a CUDA graph)."""
    out = []
    s = seed
    while len(out) < ep:
        for x, idx, w in make_inputs(s, ep, E):
            if x.shape[0] == NUM_MAX and len(out) < ep:
                out.append((x, idx, w))
        s += 1000
    return out


def graph_rounds(rank, ep, runtime_dir, init_file, kernels=False):
    """CUDA: dispatch, the expert and combine captured in one CUDA graph after an eager round,
    then replayed with new inputs copied into its static tensors; each replay is a round."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    group = _group(rank, ep, init_file)
    E = 2 * ep
    try:
        buf = _buffer(group, ep, E, runtime_dir, kernels=kernels)
        assert buf.kernels is kernels
        try:
            first = _full_inputs(1300, ep, E)
            x, idx, w = (t.to(dev).clone() for t in first[rank])
            factors = torch.tensor([expert_factor(rank * (E // ep) + le) for le in range(E // ep)],
                                   device=dev, dtype=torch.float32).view(-1, 1, 1)

            def step():
                recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, NUM_MAX, E, use_fp8=False,
                                                                      return_recv_hook=True)
                hook()
                y = (recv_x.float() * factors).to(torch.bfloat16)
                return buf.low_latency_combine(y, idx, w, handle)[0]

            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                out = step()  # eager, on the stream the graph is captured on
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            assert torch.equal(out.cpu(), expected_combine(first, rank, E, ep)), "eager round"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            replays = 0
            for seed in (1400, 1500, 1600):
                inputs = _full_inputs(seed, ep, E)
                for dst, src in zip((x, idx, w), inputs[rank]):
                    dst.copy_(src.to(dev))
                graph.replay()
                torch.cuda.synchronize(dev)
                assert torch.equal(out.cpu(), expected_combine(inputs, rank, E, ep)), f"replay {seed}"
                replays += 1
            del graph
            return replays
        finally:
            torch.cuda.synchronize(dev)
            buf.destroy()
    finally:
        _ungroup()


def kernels_as_ops(rank, ep, runtime_dir, init_file):
    """CUDA: a Buffer running the extension's kernels and one running the torch ops give the
    same rounds, bit for bit: each (expert, source) block's rows and src_info (in token order:
    inside a block the order follows the dispatch's slots), layout_range, recv_count, the
    statistics and combine's output; FP8 (every scale option) within FP8's bound of each other."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    group = _group(rank, ep, init_file)
    E = 4 * ep
    try:
        ops = _buffer(group, ep, E, runtime_dir, kernels=False)
        ker = _buffer(group, ep, E, runtime_dir, kernels=True)
        assert not ops.kernels and ker.kernels
        compared = 0
        try:
            stats = [torch.zeros(E // ep, dtype=torch.int32, device=dev) for _ in range(2)]
            for seed in range(1700, 1706):
                inputs = make_inputs(seed, ep, E, topk=3)
                x, idx, w = (t.to(dev) for t in inputs[rank])
                got = []
                for b, st in zip((ops, ker), stats):
                    recv_x, recv_count, handle, _, _ = b.low_latency_dispatch(
                        x, idx, NUM_MAX, E, use_fp8=False, cumulative_local_expert_recv_stats=st)
                    y = expert_outputs(recv_x.cpu(), rank, E, ep).to(dev)
                    out, _, _ = b.low_latency_combine(y, idx, w, handle)
                    got.append((recv_x.cpu(), recv_count.cpu(), handle[0].cpu(), handle[1].cpu(), out.cpu()))
                (rx0, rc0, si0, lr0, o0), (rx1, rc1, si1, lr1, o1) = got
                assert torch.equal(rc0, rc1) and torch.equal(lr0, lr1), f"seed {seed}: counts or layout_range"
                # Each (expert, source) block holds the same pairs on both paths. Their order inside
                # the block follows the slots the dispatch numbered, and two dispatches may number
                # a source's slots differently (a multi-block dispatch takes them with atomics), so
                # each block is compared in the order of its tokens (src_info is unique in a block).
                for le in range(E // ep):
                    for s in range(ep):
                        v = int(lr0[le, s])
                        b0, n = v >> 32, v & 0xFFFFFFFF
                        blk = slice(b0, b0 + n)
                        k0, k1 = si0[le, blk].sort().indices, si1[le, blk].sort().indices
                        assert torch.equal(si0[le, blk][k0], si1[le, blk][k1]), f"seed {seed} expert {le} source {s}: src_info"
                        assert torch.equal(rx0[le, blk][k0], rx1[le, blk][k1]), f"seed {seed} expert {le} source {s}: rows"
                assert torch.equal(o0, o1) and torch.equal(o0, expected_combine(inputs, rank, E, ep)), f"seed {seed}"
                compared += 1
            assert torch.equal(stats[0].cpu(), stats[1].cpu())
            for rnd, (rs, ue) in enumerate([(False, False), (True, False), (True, True)]):
                inputs = make_inputs(1800 + rnd, ep, E, floats=True)
                x, idx, w = (t.to(dev) for t in inputs[rank])
                for b in (ops, ker):
                    (data, scales), recv_count, handle, _, _ = b.low_latency_dispatch(
                        x, idx, NUM_MAX, E, round_scale=rs, use_ue8m0=ue)
                    check_fp8(rank, ep, inputs, E, (data.cpu(), scales.cpu()), recv_count.cpu(),
                              [handle[0].cpu(), handle[1].cpu()], rs, ue, f"kernels={b.kernels} fp8 {rs} {ue}")
                    b.low_latency_combine(torch.zeros(data.shape, dtype=torch.bfloat16, device=dev), idx, w, handle)
                compared += 1
            return compared
        finally:
            ker.destroy()
            ops.destroy()
    finally:
        _ungroup()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
def test_surface_without_a_daemon():
    import a2ad.deep_ep as deep_ep

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint == deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=8, num_experts=256)
    assert hint % 128 == 0 and hint >= 4 * 256 * 128 * 2 * 7168
    assert deep_ep.topk_idx_t is torch.int64 and deep_ep.Buffer.num_sms == 20
    cfg = deep_ep.Config(20, 6, 256, 6, 128)
    with pytest.raises(deep_ep.NotSupported, match="low_latency_mode=True"):
        cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    with pytest.raises(deep_ep.NotSupported) as got:
        deep_ep.Buffer.get_dispatch_config(8)
    assert isinstance(got.value, errors.A2ADError) and got.value.details["argument"] == "get_dispatch_config"
    with pytest.raises(errors.InputError, match="group"):
        deep_ep.Buffer(None, low_latency_mode=True)
    with deep_ep.EventOverlap(None) as ev:
        ev.current_stream_wait()
    # the FP8 helpers: scale = amax / 448 (floor 1e-4), rounded up to a power of 2, UE8M0 bytes
    x = torch.zeros(2, 512)
    x[0, :128] = 448.0
    x[0, 128:256] = 3.0
    x[1, 256] = -0.5
    q, s = deep_ep.quantize_fp8(x.to(torch.bfloat16), round_scale=False)
    assert torch.equal(s[0], torch.tensor([1.0, 3.0 / 448, 1e-4 / 448, 1e-4 / 448]))
    assert float(q[0, 0].float()) == 448.0
    _, s2 = deep_ep.quantize_fp8(x.to(torch.bfloat16), round_scale=True)
    assert torch.equal(s2[0], torch.tensor([1.0, 2.0 ** -7, 2.0 ** -22, 2.0 ** -22]))
    packed = deep_ep.pack_ue8m0(s2)
    assert packed.dtype == torch.int32 and packed.shape == (2, 1)
    assert int(packed[0, 0]) == 127 | (120 << 8) | (105 << 16) | (105 << 24)


def test_kernels_are_the_default_unless_the_environment_turns_them_off(monkeypatch):
    """A CUDA Buffer made without kernels= runs the extension's kernels; A2AD_DEEP_EP_KERNELS=0
    (or no, false) turns them off (a host-backend Buffer never runs them: the rounds above)."""
    import a2ad.deep_ep as deep_ep

    monkeypatch.delenv(deep_ep.KERNELS_ENV, raising=False)
    assert deep_ep._kernels_from_env() is True
    for off in ("0", "no", "False", " false "):
        monkeypatch.setenv(deep_ep.KERNELS_ENV, off)
        assert deep_ep._kernels_from_env() is False, off
    for on in ("1", "yes", ""):
        monkeypatch.setenv(deep_ep.KERNELS_ENV, on)
        assert deep_ep._kernels_from_env() is True, on


def _init_file(tmp_path) -> str:
    """The rendezvous file of the ranks' gloo group (gloo makes it), in the test's tmp folder."""
    return str(tmp_path / "gloo-init")


def test_ll_dispatch_combine_against_reference(rank_pool, dataplane_daemons, tmp_path):
    rd = str(dataplane_daemons("host").runtime_dir)
    res = rank_pool.run(3, ll_rounds, 3, rd, _init_file(tmp_path), timeout=240.0)
    assert res[0] == res[1] == res[2] and res[0] > 20


def test_shrink_masks_a_killed_rank_and_survivors_go_on(rank_pool, dataplane_daemons, tmp_path):
    rd = str(dataplane_daemons("host").runtime_dir)
    victim = 2
    res = rank_pool.run(3, shrink_kill, 3, rd, _init_file(tmp_path), victim, str(tmp_path / "died"), timeout=120.0,
                        may_exit=(victim,))
    assert res[victim] is None
    for r in (0, 1):
        assert res[r] < 1.0, f"rank {r} saw the loss {res[r]:.3f} s after the kill"


def test_without_shrink_a_dead_peer_is_peer_lost(rank_pool, dataplane_daemons, tmp_path):
    rd = str(dataplane_daemons("host").runtime_dir)
    res = rank_pool.run(2, no_shrink_kill, 2, rd, _init_file(tmp_path), 1, timeout=120.0, may_exit=(1,))
    assert res[1] is None and res[0] < 10.0


KERNELS = pytest.mark.parametrize("kernels", [False, True], ids=["torch-ops", "kernels"])


@pytest.mark.gpu
@KERNELS
def test_ll_on_the_cuda_backend(rank_pool, dataplane_daemons, kernels, tmp_path):
    rd = str(dataplane_daemons("cuda").runtime_dir)
    res = rank_pool.run(2, ll_rounds, 2, rd, _init_file(tmp_path), "cuda", kernels, timeout=300.0)
    assert res[0] == res[1] and res[0] > 20


@pytest.mark.gpu
@KERNELS
def test_ll_on_the_cuda_backend_never_syncs(rank_pool, dataplane_daemons, kernels, tmp_path):
    rd = str(dataplane_daemons("cuda").runtime_dir)
    assert rank_pool.run(2, sync_free, 2, rd, _init_file(tmp_path), kernels, timeout=300.0) == [True, True]


@pytest.mark.gpu
@KERNELS
def test_ll_in_a_cuda_graph(rank_pool, dataplane_daemons, kernels, tmp_path):
    rd = str(dataplane_daemons("cuda").runtime_dir)
    assert rank_pool.run(2, graph_rounds, 2, rd, _init_file(tmp_path), kernels, timeout=300.0) == [3, 3]


@pytest.mark.gpu
@KERNELS
def test_shrink_on_the_cuda_backend_masks_a_killed_rank_within_10_ms(rank_pool, dataplane_daemons, tmp_path,
                                                                      kernels):
    rd = str(dataplane_daemons("cuda").runtime_dir)
    victim = 2
    res = rank_pool.run(3, shrink_kill, 3, rd, _init_file(tmp_path), victim, str(tmp_path / "died"), "cuda", kernels,
                        timeout=300.0, may_exit=(victim,))
    assert res[victim] is None
    for r in (0, 1):
        assert res[r] < 0.010, f"rank {r} saw the loss {res[r] * 1e3:.1f} ms after the kill"


@pytest.mark.gpu
def test_ll_kernels_give_what_the_torch_ops_give(rank_pool, dataplane_daemons, tmp_path):
    rd = str(dataplane_daemons("cuda").runtime_dir)
    assert rank_pool.run(2, kernels_as_ops, 2, rd, _init_file(tmp_path), timeout=300.0) == [9, 9]
