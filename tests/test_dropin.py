"""Switching from FlashInfer: the module functions and torch.ops.a2ad ops against MoeAlltoAll
and the reference, torch.compile(fullgraph=True), fake tensors, the workspace registry,
the exported helpers, and several MoeAlltoAll per layer on one rank.

Multi-rank scenarios run in the shared pool of real client processes
(``_helpers_dataplane``) against a real host-backend daemon; each rank checks its own
results against ``a2ad.client.reference`` and raises on any difference.
"""

from __future__ import annotations

import math

import pytest
import torch

from _helpers_dataplane import job_name, rank_pool  # noqa: F401  (fixture)
from a2ad import errors, layout as L
from helpers import Mapping

HIDDEN = 32
TOP_K = 4
NUM_EXPERTS = 8
MAX_TOKENS = 6
INVALID = -1


def _open(rank, ep, runtime_dir, job, **kw):
    """A MoeAlltoAll for ``job`` whose workspace the functional ops can find."""
    from a2ad.client import MoeAlltoAll, ops

    a2a = MoeAlltoAll(
        Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN,
        job=job, runtime_dir=runtime_dir, timeout=20.0, **kw,
    )
    if not ops.registered(a2a):  # until MoeAlltoAll registers its plane itself
        ops.register_plane(a2a, a2a.attachment, a2a._plane)
    return a2a


def _round(seed, ep, rank, tokens=None):
    """Every rank's inputs of one round, the reference results, and this rank's inputs."""
    from a2ad.client import reference as ref

    g = torch.Generator().manual_seed(seed)
    if tokens is None:
        tokens = torch.randint(0, MAX_TOKENS + 1, (ep,), generator=g).tolist()
    rt = max(1, max(tokens))
    inputs = ref.make_round(seed, tokens, HIDDEN, TOP_K, NUM_EXPERTS, torch.bfloat16)
    payloads = [[i.hidden, i.experts, i.scales] for i in inputs]
    routings, received = ref.dispatch([i.experts for i in inputs], payloads, NUM_EXPERTS, rt, INVALID, 1)
    outputs = [ref.toy_expert(r.payloads[0], r.payloads[1], r.payloads[2], q, NUM_EXPERTS, ep) for q, r in enumerate(received)]
    combined = ref.combine(routings, outputs)
    return rt, inputs[rank], received[rank], combined[rank]


def _check(rank, what, got, expected, out, want):
    """Received payloads (valid rows as sets, sanitized ids in full) and the combine, bit for bit."""
    from a2ad.client import reference as ref

    problems = ref.dispatch_mismatches(got, expected.recv_counts, expected)
    assert not problems, f"rank {rank} {what}: " + "; ".join(problems)
    for s, n in enumerate(expected.recv_counts.tolist()):
        assert bool((got[1][s, n:] == INVALID).all()), f"rank {rank} {what}: slots >= {n} from {s} not sanitized"
    assert out.dtype == want.dtype and torch.equal(out, want), f"rank {rank} {what}: combine differs from the reference"


def _expert(got, rank, ep):
    from a2ad.client import reference as ref

    return ref.toy_expert(got[0], got[1], got[2], rank, NUM_EXPERTS, ep)


