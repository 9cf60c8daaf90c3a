"""What a wrong argument is told: an ``ep_rank`` outside the job says it is out of range (not
that it is another rank), an expert id outside ``[0, num_experts)`` on the host backend names
the token and the value, a combine payload that is no tensor is named, and a dispatch whose
rows reach the previous round's combine region is refused. Caller-owned CPU workspaces and a
real daemon job."""

from __future__ import annotations

import contextlib

import pytest
import torch

from _helpers_dataplane import job_name
from a2ad import errors
from helpers import Mapping
from test_flashinfer_parity import HIDDEN, MAX_TOKENS, NUM_EXPERTS, TOP_K, _round, _workspace


def test_ep_rank_out_of_range_says_so():
    import a2ad.client as c

    ws = _workspace(2)
    metas = [c.moe_a2a_initialize(ws, r, 2, MAX_TOKENS, timeout=5.0) for r in range(2)]
    try:
        _, inputs, _, _ = _round(1700, 2, tokens=[3, 3])
        e, h = inputs[1].experts, inputs[1].hidden
        for call in (
            lambda rank: c.moe_a2a_dispatch(e, [h], ws, metas[1], 3, rank, 2, TOP_K, NUM_EXPERTS),
            lambda rank: c.moe_a2a_combine(torch.zeros(2, 3, HIDDEN), 3, ws, metas[1], 3, rank, 2, TOP_K, 0),
            lambda rank: c.moe_a2a_sanitize_expert_ids(torch.zeros(2, 3, TOP_K, dtype=torch.int32), ws, metas[1], rank,
                                                       -1),
        ):
            for rank in (5, -1, 2):
                with pytest.raises(errors.InputError) as exc:
                    call(rank)
                msg = str(exc.value)
                assert f"ep_rank must be in [0, 1], got {rank}" in msg, msg
                assert "this workspace's rank" not in msg, msg
                assert exc.value.details["argument"] == "ep_rank"
    finally:
        c.moe_a2a_release(ws)


def _bad_ids(experts, token, k, value):
    bad = experts.clone()
    bad[token, k] = value
    return bad


@contextlib.contextmanager
def _caller_rank():
    """A one-rank caller-owned CPU workspace and its metainfo, released at the end."""
    import a2ad.client as c

    ws = _workspace(1)
    meta = c.moe_a2a_initialize(ws, 0, 1, MAX_TOKENS, timeout=5.0)
    try:
        yield ws, meta
    finally:
        c.moe_a2a_release(ws)


@contextlib.contextmanager
def _one_rank(daemon, name):
    """:func:`_caller_rank`'s workspace and a one-rank MoeAlltoAll of a daemon job, both
    released at the end."""
    import a2ad.client as c

    with _caller_rank() as (ws, meta):
        a2a = c.MoeAlltoAll(Mapping(0, 1), MAX_TOKENS, TOP_K, NUM_EXPERTS, hidden_size=HIDDEN, job=job_name(name),
                            runtime_dir=str(daemon.runtime_dir), timeout=20.0)
        try:
            yield ws, meta, a2a
        finally:
            a2a.close()


def test_host_backend_names_the_token_and_the_id_out_of_range(daemon):
    import a2ad.client as c

    with _one_rank(daemon, "badid") as (ws, meta, a2a):
        rt, inputs, _, _ = _round(1710, 1, tokens=[5])
        mine = inputs[0]
        for token, k, value in ((3, 2, NUM_EXPERTS), (0, 0, -7), (4, TOP_K - 1, 1 << 20)):
            bad = _bad_ids(mine.experts, token, k, value)
            for call in (
                lambda: c.moe_a2a_dispatch(bad, [mine.hidden], ws, meta, rt, 0, 1, TOP_K, NUM_EXPERTS),
                lambda: a2a.dispatch(bad, [mine.hidden, bad, mine.scales], rt),
            ):
                with pytest.raises(errors.InputError) as exc:
                    call()
                msg = str(exc.value)
                assert f"token {token}" in msg and f"expert id {value}" in msg, msg
                assert f"[0, num_experts={NUM_EXPERTS})" in msg, msg
                d = exc.value.details
                assert (d["argument"], d["token"], d["k"], d["value"]) == ("token_selected_experts", token, k, value)
        assert a2a.phase == "idle"


