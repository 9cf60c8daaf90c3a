"""The client's hot path: no host synchronization in dispatch, combine, sanitize or check on
CUDA; input that only the data can show (expert ids out of range, ranks passing different
runtime_max_tokens_per_rank) reported by a later call while the job goes on; the public API
captured in a CUDA graph; several MoeAlltoAll objects on one rank.

Real daemons and rank processes (``_helpers_dataplane``); each scenario checks its rank's
results against ``a2ad.client.reference`` itself. "cuda" runs where GPUs are visible."""

from __future__ import annotations

import pytest

import dataplane_cases as cases
from _helpers_dataplane import BACKENDS, dataplane_daemons, make_job, rank_pool, run_job  # noqa: F401  (fixtures)

CUDA = [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _job(daemons, backend, prefix, ep=2, **kw):
    return make_job(daemons, backend, prefix, ep, **{"hidden": 256, **kw})


def _run(pool, job, fn, *args, timeout=240.0):
    return run_job(pool, job, fn, *args, timeout=timeout)


@pytest.mark.parametrize("backend", CUDA)
def test_eager_calls_never_synchronize(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "nosync", max_num_tokens=32)
    stats = _run(rank_pool, job, cases.sync_free_rounds, cases.Plan(seed=11, rounds=4))
    assert [s["rounds"] for s in stats] == [4, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_expert_id_raises_later_and_the_job_goes_on(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "badid")
    stats = _run(rank_pool, job, cases.bad_expert_ids_then_rounds, cases.Plan(seed=3, rounds=3, tokens=(4, 4)))
    assert "message" in stats[0] and "message" not in stats[1]
    assert [s["rounds"] for s in stats] == [3, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_runtime_max_tokens_raises_on_every_rank(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "rtmis")
    stats = _run(rank_pool, job, cases.rt_mismatch_then_rounds, cases.Plan(seed=5, rounds=3, tokens=(3, 3)))
    assert all("runtime_max_tokens_per_rank" in s["message"] for s in stats)
    assert [s["rounds"] for s in stats] == [3, 3]


@pytest.mark.parametrize("backend", CUDA)
def test_public_api_in_one_cuda_graph_replayed_100_times(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "graph", max_num_tokens=16)
    stats = _run(rank_pool, job, cases.graph_replays, 12, 100)
    assert [s["replays"] for s in stats] == [100, 100]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_objects_on_one_rank_share_the_attachment(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "twoobj")
    stats = _run(rank_pool, job, cases.two_objects_one_rank, cases.Plan(seed=9, rounds=4))
    assert [s["rounds"] for s in stats] == [5, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_ops_under_torch_compile_fullgraph(rank_pool, dataplane_daemons, backend):
    job = _job(dataplane_daemons, backend, "compiled")
    stats = _run(rank_pool, job, cases.compiled_ops_rounds, cases.Plan(seed=21, rounds=3, tokens=(5, 3)), "aot_eager")
    assert [s["rounds"] for s in stats] == [3, 3]