# ---------------------------------------------------------------------------
# Scenarios (run in every rank's process)
# ---------------------------------------------------------------------------
def three_ways(rank, ep, runtime_dir, job, rounds):
    """Each round three times: MoeAlltoAll methods, module functions, torch.ops.a2ad ops.

    The three give identical bytes (received rows, sanitized ids, combine) and match the
    reference. The module-function rounds alternate payload_in_workspace=True with the
    payload at combine_payload_offset, placed with moe_a2a_wrap_payload_tensor_in_workspace
    (FlashInfer's way); the module function's results are views of the workspace.
    """
    import a2ad.client as c

    a2a = _open(rank, ep, runtime_dir, job)
    try:
        ws, meta = a2a.workspace, a2a.metainfo
        for rnd in range(rounds):
            rt, mine, expected, want = _round(1000 + rnd, ep, rank)
            payloads = [mine.hidden, mine.experts, mine.scales]
            n = mine.experts.shape[0]

            # 1. the methods
            got = a2a.dispatch(mine.experts, payloads, rt, INVALID, 1)
            saved = [t.clone() for t in got]
            out_m = a2a.combine(_expert(got, rank, ep), rt)
            _check(rank, f"round {rnd} methods", saved, expected, out_m, want)

            # 2. the module functions
            got, cpo, _ = c.moe_a2a_dispatch(mine.experts, payloads, ws, meta, rt, rank, ep, TOP_K, NUM_EXPERTS)
            row = ws[rank]
            assert all(row.data_ptr() <= g.data_ptr() < row.data_ptr() + row.numel() for g in got), "not zero-copy"
            c.moe_a2a_sanitize_expert_ids(got[1], ws, meta, rank, INVALID)
            saved_f = [t.clone() for t in got]
            y = _expert(got, rank, ep)
            in_ws = rnd % 2 == 1
            if in_ws:  # FlashInfer: the combine payload written at combine_payload_offset
                nbytes = ep * rt * HIDDEN * y.element_size()
                slot = c.moe_a2a_wrap_payload_tensor_in_workspace(ws[rank], [ep, rt], cpo, cpo + nbytes, y.dtype)
                slot.copy_(y)
                y = slot
            out_f = c.moe_a2a_combine(y, n, ws, meta, rt, rank, ep, TOP_K, cpo, payload_in_workspace=in_ws)
            _check(rank, f"round {rnd} functions", saved_f, expected, out_f, want)
            assert a2a.phase == "idle"

            # 3. the torch ops: dispatch returns a copy of the received bytes, cut like the workspace
            region = torch.ops.a2ad.moe_a2a_dispatch(mine.experts, payloads, ws, meta, rt, rank, ep, TOP_K, NUM_EXPERTS)
            assert region.dtype == torch.int32
            off, got = 0, []
            for p in payloads:
                size = ep * rt * math.prod(p.shape[1:]) * p.element_size()
                got.append(region.view(torch.uint8)[off : off + size].view(p.dtype).view(ep, rt, -1))
                off = L.pad_up(off + size)
            assert off == 4 * region.numel()
            torch.ops.a2ad.moe_a2a_sanitize_expert_ids(got[1], ws, meta, rank, INVALID)
            saved_o = [t.clone() for t in got]
            cpo_o = int(meta[L.PAYLOAD_DATA_OFFSET_INDEX]) + 4 * region.numel()
            assert cpo_o == cpo, (cpo_o, cpo)
            out_o = torch.ops.a2ad.moe_a2a_combine(_expert(got, rank, ep), n, ws, meta, rt, rank, ep, TOP_K, cpo_o)
            _check(rank, f"round {rnd} ops", saved_o, expected, out_o, want)

            for s, cnt in enumerate(expected.recv_counts.tolist()):
                for a, b, d in zip(saved, saved_f, saved_o):
                    assert torch.equal(a[s, :cnt], b[s, :cnt]) and torch.equal(a[s, :cnt], d[s, :cnt]), (rank, rnd, s)
            assert torch.equal(saved[1], saved_f[1]) and torch.equal(saved[1], saved_o[1])
            assert torch.equal(out_m, out_f) and torch.equal(out_m, out_o)
        return rounds
    finally:
        a2a.close()


def _step(experts, hidden, scales, ws, meta, rt, rank, ep):
    """One MoE layer with the module functions, as a FlashInfer user writes it."""
    import a2ad.client as c
    from a2ad.client import reference as ref

    got, cpo, _ = c.moe_a2a_dispatch(experts, [hidden, experts, scales], ws, meta, rt, rank, ep, TOP_K, NUM_EXPERTS)
    c.moe_a2a_sanitize_expert_ids(got[1], ws, meta, rank, INVALID)
    y = ref.toy_expert(got[0], got[1], got[2], rank, NUM_EXPERTS, ep)
    ids = got[1].clone()  # received tensors are valid until combine
    out = c.moe_a2a_combine(y, experts.shape[0], ws, meta, rt, rank, ep, TOP_K, cpo)
    return out, ids


