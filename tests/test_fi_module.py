"""FlashInfer's low-level module object (``get_moe_alltoall_module()``) and the checks FlashInfer
makes before any kernel: a rank mask enabled without a mask, a combine ``output`` that cannot be
right. Caller-owned CPU workspaces run several ranks in threads of this process (the host
plane, as the functional API's own tests); the class API runs on a real daemon."""

from __future__ import annotations

import time

import pytest
import torch

from _helpers_dataplane import job_name
from a2ad import errors, layout as L
from helpers import Mapping
from test_flashinfer_parity import HIDDEN, INVALID, MAX_TOKENS, NUM_EXPERTS, TOP_K, _check_received, _expert, \
    _round, _run_ranks, _workspace


def test_module_object_has_flashinfer_functions_and_runs_rounds():
    """Every function FlashInfer's module object has, with its signature and results: the
    dispatch's offsets wrapped as FlashInfer wraps them give what each rank received, the
    EPLB offset points at every rank's statistics, combine and combine_into give the
    reference's sums."""
    import a2ad.client as c

    mod = c.get_moe_alltoall_module()
    assert mod is c.get_moe_alltoall_module("trtllm")
    for name in ("moe_a2a_initialize", "moe_a2a_dispatch", "moe_a2a_combine", "moe_a2a_combine_into",
                 "moe_a2a_sanitize_expert_ids", "moe_a2a_get_metainfo_index_pairs", "moe_a2a_get_aux_data_size"):
        assert callable(getattr(mod, name)), name
    with pytest.raises(errors.InputError) as exc:
        c.get_moe_alltoall_module("cake")
    assert exc.value.details["argument"] == "backend"

    names, values = mod.moe_a2a_get_metainfo_index_pairs()
    assert dict(zip(names, values)) == {f"MOE_A2A_{k}": v for k, v in L.METAINFO_INDEX.items()}
    for ep, tokens, n_stats in ((8, 10, 0), (2, MAX_TOKENS, 0), (3, 7, 16)):
        aux = mod.moe_a2a_get_aux_data_size(ep, tokens, n_stats)
        assert aux == c.moe_a2a_get_workspace_size_per_rank(ep, tokens, 0, 0, n_stats)
        assert c.moe_a2a_get_workspace_size_per_rank(ep, tokens, HIDDEN, HIDDEN, n_stats) - aux == \
            2 * L.pad_up(ep * tokens * HIDDEN)
    assert mod.moe_a2a_get_aux_data_size(8, 10) == c.moe_a2a_get_workspace_size_per_rank(8, 10, 0, 0)

    ep, n_stats = 3, 8
    size = c.moe_a2a_get_workspace_size_per_rank(ep, MAX_TOKENS, 2 * HIDDEN + 8 * TOP_K, 2 * HIDDEN, n_stats)
    ws = torch.zeros(ep, size, dtype=torch.uint8)
    metas = [mod.moe_a2a_initialize(ws, r, ep, MAX_TOKENS, n_stats) for r in range(ep)]
    assert metas[0].shape == (L.NUM_METAINFO_FIELDS,)
    stats = [torch.arange(n_stats, dtype=torch.int32) + 10 * r for r in range(ep)]
    try:
        for rnd, into in enumerate((False, True)):
            rt, inputs, received, combined = _round(1200 + rnd, ep)

            def rank_round(r):
                mine = inputs[r]
                pl = [mine.hidden, mine.experts, mine.scales]
                offs, sizes, cpo, eplb_off, eplb_n = mod.moe_a2a_dispatch(
                    mine.experts, pl, ws, metas[r], rt, r, ep, TOP_K, NUM_EXPERTS, False, stats[r])
                recv = [c.moe_a2a_wrap_payload_tensor_in_workspace(ws, [ep, rt], o, o + n, p.dtype)
                        for o, n, p in zip(offs, sizes, pl)]
                mod.moe_a2a_sanitize_expert_ids(recv[1], ws, metas[r], r, INVALID, False)
                gathered = c.moe_a2a_wrap_payload_tensor_in_workspace(ws, [ep], eplb_off, eplb_off + 4 * ep * eplb_n,
                                                                      torch.int32).clone()
                saved = [t.clone() for t in recv]
                y = _expert(recv, r, ep)
                if into:
                    out = torch.empty(mine.experts.shape[0], HIDDEN, dtype=y.dtype)
                    assert mod.moe_a2a_combine_into(y, mine.experts.shape[0], ws, metas[r], rt, r, ep, TOP_K, cpo,
                                                    False, None, None, 1.0, None, False, False, False, None,
                                                    out) is None
                else:
                    out = mod.moe_a2a_combine(y, mine.experts.shape[0], ws, metas[r], rt, r, ep, TOP_K, cpo)
                return saved, gathered, eplb_n, out

            for r, (saved, gathered, eplb_n, out) in enumerate(_run_ranks(rank_round, ep)):
                _check_received(r, saved, received[r])
                assert eplb_n == n_stats and torch.equal(gathered, torch.stack(stats)), f"rank {r}: EPLB region"
                assert torch.equal(out, combined[r]), f"rank {r} round {rnd}: combine differs"
    finally:
        c.moe_a2a_release(ws)
    get = c.get_moe_alltoall_module
    get.cache_clear()
    assert get() is not mod and get() is get()


