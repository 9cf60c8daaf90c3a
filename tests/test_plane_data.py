"""Data-plane features on both backends, with a real daemon and real client processes:
ranks that disagree on their payloads get InputError on every rank (nothing silently
misread), EPLB statistics gathered in the dispatch round, the FP8 low-precision combine
(exact against its definition on the host, accuracy against the bf16 combine stated as a
measured bound), and the caller's active-rank mask. Scenarios: ``plane_cases``."""

from __future__ import annotations

import pytest

import plane_cases as pc
import dataplane_cases as dc
from _helpers_dataplane import BACKENDS, dataplane_daemons, make_job, rank_pool, run_job  # noqa: F401  (fixtures)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep", [2, 3])
def test_payload_width_mismatch_raises_on_every_rank(rank_pool, dataplane_daemons, backend, ep):
    """hidden 7 on rank 0, 8 on the others: InputError on every rank naming the payload and both
    widths, then exact rounds."""
    job = make_job(dataplane_daemons, backend, "width", ep, hidden=8)
    results = run_job(rank_pool, job, pc.payload_width_mismatch, dc.Plan(seed=40, rounds=2))
    for r, res in enumerate(results):
        assert "input_payloads[0] bytes per token" in res["message"], (r, res["message"])
        assert res["rounds"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ep,num_stats", [(2, 5), (4, 256)])
def test_eplb_stats_gathered(rank_pool, dataplane_daemons, backend, ep, num_stats):
    job = make_job(dataplane_daemons, backend, "eplb", ep, hidden=64)
    assert [r["rounds"] for r in run_job(rank_pool, job, pc.eplb_gather, 3, num_stats)] == [3] * ep


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_workspace", [False, True], ids=["staged", "in-workspace"])
@pytest.mark.parametrize("ep,hidden", [(2, 2880), (4, 256)])
def test_fp8_combine_accuracy(rank_pool, dataplane_daemons, backend, in_workspace, ep, hidden):
    """Measured on seeded N(0, 1) expert outputs; the per-element bound is asserted inside
    (|fp8 - bf16| <= 2^-4 sum|contributions| + 2^-7 |bf16| + 1e-6); the figures are printed."""
    job = make_job(dataplane_daemons, backend, "fp8", ep, hidden=hidden, max_num_tokens=16, top_k=4, num_experts=16)
    results = run_job(rank_pool, job, pc.fp8_combine, 2, in_workspace)
    worst_abs = max(r["max_abs_err"] for r in results)
    worst_rel = max(r["max_err_rel_to_max_out"] for r in results)
    print(f"FP8 combine vs bf16 ({backend}, ep {ep}, hidden {hidden}): max abs error {worst_abs:.4g}, "
          f"max error / max |output| {worst_rel:.4g}, elements differing from the definition "
          f"{sum(r['differing_from_definition'] for r in results)}")
    assert worst_rel <= 0.0625, worst_rel
    if backend == "host":
        assert sum(r["differing_from_definition"] for r in results) == 0


MASKS = [
    pytest.param("host", False, id="host-cpu-mask"),
    pytest.param("cuda", False, id="cuda-cpu-mask", marks=pytest.mark.gpu),
    pytest.param("cuda", True, id="cuda-device-mask", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("backend,device_mask", MASKS)
def test_caller_mask_leaves_a_rank_out(rank_pool, dataplane_daemons, backend, device_mask):
    job = make_job(dataplane_daemons, backend, "cmask", 4, hidden=32, num_experts=16)
    results = run_job(rank_pool, job, pc.caller_mask_round, 2, device_mask)
    assert [r["skipped"] for r in results] == [False, False, True, False]


def test_kernel_timing_times_the_fp8_combine_beside_bf16():
    """``kernel_timing --low-precision``: every bf16 row at a T is followed by the FP8 combine's."""
    from a2ad.bench import kernel_timing as KT
    from a2ad.client import cuda_plane as cp

    rows = KT.plan(cp, [1, 128], diags=False, low_precision=True)
    assert rows == [("default", 1, 0), (KT.FP8_LABEL, 1, 0), ("default", 128, 0), (KT.FP8_LABEL, 128, 0),
                    ("default", 4096, 0), (KT.FP8_LABEL, 4096, 0)]
    assert KT.plan(cp, [1], diags=False) == [("default", 1, 0), ("default", 4096, 0)]
    assert KT.build_parser().parse_args(["--low-precision", "--one-gpu"]).low_precision