def compiled_rounds(rank, ep, runtime_dir, job, backend, rounds):
    """The functional ops under torch.compile(fullgraph=True): every round checked."""
    from a2ad.client import reference as ref

    a2a = _open(rank, ep, runtime_dir, job)
    torch._dynamo.reset()
    try:
        step = torch.compile(_step, backend=backend, fullgraph=True)
        ws, meta = a2a.workspace, a2a.metainfo
        for rnd in range(rounds):
            rt, mine, expected, want = _round(2000 + rnd, ep, rank, tokens=[5, 3, 4, 2][:ep])
            out, ids = step(mine.experts, mine.hidden, mine.scales, ws, meta, rt, rank, ep)
            assert a2a.phase == "idle"
            for s, n in enumerate(expected.recv_counts.tolist()):
                rows = ids[s, :n].contiguous().view(torch.uint8)
                assert ref.same_rows(rows, expected.payloads[1][s, :n].contiguous().view(torch.uint8)), (rank, rnd, s)
                assert bool((ids[s, n:] == INVALID).all()), f"rank {rank} round {rnd}: not sanitized"
            assert torch.equal(out, want), f"rank {rank} round {rnd}: compiled combine differs from the reference"
            # the same round through the methods gives the same bytes
            rt, mine, expected, want = _round(3000 + rnd, ep, rank, tokens=[5, 3, 4, 2][:ep])
            got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
            assert torch.equal(a2a.combine(_expert(got, rank, ep), rt), want)
        return rounds
    finally:
        a2a.close()


def layers(rank, ep, runtime_dir, job, rounds):
    """Three MoeAlltoAll (one per layer) on one rank share one attachment; rounds go layer by
    layer through the public API, the functional ops take any layer's workspace."""
    import a2ad.client as c

    objs = [_open(rank, ep, runtime_dir, job) for _ in range(3)]
    try:
        ws = objs[0].workspace
        assert all(o.workspace.data_ptr() == ws.data_ptr() for o in objs)
        assert objs[0].attachment.handles == 3
        seed = 5000
        for rnd in range(rounds):
            for layer, a2a in enumerate(objs):
                seed += 1
                rt, mine, expected, want = _round(seed, ep, rank)
                got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
                assert all(o.phase == ("dispatched" if o is a2a else "idle") for o in objs)
                with pytest.raises(errors.StateError):  # one round at a time per rank
                    objs[(layer + 1) % 3].dispatch(mine.experts, [mine.hidden], rt)
                with pytest.raises(errors.StateError):  # the functional ops see the open round too
                    c.moe_a2a_dispatch(mine.experts, [mine.hidden], ws, a2a.metainfo, rt, rank, ep, TOP_K, NUM_EXPERTS)
                saved = [t.clone() for t in got]
                y = a2a.get_combine_payload_tensor_in_workspace(rt, HIDDEN, torch.bfloat16)
                y.copy_(_expert(got, rank, ep))
                out = a2a.combine(y, rt, payload_in_workspace=True)
                _check(rank, f"round {rnd} layer {layer}", saved, expected, out, want)
                # then the same layer's next round through the module functions on its workspace
                seed += 1
                rt, mine, expected, want = _round(seed, ep, rank)
                got, cpo, _ = c.moe_a2a_dispatch(
                    mine.experts, [mine.hidden, mine.experts, mine.scales], a2a.workspace, a2a.metainfo, rt, rank, ep,
                    TOP_K, NUM_EXPERTS,
                )
                with pytest.raises(errors.StateError):  # a functional round is combined functionally
                    a2a.combine(_expert(got, rank, ep), rt)
                c.moe_a2a_sanitize_expert_ids(got[1], a2a.workspace, a2a.metainfo, rank, INVALID)
                saved = [t.clone() for t in got]
                out = c.moe_a2a_combine(
                    _expert(got, rank, ep), mine.experts.shape[0], a2a.workspace, a2a.metainfo, rt, rank, ep, TOP_K, cpo
                )
                _check(rank, f"round {rnd} layer {layer} functions", saved, expected, out, want)
        # closing two layers leaves the job attached for the third
        objs[0].close()
        objs[1].close()
        rt, mine, expected, want = _round(seed + 1, ep, rank)
        got = objs[2].dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
        saved = [t.clone() for t in got]
        _check(rank, "last layer", saved, expected, objs[2].combine(_expert(got, rank, ep), rt), want)
        return rounds
    finally:
        for o in objs:
            o.close()


