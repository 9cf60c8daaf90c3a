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


def test_fp8_rows_scales_and_round_trip():
    """The FP8 row format: e4m3 bytes, then one E8M0 byte (k + 127) per 32 elements, padded to 16;
    k the smallest exponent with amax * 2^-k <= 448; the round trip within 2^-4 relative for
    normal values, zeros exact."""
    import torch

    from a2ad import layout as L
    from a2ad.client.host_plane import dequantize_fp8, quantize_fp8

    assert L.fp8_row_bytes(7168) == 7392 and L.fp8_row_bytes(2880) == 2976 and L.fp8_row_bytes(32) == 48
    x = torch.zeros(4, 64)
    x[0, :32] = 448.0          # k = 0
    x[1, :32] = 450.0          # just above (the next bf16): k = 1
    x[2, :32] = 1.0            # k = -8: 256 * 2^-8
    x[3, 32:] = 1e-30          # tiny: a small k, still exact to 2^-4
    rows = quantize_fp8(x.to(torch.bfloat16))
    assert rows.shape == (4, 80) and rows.dtype == torch.uint8
    scales = rows[:, 64:66].to(torch.int32) - 127
    assert scales[0, 0] == 0 and scales[1, 0] == 1 and scales[2, 0] == -8
    assert scales[0, 1] == -126  # an all-zero block: the smallest exponent
    back = dequantize_fp8(rows, 64)
    assert torch.equal(back[0, :32], torch.full((32,), 448.0)) and torch.equal(back[2, :32], torch.ones(32))
    assert torch.equal(back[0, 32:], torch.zeros(32))
    tiny = x[3, 32:].to(torch.bfloat16).float()
    assert float(((back[3, 32:] - tiny).abs() / tiny).max()) <= 2.0 ** -4
    g = torch.Generator().manual_seed(5)
    y = (torch.randn(64, 2880, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    yb = dequantize_fp8(quantize_fp8(y), 2880)
    yf = y.float()
    blocks_max = yf.abs().reshape(64, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(64, 2880)
    normal = yf.abs() >= blocks_max * 2.0 ** -7  # e4m3 normals start 2^-6 below 448 ~ 2^8.8
    rel = ((yb - yf).abs() / yf.abs().clamp(min=1e-30))[normal]
    assert float(rel.max()) <= 2.0 ** -4, float(rel.max())


def test_payload_descriptors_name_the_first_difference():
    import torch

    from a2ad import layout as L
    from a2ad.control import spec_mismatch_error

    a = L.payload_spec([16, 8, 8], [torch.bfloat16, torch.int32, torch.float32], 0)
    b = L.payload_spec([14, 8, 8], [torch.bfloat16, torch.int32, torch.float32], 0)
    assert L.spec_mismatch(a, a) is None
    assert L.spec_mismatch(a, b) == (L.SPEC_FIELD_WIDTH + 0, 16, 14)
    c = L.payload_spec([16, 8, 8], [torch.bfloat16, torch.int32, torch.int32], 0)
    field, mine, theirs = L.spec_mismatch(a, c)
    assert field == L.SPEC_FIELD_DTYPE + 2 and L.DTYPE_NAMES[mine] == "float32" and L.DTYPE_NAMES[theirs] == "int32"
    assert L.spec_mismatch(a, L.payload_spec([16, 8], None, 0))[0] == L.SPEC_FIELD_COUNT
    assert L.spec_mismatch(a, L.payload_spec([16, 8, 8], [torch.bfloat16, torch.int32, torch.float32], 9))[0] == \
        L.SPEC_FIELD_EPLB
    msg = str(spec_mismatch_error("j", 1, 0, L.SPEC_FIELD_WIDTH, 16, 14, 7))
    assert "input_payloads[0] bytes per token" in msg and "this rank 16, rank 0 14" in msg and "round 7" in msg
    s1 = L.combine_spec(7168, torch.bfloat16)
    s2 = L.combine_spec(7168, torch.bfloat16, low_precision=True)
    msg = str(spec_mismatch_error("j", 0, 1, L.SPEC_FIELD_COMBINE, s1, s2, 3))
    assert "low_precision=False" in msg and "low_precision=True" in msg


def test_layout_places_eplb_and_fp8_regions():
    from a2ad import layout as L

    aux = L.aux_layout(4, 64)
    size = L.workspace_size_per_rank(4, 64, 2 * 256 + 16, 2 * 256, eplb_stats_num_experts=100)
    pl = L.payload_layout(aux, size, 64, [512, 16], 512, eplb_stats_num_experts=100)
    assert pl.eplb_offset == aux.payload_data and pl.dispatch_offsets[0] >= pl.eplb_offset + 4 * 4 * 100
    assert pl.dispatch_offsets[0] % L.ALIGN == 0 and pl.spec[8] == 100
    off = L.fp8_combine_offset(pl, 4, 256, False)
    assert off % L.ALIGN == 0 and off + 4 * 64 * L.fp8_row_bytes(256) <= size and off >= pl.combine_offset
    import pytest

    with pytest.raises(L.LayoutError, match="low-precision combine region"):
        L.fp8_combine_offset(pl, 4, 256, True)  # no room below the bf16 region in this workspace
