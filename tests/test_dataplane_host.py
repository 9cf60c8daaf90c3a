"""MoeAlltoAll end to end: a real daemon, real client processes, every round checked
against the single-process reference (client/reference.py).

Each test runs a scenario of ``dataplane_cases`` in ranks ``0..ep_size-1`` of a shared
pool of client processes (``_helpers_dataplane``); the scenario checks its rank's
results itself and raises on any difference. Tests take a ``backend`` parameter:
"host" always runs, "cuda" is marked ``gpu`` (skipped where no GPU is visible).
"""

from __future__ import annotations

import pytest
import torch

import dataplane_cases as cases
from _helpers_dataplane import BACKENDS, dataplane_daemons, make_job, rank_pool, run_job  # noqa: F401  (fixtures)
from a2ad import errors, layout as L
from a2ad.client import moe_alltoall as m


_job, _run = make_job, run_job


# ---------------------------------------------------------------------------
# Dispatch, expert, combine
# ---------------------------------------------------------------------------
MODELS = [
    pytest.param(7168, 8, 256, id="h7168-k8-e256"),
    pytest.param(4096, 2, 8, id="h4096-k2-e8"),
    pytest.param(2880, 4, 128, id="h2880-k4-e128"),
]
#: every model at ep 2, 4 and 8; the largest (8 ranks of hidden 7168, top-k 8) runs in the full
#: tier only (about a minute on 2 CPUs)
END_TO_END = [
    pytest.param(*m.values, ep, id=f"{m.id}-{ep}", marks=[pytest.mark.full] if (m.id, ep) == ("h7168-k8-e256", 8) else [])
    for m in MODELS for ep in (2, 4, 8)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden,top_k,num_experts,ep", END_TO_END)
def test_end_to_end(rank_pool, dataplane_daemons, backend, ep, hidden, top_k, num_experts):
    """Two rounds (combine staged, then written in the workspace), rt below max_num_tokens."""
    job = _job(dataplane_daemons, backend, "e2e", ep, top_k=top_k, num_experts=num_experts, hidden=hidden)
    stats = _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=hidden + ep * 7 + top_k, rounds=2))
    assert [s["rounds"] for s in stats] == [2] * ep


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_without_sanitize_at_max_rt(rank_pool, dataplane_daemons, backend, ep):
    job = _job(dataplane_daemons, backend, "raw", ep, max_num_tokens=5)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=5, rounds=3, rt="max", sanitize=False, in_workspace="no"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_with_zero_tokens(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "zero", 4)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=1, rounds=2, tokens=(0, 5, 0, 3)))
    job = _job(dataplane_daemons, backend, "none", 4)
    stats = _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=2, rounds=2, tokens=(0, 0, 0, 0)))
    assert sum(s["tokens_received"] for s in stats) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_to_one_rank(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "one", 4, num_experts=32, max_num_tokens=8)
    last = L.experts_of_rank(3, 32, 4)
    stats = _run(
        rank_pool, job, cases.run_rounds, cases.Plan(seed=3, rounds=2, tokens=(8, 8, 8, 8), experts_from=(last.start, last.stop))
    )
    assert [s["tokens_received"] for s in stats] == [0, 0, 0, 2 * 4 * 8]


@pytest.mark.parametrize("backend", BACKENDS)
def test_six_experts_on_four_ranks(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "six", 4, num_experts=6, top_k=3)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=4, rounds=3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_six_payloads_of_mixed_dtypes(rank_pool, dataplane_daemons, backend):
    extra = (("float64", 2), ("int16", 3), ("uint8", 5))
    job = _job(dataplane_daemons, backend, "mixed", 4, extra_bytes=16 + 6 + 5)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=6, rounds=2, extra_payloads=extra))


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_byte_widths(rank_pool, dataplane_daemons, backend):
    """fp16 hidden of 7 (14 bytes per token), 3- and 5-byte payloads, fp16 combine."""
    job = _job(dataplane_daemons, backend, "odd", 2, hidden=7, extra_bytes=8)
    _run(
        rank_pool, job, cases.run_rounds,
        cases.Plan(seed=7, rounds=2, dtype="float16", extra_payloads=(("uint8", 3), ("int8", 5))),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_22(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "k22", 4, num_experts=64, top_k=22)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=22, rounds=2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_combine_dtypes(rank_pool, dataplane_daemons, backend, dtype):
    job = _job(dataplane_daemons, backend, f"dt-{dtype}", 2, hidden=96)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=8, rounds=2, dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_inputs(rank_pool, dataplane_daemons, backend):
    """Strided payloads and int64 expert ids are accepted (copied contiguous)."""
    job = _job(dataplane_daemons, backend, "strided", 2)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=9, rounds=2, noncontiguous=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hundred_consecutive_rounds(rank_pool, dataplane_daemons, backend):
    """runtime_max_tokens_per_rank changes every round: a fast rank's next dispatch must never
    reach the combine data slower ranks are still reading (it did, when the combine region
    followed the dispatch regions)."""
    job = _job(dataplane_daemons, backend, "soak", 4, max_num_tokens=8, hidden=32)
    stats = _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=100, rounds=100), timeout=240.0)
    assert all(s["rounds"] == 100 for s in stats)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_workspace", ["no", "yes"])