def with_mnnvl_config(rank, ep, runtime_dir, job):
    """FlashInfer code passes mnnvl_config=; a2ad accepts it and ignores it."""
    from a2ad.client import MoeAlltoAll

    a2a = MoeAlltoAll(
        Mapping(rank, ep), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, mnnvl_config=object(),
        job=job, runtime_dir=runtime_dir, timeout=20.0,
    )
    try:
        rt, mine, _, want = _round(6000, ep, rank)
        got = a2a.dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], rt, INVALID, 1)
        assert torch.equal(a2a.combine(_expert(got, rank, ep), rt), want)
        return True
    finally:
        a2a.close()


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
def _run(pool, fn, ep, *args, timeout=180.0):
    return pool.run(ep, fn, *args, timeout=timeout)


def test_functions_and_ops_match_methods_and_reference(rank_pool, daemon):
    assert _run(rank_pool, three_ways, 2, 2, str(daemon.runtime_dir), job_name("dropin3"), 4) == [4, 4]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.full)])
def test_ops_under_torch_compile_fullgraph(rank_pool, daemon, backend):
    rounds = 2 if backend == "inductor" else 3
    res = _run(rank_pool, compiled_rounds, 2, 2, str(daemon.runtime_dir), job_name("dropinc"), backend, rounds, timeout=300.0)
    assert res == [rounds] * 2


def test_several_moe_alltoall_per_layer_on_one_rank(rank_pool, daemon):
    assert _run(rank_pool, layers, 2, 2, str(daemon.runtime_dir), job_name("dropinl"), 2) == [2, 2]


def test_mnnvl_config_is_accepted_and_ignored(rank_pool, daemon):
    assert _run(rank_pool, with_mnnvl_config, 2, 2, str(daemon.runtime_dir), job_name("dropinm"), timeout=60.0) == [True] * 2


def test_fake_implementations_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    import a2ad.client  # noqa: F401  (registers the ops)

    ep, rt, n = 4, 5, 3
    with FakeTensorMode():
        ws = torch.empty(ep, 1 << 16, dtype=torch.uint8)
        meta = torch.empty(L.NUM_METAINFO_FIELDS, dtype=torch.int64)
        experts = torch.empty(n, TOP_K, dtype=torch.int32)
        hidden = torch.empty(n, HIDDEN, dtype=torch.bfloat16)
        region = torch.ops.a2ad.moe_a2a_dispatch(experts, [hidden, experts], ws, meta, rt, 1, ep, TOP_K, 16)
        want = L.pad_up(ep * rt * HIDDEN * 2) + L.pad_up(ep * rt * TOP_K * 4)
        assert region.shape == (want // 4,) and region.dtype == torch.int32 and region.device == ws.device
        ids = torch.empty(ep, rt, TOP_K, dtype=torch.int32)
        assert torch.ops.a2ad.moe_a2a_sanitize_expert_ids(ids, ws, meta, 1, -1) is None
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            payload = torch.empty(ep, rt, HIDDEN, dtype=dtype)
            out = torch.ops.a2ad.moe_a2a_combine(payload, n, ws, meta, rt, 1, ep, TOP_K, 4096, False)
            assert out.shape == (n, HIDDEN) and out.dtype == dtype and out.device == payload.device
    # the meta device too
    payload = torch.empty(ep, rt, HIDDEN, dtype=torch.float16, device="meta")
    ws = torch.empty(ep, 1 << 16, dtype=torch.uint8, device="meta")
    meta = torch.empty(L.NUM_METAINFO_FIELDS, dtype=torch.int64, device="meta")
    out = torch.ops.a2ad.moe_a2a_combine(payload, n, ws, meta, rt, 1, ep, TOP_K, 0, True)
    assert out.shape == (n, HIDDEN) and out.dtype == torch.float16 and out.device.type == "meta"


def test_workspace_without_live_moe_alltoall_is_a_clear_error(daemon):
    import a2ad.client as c

    meta = torch.zeros(L.NUM_METAINFO_FIELDS, dtype=torch.int64)
    experts = torch.zeros(2, TOP_K, dtype=torch.int32)
    stray = torch.zeros(1, 1 << 16, dtype=torch.uint8)
    for call in (
        lambda ws: c.moe_a2a_dispatch(experts, [experts], ws, meta, 2, 0, 1, TOP_K, NUM_EXPERTS),
        lambda ws: c.moe_a2a_sanitize_expert_ids(torch.zeros(1, 2, TOP_K, dtype=torch.int32), ws, meta, 0, -1),
        lambda ws: c.moe_a2a_combine(torch.zeros(1, 2, HIDDEN), 2, ws, meta, 2, 0, 1, TOP_K, 0),
    ):
        with pytest.raises(errors.StateError, match="no live MoeAlltoAll.*MoeAlltoAll\\(mapping"):
            call(stray)

    # a one-rank job in this process: usable while open, refused once closed
    a2a = _open(0, 1, str(daemon.runtime_dir), job_name("dropin1"))
    ws, meta = a2a.workspace, a2a.metainfo
    try:
        rt, mine, expected, want = _round(7000, 1, 0, tokens=[4])
        got, cpo, _ = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws, meta, rt, 0, 1,
                                      TOP_K, NUM_EXPERTS)
        c.moe_a2a_sanitize_expert_ids(got[1], ws, meta, 0, INVALID)
        saved = [t.clone() for t in got]
        out = c.moe_a2a_combine(_expert(got, 0, 1), 4, ws, meta, rt, 0, 1, TOP_K, cpo)
        _check(0, "one rank", saved, expected, out, want)
        # arguments that contradict the job are InputError, naming the argument
        for bad, arg in (
            (dict(ep_rank=1), "ep_rank"), (dict(top_k=TOP_K + 1), "top_k"), (dict(num_experts=NUM_EXPERTS * 2), "num_experts"),
        ):
            kw = dict(ep_rank=0, ep_size=1, top_k=TOP_K, num_experts=NUM_EXPERTS) | bad
            with pytest.raises(errors.InputError) as exc:
                c.moe_a2a_dispatch(mine.experts, [mine.hidden], ws, meta, rt, **kw)
            assert exc.value.details["argument"] == arg
        with pytest.raises(errors.InputError, match="whole"):
            c.moe_a2a_dispatch(mine.experts, [mine.hidden], ws[0], meta, rt, 0, 1, TOP_K, NUM_EXPERTS)
        with pytest.raises(errors.StateError, match="before"):
            c.moe_a2a_combine(torch.zeros(1, rt, HIDDEN), 4, ws, meta, rt, 0, 1, TOP_K, cpo)
    finally:
        a2a.close()
    with pytest.raises(errors.StateError, match="no live MoeAlltoAll"):
        c.moe_a2a_dispatch(mine.experts, [mine.hidden], ws, meta, rt, 0, 1, TOP_K, NUM_EXPERTS)


