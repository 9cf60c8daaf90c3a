"""The layout module: aux offsets, the seed's size formula, payload placement, expert partition."""

import pytest

from a2ad import layout as L


def test_aux_fields_are_aligned_and_disjoint():
    aux = L.aux_layout(8, 1000)
    offs = aux.metainfo()
    assert all(o % L.ALIGN == 0 for o in offs)
    assert offs[L.PAYLOAD_DATA_OFFSET_INDEX] == aux.payload_data
    ordered = [aux.flag_val, aux.local_token_counter, aux.send_counters, aux.recv_counters,
               aux.dispatch_completion_flags, aux.combine_completion_flags, aux.topk_target_ranks,
               aux.topk_send_indices, aux.block_counters, aux.slot_tokens, aux.combine_slice_flags,
               aux.payload_data]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)
    assert all(o % L.ALIGN == 0 for o in ordered)
    assert aux.topk_send_indices - aux.topk_target_ranks >= 4 * 1000 * L.MAX_TOP_K
    assert aux.combine_slice_flags - aux.slot_tokens >= 4 * 8 * 1000
    assert aux.combine_slices == -(-1000 // L.COMBINE_SLICE_ROWS)
    assert L.combine_slices(L.COMBINE_SLICE_ROWS * 7 + 1) == 8
    assert aux.payload_data - aux.combine_slice_flags >= 4 * 8 * aux.combine_slices
    assert aux.aux_data_size == aux.payload_data + L.ALIGN_SLACK


@pytest.mark.parametrize("ep,tokens", [(1, 1), (2, 7), (8, 4096), (64, 33)])
@pytest.mark.parametrize("widths", [[14400], [1, 3, 5, 7, 11, 13], [16] * 6, [4097, 2]])
def test_any_payload_set_fits_the_size_formula(ep, tokens, widths):
    comb = 2 * 7
    size = L.workspace_size_per_rank(ep, tokens, sum(widths), comb)
    aux = L.aux_layout(ep, tokens)
    for rt in (1, max(1, tokens // 2), tokens):
        pl = L.payload_layout(aux, size, rt, widths, comb)
        assert all(o % L.ALIGN == 0 for o in pl.dispatch_offsets)
        assert pl.combine_offset % L.ALIGN == 0
        assert pl.combine_offset + ep * rt * comb <= size
        assert size - (pl.combine_offset + ep * rt * comb) < L.ALIGN  # the combine region ends the row
        assert pl.dispatch_end <= pl.combine_offset
        ends = [o + ep * rt * w for o, w in zip(pl.dispatch_offsets, widths)]
        assert all(e <= n for e, n in zip(ends, pl.dispatch_offsets[1:] + (pl.combine_offset,)))


def test_payloads_that_do_not_fit_are_refused():
    aux = L.aux_layout(2, 16)
    size = L.workspace_size_per_rank(2, 16, 64, 64)
    with pytest.raises(L.LayoutError, match="bytes per token"):
        L.payload_layout(aux, size, 16, [4096])
    with pytest.raises(L.LayoutError, match="combine"):
        L.payload_layout(aux, size, 16, [64], 4096)
    with pytest.raises(L.LayoutError, match="runtime_max_tokens_per_rank"):
        L.payload_layout(aux, size, 17, [64])
    with pytest.raises(L.LayoutError, match="at most 6"):
        L.payload_layout(aux, size, 1, [1] * 7)


def test_seed_helper_size():
    # bf16 hidden + int32 ids + fp32 scales for dispatch, bf16 for combine
    assert L.moe_workspace_size_per_rank(4, 8, 64, 1024) == L.workspace_size_per_rank(4, 64, 2048 + 64, 2048)


@pytest.mark.parametrize(
    "num_experts, ep, sizes",
    [(32, 4, [8, 8, 8, 8]), (384, 5, [77, 77, 77, 77, 76]), (6, 4, [2, 2, 1, 1]), (8, 8, [1] * 8)],
)
def test_contiguous_partition(num_experts, ep, sizes):
    owned = [list(L.experts_of_rank(r, num_experts, ep)) for r in range(ep)]
    assert [len(o) for o in owned] == sizes
    assert sum(owned, []) == list(range(num_experts))
    for r, experts in enumerate(owned):
        assert all(L.expert_owner(e, num_experts, ep) == r for e in experts)


def test_partition_refuses_more_ranks_than_experts():
    with pytest.raises(ValueError):
        L.expert_partition(3, 4)


def test_generated_c_header_is_current():
    """csrc/layout.h is what a2ad.layout generates: the kernels and Python share one source."""
    from pathlib import Path

    from a2ad import layout as L

    path = Path(__file__).resolve().parent.parent / L.C_HEADER_PATH
    assert path.read_text() == L.c_header(), "csrc/layout.h is stale: run `python -m a2ad.layout > csrc/layout.h`"


def test_dispatch_ready_is_an_aligned_u64_field_before_the_payloads():
    from a2ad import layout as L

    for ep, mt in ((1, 1), (2, 256), (8, 4096), (64, 17)):
        aux = L.aux_layout(ep, mt)
        assert aux.dispatch_ready % 8 == 0 and aux.dispatch_ready >= aux.recv_rts + 4 * ep
        assert aux.dispatch_ready + 8 * ep <= aux.payload_data