def test_a_dispatch_into_the_previous_combine_region_is_refused():
    """A round's combine region sits at the end of the row, where peers may still read it while
    this rank dispatches again: a dispatch whose payloads reach it (wider rows than the
    workspace was sized for) is refused before anything is written, naming the bytes, and the
    rank stays idle, its next dispatch of the sized rows served."""
    import a2ad.client as c

    with _caller_rank() as (ws, meta):
        rt, inputs, _, _ = _round(1720, 1, tokens=[MAX_TOKENS])
        mine = inputs[0]
        args = (ws, meta, rt, 0, 1, TOP_K, NUM_EXPERTS)
        recv, off, _ = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], *args)
        c.moe_a2a_combine(recv[0], MAX_TOKENS, ws, meta, rt, 0, 1, TOP_K, off)  # its region: the row's end
        # rows of 4 * 2 * HIDDEN bytes where the workspace was sized for 2 * HIDDEN: they fit the
        # row, but reach the combine region
        wide = mine.hidden.float().repeat(1, 2)
        before = ws.clone()
        with pytest.raises(errors.InputError) as exc:
            c.moe_a2a_dispatch(mine.experts, [wide, mine.experts, mine.scales], *args)
        assert torch.equal(ws, before)  # nothing written
        msg = str(exc.value)
        assert "overlap the previous round's combine region" in msg and f"runtime_max_tokens_per_rank={rt}" in msg, msg
        assert exc.value.details["argument"] == "input_payloads"
        recv, off, _ = c.moe_a2a_dispatch(mine.experts, [mine.hidden, mine.experts, mine.scales], *args)
        assert torch.equal(recv[0][0, :MAX_TOKENS], mine.hidden)
        out = c.moe_a2a_combine(recv[0], MAX_TOKENS, ws, meta, rt, 0, 1, TOP_K, off)
        assert out.shape == (MAX_TOKENS, HIDDEN)


def test_a_combine_payload_that_is_no_tensor_is_named(daemon):
    """A combine given a list where its payload goes (the received list of a dispatch, say) is
    told that the payload must be a tensor, with or without an output dtype, through the
    functional op and through MoeAlltoAll; the round stays open, and combining it right works."""
    import a2ad.client as c

    with _one_rank(daemon, "notensor") as (ws, meta, a2a):
        rt, inputs, _, _ = _round(1730, 1, tokens=[3])
        mine = inputs[0]
        payloads = [mine.hidden, mine.experts, mine.scales]
        recv, off, _ = c.moe_a2a_dispatch(mine.experts, payloads, ws, meta, rt, 0, 1, TOP_K, NUM_EXPERTS)
        for kw in ({}, {"output_dtype": torch.float32}):
            with pytest.raises(errors.InputError) as exc:
                c.moe_a2a_combine(recv, 3, ws, meta, rt, 0, 1, TOP_K, off, **kw)
            assert "payload must be a torch.Tensor, got list" in str(exc.value), str(exc.value)
        assert c.moe_a2a_combine(recv[0], 3, ws, meta, rt, 0, 1, TOP_K, off).shape == (3, HIDDEN)
        got = a2a.dispatch(mine.experts, payloads, rt)
        for kw in ({}, {"output_dtype": torch.float32}):
            with pytest.raises(errors.InputError) as exc:
                a2a.combine(got, rt, **kw)
            assert "payload must be a torch.Tensor, got list" in str(exc.value), str(exc.value)
        assert a2a.phase == "dispatched"
        assert a2a.combine(got[0], rt).shape == (3, HIDDEN)