def test_helpers_are_exported_from_a2ad_client():
    import a2ad.client as c
    from a2ad.client import moe_alltoall as m

    for name in (
        "MoeAlltoAll", "moe_a2a_dispatch", "moe_a2a_combine", "moe_a2a_sanitize_expert_ids",
        "moe_a2a_get_workspace_size_per_rank", "moe_a2a_wrap_payload_tensor_in_workspace", "NUM_METAINFO_FIELDS",
    ):
        assert name in c.__all__ and hasattr(c, name), name
    for name, index in L.METAINFO_INDEX.items():
        assert name in c.__all__ and getattr(c, name) == index, name
    for name in ("FLAG_VAL_OFFSET_INDEX", "PAYLOAD_DATA_OFFSET_INDEX", "TOPK_SEND_INDICES_OFFSET_INDEX"):
        assert name in c.__all__
    assert c.moe_a2a_get_workspace_size_per_rank is m.moe_a2a_get_workspace_size_per_rank
    assert c.moe_a2a_wrap_payload_tensor_in_workspace is m.moe_a2a_wrap_payload_tensor_in_workspace
    ep, mt, d, cb = 4, 16, 2 * 64 + 8 * 4, 2 * 64
    assert c.moe_a2a_get_workspace_size_per_rank(ep, mt, d, cb) == (
        L.pad_up(L.aux_data_size(ep, mt)) + L.pad_up(ep * mt * d) + L.pad_up(ep * mt * cb)
    )
    ws = torch.arange(2 * 1024, dtype=torch.int64).to(torch.uint8).view(2, 1024)
    t = c.moe_a2a_wrap_payload_tensor_in_workspace(ws, [2, 4], 1024 + 128, 1024 + 128 + 64, torch.float32)
    assert t.shape == (2, 4, 2) and t.data_ptr() == ws[1, 128:].data_ptr()
    for op in ("moe_a2a_dispatch", "moe_a2a_combine", "moe_a2a_sanitize_expert_ids"):
        assert hasattr(torch.ops.a2ad, op), op