def test_rank_mask_enabled_without_a_mask_is_refused_before_any_wait():
    """enable_rank_mask=True with active_rank_mask=None (FlashInfer raises rather than take every
    rank as active): InputError naming active_rank_mask at once, from the module function, the
    functional op and the module object alike, while the peer never comes (a wait would end
    only in PeerTimeout after the timeout); the rank stays usable."""
    import a2ad.client as c

    ws = _workspace(2)
    meta = c.moe_a2a_initialize(ws, 0, 2, MAX_TOKENS, timeout=30.0)
    try:
        _, inputs, _, _ = _round(1300, 2, tokens=[3, 3])
        e, h = inputs[0].experts, inputs[0].hidden
        mod = c.get_moe_alltoall_module()
        for call in (
            lambda: c.moe_a2a_dispatch(e, [h], ws, meta, 3, 0, 2, TOP_K, NUM_EXPERTS, enable_rank_mask=True,
                                       active_rank_mask=None),
            lambda: c.moe_a2a_dispatch(e, [h], ws, meta, 3, 0, 2, TOP_K, NUM_EXPERTS, None, None, True),
            lambda: mod.moe_a2a_dispatch(e, [h], ws, meta, 3, 0, 2, TOP_K, NUM_EXPERTS, False, None, True, None),
            lambda: c.moe_a2a_combine(torch.zeros(2, 3, HIDDEN), 3, ws, meta, 3, 0, 2, TOP_K, 0,
                                      enable_rank_mask=True),
        ):
            t0 = time.monotonic()
            with pytest.raises(errors.InputError, match="active_rank_mask") as exc:
                call()
            assert time.monotonic() - t0 < 10, "the refusal came after a wait"
            assert exc.value.details["argument"] == "active_rank_mask"
            assert isinstance(exc.value, ValueError)
        # nothing was opened: a combine now finds no round
        with pytest.raises(errors.StateError, match="before moe_a2a_dispatch"):
            c.moe_a2a_combine(torch.zeros(2, 3, HIDDEN), 3, ws, meta, 3, 0, 2, TOP_K, 0)
    finally:
        c.moe_a2a_release(ws)


def test_combine_output_is_checked_before_the_workspace():
    """FlashInfer checks ``output`` before loading its kernels: a non-CUDA output with a workspace
    that is no host workspace of this process, or a non-contiguous output, is a ValueError
    naming the problem whatever the other arguments hold; a CPU output for a host workspace
    is taken."""
    import a2ad.client as c

    for out, match in ((torch.empty(1, 1), "output must be a CUDA tensor"),
                       (torch.empty(2, 2).T, "output must be contiguous|output must be a CUDA tensor")):
        with pytest.raises(errors.InputError, match=match) as exc:
            c.moe_a2a_combine(torch.empty(1, 1, 1), 1, torch.empty(0), torch.empty(0), 1, 0, 1, 1, 0, output=out)
        assert exc.value.details["argument"] == "output" and isinstance(exc.value, ValueError)

    ws = _workspace(1)
    meta = c.moe_a2a_initialize(ws, 0, 1, MAX_TOKENS, timeout=20.0)
    try:
        rt, inputs, _, combined = _round(1310, 1, tokens=[4])
        mine = inputs[0]
        recv, cpo, _ = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], ws, meta, rt, 0, 1,
                                          TOP_K, NUM_EXPERTS)
        y = _expert(recv, 0, 1)
        with pytest.raises(errors.InputError, match="output must be contiguous"):
            c.moe_a2a_combine(y, 4, ws, meta, rt, 0, 1, TOP_K, cpo, output=torch.empty(HIDDEN, 4, dtype=y.dtype).T)
        out = torch.empty(4, HIDDEN, dtype=y.dtype)
        assert c.moe_a2a_combine(y, 4, ws, meta, rt, 0, 1, TOP_K, cpo, output=out) is out
        assert torch.equal(out, combined[0])
    finally:
        c.moe_a2a_release(ws)


def test_instance_with_rank_mask_enabled_needs_a_mask_on_a_daemon_job(daemon):
    """MoeAlltoAll(enable_rank_mask=True): dispatch and combine without active_rank_mask are
    refused (InputError naming it), the state unchanged; with a mask the round runs."""
    from a2ad.client import MoeAlltoAll, moe_a2a_active_rank_mask

    a2a = MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, enable_rank_mask=True,
                      job=job_name("fimask"), runtime_dir=str(daemon.runtime_dir), timeout=20.0)
    try:
        rt, inputs, _, combined = _round(1320, 1, tokens=[4])
        mine = inputs[0]
        pl = [mine.hidden, mine.experts, mine.scales]
        with pytest.raises(errors.InputError, match="active_rank_mask") as exc:
            a2a.dispatch(mine.experts, pl, rt, INVALID, 1)
        assert exc.value.details["argument"] == "active_rank_mask"
        assert a2a.phase == "idle"
        mask = moe_a2a_active_rank_mask([0], 1)
        got = a2a.dispatch(mine.experts, pl, rt, INVALID, 1, active_rank_mask=mask)
        y = _expert(got, 0, 1)
        with pytest.raises(errors.InputError, match="active_rank_mask") as exc:
            a2a.combine(y, rt)
        assert exc.value.details["argument"] == "active_rank_mask"
        assert a2a.phase == "dispatched"
        assert torch.equal(a2a.combine(y, rt, active_rank_mask=mask), combined[0])
    finally:
        a2a.close()