def test_payload_in_workspace_every_round(rank_pool, dataplane_daemons, backend, in_workspace):
    job = _job(dataplane_daemons, backend, f"ws-{in_workspace}", 2, max_num_tokens=8)
    _run(rank_pool, job, cases.run_rounds, cases.Plan(seed=10, rounds=3, in_workspace=in_workspace, rt="max"))


# ---------------------------------------------------------------------------
# Refused calls and failures
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise_before_touching_peers(rank_pool, dataplane_daemons, backend):
    """Every rank makes every bad call (no byte of any row changes), then, after all ranks
    are done (the parent's collection is the barrier), the same job runs correct rounds."""
    job = _job(dataplane_daemons, backend, "bad", 4, max_num_tokens=6)
    try:
        counts = rank_pool.run(4, cases.bad_inputs, job, timeout=120.0)
        assert counts[0] >= 20
        rank_pool.run(4, cases.state_errors_then_rounds, job, cases.Plan(seed=11, rounds=2), timeout=120.0)
    finally:
        rank_pool.run(4, cases.close_job, job.name, timeout=30.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_silent_peer_times_out_naming_it(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "silent", 2)
    job = cases.JobSpec(**{**job.__dict__, "timeout": 2.0})
    res = rank_pool.run(2, cases.peer_silent, job, job.timeout + 4.0, timeout=60.0)[0]
    assert res["peer"] == 1 and res["phase"] == "dispatch" and res["round"] == L.INITIAL_ROUND
    assert job.timeout * 0.9 <= res["waited"] < job.timeout + 3.0
    assert res["status"] == (L.STATUS_TIMEOUT, 1, L.PHASE_DISPATCH, L.INITIAL_ROUND)
    assert "rank 1" in res["again"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_raises_peer_lost_quickly(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "dies", 2)
    res = rank_pool.run(2, cases.peer_dies, job, 0.5, timeout=60.0, may_exit=(1,))[0]
    assert res["rank"] == 1
    assert res["waited"] < 10.0  # far below the 20 s wait timeout: the abort word ended the wait


# ---------------------------------------------------------------------------
# Module functions (single process)
# ---------------------------------------------------------------------------
def test_workspace_size_functions_match_layout():
    assert m.moe_a2a_get_workspace_size_per_rank(8, 256, 14400, 14336) == L.workspace_size_per_rank(8, 256, 14400, 14336)
    assert m.MoeAlltoAll.get_moe_workspace_size_per_rank(8, 8, 256, 7168) == m.moe_a2a_get_workspace_size_per_rank(
        8, 256, 2 * 7168 + 4 * 8 + 4 * 8, 2 * 7168
    )
    assert m.MoeAlltoAll.get_moe_workspace_size_per_rank(8, 8, 256, 7168, 64) == m.moe_a2a_get_workspace_size_per_rank(
        8, 256, 2 * 7168 + 64 + 64, 2 * 7168
    )


def test_metainfo_index_names_are_exported():
    for name, value in L.METAINFO_INDEX.items():
        assert getattr(m, name) == value
        assert name in m.__all__


def test_wrap_payload_tensor_in_workspace():
    stride, size = 4096, 3000
    flat = torch.arange(2 * stride, dtype=torch.int64).to(torch.uint8)
    ws = flat.as_strided((2, size), (stride, 1))
    view = m.moe_a2a_wrap_payload_tensor_in_workspace(ws, [2, 3], stride + 128, stride + 128 + 2 * 3 * 4 * 4, torch.float32)
    assert view.shape == (2, 3, 4) and view.dtype == torch.float32
    assert view.data_ptr() == flat.data_ptr() + stride + 128
    row = m.moe_a2a_wrap_payload_tensor_in_workspace(ws[1], [4], 256, 256 + 32, torch.int32)
    assert row.shape == (4, 2) and row.data_ptr() == flat.data_ptr() + stride + 256
    with pytest.raises(errors.InputError):
        m.moe_a2a_wrap_payload_tensor_in_workspace(ws, [2], stride - 8, stride + 8, torch.uint8)  # crosses rows
    with pytest.raises(errors.InputError):
        m.moe_a2a_wrap_payload_tensor_in_workspace(ws, [3], 0, 8 * 4, torch.float32)  # 8 floats in 3 rows
    with pytest.raises(errors.InputError):
        m.moe_a2a_wrap_payload_tensor_in_workspace(ws, [1], 2, 10, torch.float32)  # misaligned


def test_constructor_checks_arguments_before_attaching(tmp_path):
    class Mapping:
        moe_ep_rank, moe_ep_size = 0, 2

    common = dict(job="never", runtime_dir=tmp_path, timeout=1.0)
    for args, kwargs in [
        ((object(), 8, 2, 8, 1 << 20), {}),
        ((Mapping(), 0, 2, 8, 1 << 20), {}),
        ((Mapping(), 8, 23, 64, 1 << 20), {}),
        ((Mapping(), 8, 2, 1, 1 << 20), {}),  # fewer experts than ranks
        ((Mapping(), 8, 2, 8), {}),  # neither workspace size nor hidden size
        ((Mapping(), 8, 2, 8, None, 0), {}),
    ]:
        with pytest.raises(errors.InputError):
            m.MoeAlltoAll(*args, **kwargs, **common)
