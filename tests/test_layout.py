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


@pytest.mark.parametrize("ep,tokens", [(1, 1), (2, 7), (8, 4096), (64, 33), (256, 9)])
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


def test_aux_plan_is_the_generated_struct_of_the_kernels():
    """The aux list of a CUDA plan comes from one definition (layout.AUX_PLAN_FIELDS): its values
    are the AuxLayout fields and constants of those names (and the rows' lines tail, 0 unless
    given), and csrc/layout.h holds an index per
    value and the kernels' AuxOffsets with exactly the fields that are not constants, in order."""
    import re

    from a2ad import layout as L

    names = [name for name, _, _ in L.AUX_PLAN_FIELDS]
    assert len(set(names)) == len(names)
    assert set(L.AUX_PLAN_CONSTANTS) == {name for name, ctype, _ in L.AUX_PLAN_FIELDS if ctype != "int64_t"} - {
        "max_num_tokens", "combine_slices"}
    for ep, mt in ((1, 1), (8, 4096), (256, 3)):
        aux = L.aux_layout(ep, mt)
        values = L.aux_plan(aux)
        assert len(values) == len(names)
        for name, v in zip(names, values):
            want = (getattr(L, L.AUX_PLAN_CONSTANTS[name]) if name in L.AUX_PLAN_CONSTANTS
                    else 0 if name == "lines_tail" else getattr(aux, name))
            assert v == want, name
    header = L.c_header()
    for i, name in enumerate(names):
        assert f"constexpr int AUX_{name.upper()} = {i};" in header
    struct = re.search(r"struct AuxOffsets \{\n(.*?)\n\};", header, re.S).group(1)
    fields = [re.match(r"\s*(\w+) (\w+);", line).groups() for line in struct.splitlines()]
    assert fields == [(ctype, name) for name, ctype, _ in L.AUX_PLAN_FIELDS if ctype]
    assert {name for _, name in fields} == set(names) - {"block_counter_slots", "combine_slice_rows",
                                                         "row_tail_bytes", "combine_lines_bytes"}


def test_dispatch_ready_is_an_aligned_u64_field_before_the_payloads():
    from a2ad import layout as L

    for ep, mt in ((1, 1), (2, 256), (8, 4096), (64, 17), (256, 3)):
        aux = L.aux_layout(ep, mt)
        assert aux.dispatch_ready % 8 == 0 and aux.dispatch_ready >= aux.recv_rts + 4 * ep
        assert aux.dispatch_ready + 8 * ep <= aux.payload_data


def test_masks_cross_as_words_and_bytes_of_any_width():
    """A rank mask is MASK_WORDS little-endian u64 words (rank q: bit q & 63 of word q >> 6);
    it crosses a socket as MASK_BYTES bytes and is shown as a rank list."""
    assert L.MAX_EP_SIZE == 256 and L.MASK_WORDS == 4 and L.MASK_BYTES == 32
    m = L.full_mask(64) | 1 << 65 | (L.full_mask(256) ^ L.full_mask(70))
    assert L.format_ranks(m) == "0-63,65,70-255"
    assert L.parse_ranks("0-63,65,70-255") == m
    assert L.format_ranks(0) == "none" and L.parse_ranks("none") == 0
    assert L.format_ranks(1 << 255) == "255" and L.format_ranks(0b1011) == "0-1,3"
    b = L.mask_to_bytes(m)
    assert len(b) == 32 and L.mask_from_bytes(b) == m
    assert b[8] == 0b11000010 and b[:8] == b"\xff" * 8  # word 1: rank 65 is bit 1, ranks 70.. bits 6..
    assert L.mask_words(1 << 200) == [0, 0, 0, 1 << 8]
    assert L.mask_from_words([-1, 0, 0, 0]) == L.full_mask(64)  # int64 words read as u64
    assert L.mask_from_bytes(L.mask_to_bytes(5)[:8]) == 5  # a one-word mask
    assert L.mask_ranks(m)[63:66] == [63, 65, 70] and len(L.mask_ranks(m)) == 64 + 1 + 186
    with pytest.raises(ValueError, match="MAX_EP_SIZE"):
        L.mask_to_bytes(1 << 256)
    with pytest.raises(ValueError, match="u64 word"):
        L.mask_words(1 << 64, 1)
    with pytest.raises(ValueError, match="whole u64 words"):
        L.mask_from_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="bad rank range"):
        L.parse_ranks("3-1")
    with pytest.raises(ValueError, match="bad rank range"):
        L.parse_ranks("0-256")


def test_control_block_holds_a_mask_of_256_ranks():
    """The control block's active mask has MASK_WORDS words; only changed words are written,
    then the mask generation; every per-rank array has MAX_EP_SIZE entries."""
    from a2ad.control import ControlBlock

    assert L.CB_MASK_GENERATION == L.CB_ACTIVE_MASK + 8 * L.MASK_WORDS
    assert L.CB_INPUT_OWN + 4 * L.MAX_EP_SIZE <= L.CONTROL_BLOCK_SIZE
    assert L.CONTROL_VERSION >= 2
    buf = bytearray(L.CONTROL_BLOCK_SIZE)
    cb = ControlBlock(buf)
    cb.initialize(256, L.POLICY_DEGRADE)
    assert cb.valid and cb.version == L.CONTROL_VERSION and cb.ep_size == 256
    assert cb.active_mask == L.full_mask(256) and cb.degraded_since_ns == 0
    assert buf[L.CB_ACTIVE_MASK:L.CB_MASK_GENERATION] == b"\xff" * 32
    lost = L.full_mask(256) & ~(1 << 200)
    assert cb.set_active_mask(lost, 256, now_ns=123)
    assert cb.active_mask == lost and cb.mask_generation == 1 and cb.degraded_since_ns == 123
    assert not cb.rank_active(200) and cb.rank_active(199) and cb.rank_active(0)
    assert cb.active_word(3) == L.mask_words(lost)[3] and cb.active_word(0) == (1 << 64) - 1
    # a 64-rank job keeps words 1-3 zero
    cb.initialize(64)
    assert cb.active_mask == L.full_mask(64) and cb.active_word(1) == 0
    cb.initialize(256)
    for q in (0, 63, 64, 255):
        cb.set_admit_round(q, 7)
        cb.set_rank_state(q, L.RANK_ATTACHED)
        cb.record_status(q, L.STATUS_TIMEOUT, q ^ 1, 3, L.PHASE_DISPATCH, 9)
    rounds = cb.admit_rounds(256)
    assert len(rounds) == 256 and rounds[255] == 7 and rounds[254] == 0
    assert cb.rank_state(255) == L.RANK_ATTACHED and cb.status(255).peer == 254
    assert cb.effective_mask(256, 6) == L.full_mask(256) & ~(1 | 1 << 63 | 1 << 64 | 1 << 255)
    # a block of the previous layout version is not valid for this one
    struct_ver = (1).to_bytes(4, "little")
    buf[L.CB_VERSION:L.CB_VERSION + 4] = struct_ver
    assert not cb.valid and cb.version == 1


def test_sizes_at_ep_256_are_linear_in_ep_size():
    """What one rank's row needs at ep_size 256 (top_k 8, MoeAlltoAll's payloads for
    hidden_size), the figures of README.md "Sizes at ep_size 256" (printed with -s): every
    part grows linearly in ep_size, so four times the ep_size is four times the row, up to
    the fixed per-rank parts (top-k scratch, flags, alignment)."""
    table = {(256, 7168): 1883638144, (256, 2880): 759564672, (1024, 7168): 7534483840, (1024, 2880): 3038189952}
    aux = {256: 395648, 1024: 1513856}
    for (tokens, hidden), want in table.items():
        got = L.moe_workspace_size_per_rank(256, 8, tokens, hidden)
        a = L.aux_data_size(256, tokens)
        print(f"\nep 256, max_num_tokens {tokens}, hidden {hidden}, top_k 8: row {got} B ({got / 2**20:.1f} MiB), "
              f"aux {a} B ({a / 2**20:.1f} MiB); ep 64: {L.moe_workspace_size_per_rank(64, 8, tokens, hidden) / 2**20:.1f}"
              f" MiB; the job's 256 rows {256 * got / 2**30:.1f} GiB")
        assert got == want and a == aux[tokens]
        sizes = [L.moe_workspace_size_per_rank(ep, 8, tokens, hidden) for ep in (64, 128, 192, 256)]
        steps = {b - a for a, b in zip(sizes, sizes[1:])}
        assert max(steps) - min(steps) <= 3 * L.ALIGN, steps  # the same step for every 64 ranks
        fixed = 2 * sizes[0] - sizes[1]  # the part that does not grow with ep_size
        assert 0 <= fixed < 64 * L.ALIGN + 2 * 4 * tokens * L.MAX_TOP_K + L.ALIGN_SLACK, fixed
    assert L.CONTROL_BLOCK_SIZE == 16384


def test_lines_tail_lies_past_the_row_inside_its_stride():
    """A row allocated with a lines tail (row_bytes_with_tail, rounded up to any granularity
    that is a multiple of a page) has its last ROW_TAIL_BYTES past size_per_rank, page-aligned;
    a row without the room for one is refused. The heads page holds a 16-byte line for each of
    MAX_LINES_EP_SIZE ranks, then, apart from them, the dispatch digests (as many lines), and
    the aux plan carries the tail (0: none) and the sizes the kernels were built for."""
    assert L.LINE_HEADS_BYTES >= 16 * L.MAX_LINES_EP_SIZE and L.LINE_HEADS_BYTES % 4096 == 0
    d = L.DISPATCH_DIGESTS_OFFSET
    assert d % 16 == 0 and d >= 16 * L.MAX_LINES_EP_SIZE and d + 16 * L.MAX_LINES_EP_SIZE <= L.LINE_HEADS_BYTES
    assert L.ROW_TAIL_BYTES == L.LINE_HEADS_BYTES + L.COMBINE_LINES_BYTES and L.COMBINE_LINES_BYTES % 16 == 0
    for size in (1, 4095, 4096, 65536, 123457, 3 << 30):
        for gran in (4096, 1 << 16, 2 << 20):
            stride = L.pad_up(L.row_bytes_with_tail(size), gran)
            tail = L.lines_tail_offset(size, stride)
            assert size <= tail and tail % 4096 == 0 and tail + L.ROW_TAIL_BYTES == stride, (size, gran)
        with pytest.raises(ValueError):
            L.lines_tail_offset(size, L.pad_up(size, 4096))  # (no room past the row)
    aux = L.aux_layout(4, 64)
    names = [name for name, _, _ in L.AUX_PLAN_FIELDS]
    plan = L.aux_plan(aux, 1 << 20)
    assert plan[names.index("lines_tail")] == 1 << 20 and L.aux_plan(aux)[names.index("lines_tail")] == 0
    assert plan[names.index("row_tail_bytes")] == L.ROW_TAIL_BYTES
    assert plan[names.index("combine_lines_bytes")] == L.COMBINE_LINES_BYTES


def test_combine_lines_bytes_of_each_mode():
    """A round's lines: 16 bytes per 8 bytes of every other rank's rows (twice the rows); FP8: a
    line per 8 e4m3 bytes and a scale word per 32 elements (half the bf16 lines and a sixteenth).
    At hidden 2880, 2 ranks: bf16 lines fit COMBINE_LINES_BYTES up to 91 rows, FP8 lines their
    smaller limit, COMBINE_LINES_FP8_BYTES, up to 121 (so T=96 fits as FP8 only)."""
    assert L.combine_lines_bytes(2, 1, 2880, 2) == 4 * 2880
    assert L.combine_lines_bytes(3, 5, 256, 4) == 2 * 5 * 2 * 256 * 4
    assert L.combine_lines_bytes(2, 1, 2880, 2, low_precision=True) == 16 * 360 + 8 * 90
    assert L.combine_lines_bytes(5, 3, 7168, 2, low_precision=True) * 32 == L.combine_lines_bytes(5, 3, 7168, 2) * 18
    fits = [rt for rt in range(1, 300) if L.combine_lines_bytes(2, rt, 2880, 2) <= L.COMBINE_LINES_BYTES]
    fits8 = [rt for rt in range(1, 300)
             if L.combine_lines_bytes(2, rt, 2880, 2, low_precision=True) <= L.COMBINE_LINES_FP8_BYTES]
    assert fits == list(range(1, 92)) and fits8 == list(range(1, 122))
    assert L.COMBINE_LINES_FP8_BYTES <= L.COMBINE_LINES_BYTES  # (the lines region holds either)


def test_spec_digest_tells_descriptors_apart_by_any_word():
    """The dispatch digest of a payload descriptor: 64 bits, a function of the words alone, and
    different wherever any one word differs (by one, in its sign bit, or as the 32 bits a
    negative int32 has); another word count is refused."""
    base = L.payload_spec([14336, 32, 32], dtypes=["bfloat16", "int32", "float32"],
                          eplb_stats_num_experts=256)
    d = L.spec_digest(base)
    assert 0 <= d < 1 << 64 and d == L.spec_digest(list(base))
    seen = {d}
    for w in range(L.SPEC_WORDS):
        for v in (base[w] + 1, base[w] ^ (1 << 31), base[w] - (1 << 32) if base[w] >= 1 << 31 else None):
            if v is None:
                continue
            other = list(base)
            other[w] = v
            same_bits = (v & 0xFFFFFFFF) == (base[w] & 0xFFFFFFFF)
            assert (L.spec_digest(other) == d) == same_bits, (w, v)
            seen.add(L.spec_digest(other))
    assert L.spec_digest([-1] + list(base[1:])) == L.spec_digest([0xFFFFFFFF] + list(base[1:]))
    assert len(seen) > 2 * L.SPEC_WORDS
    with pytest.raises(L.LayoutError):
        L.spec_digest(base[:-1])


def test_spec_digest_is_the_kernels_function(tmp_path):
    """layout.spec_digest gives what csrc/primitives.cuh's spec_digest (the function the CUDA
    launcher computes the dispatch digests with) gives for the same words: that function,
    compiled for the host by the C++ compiler here, on descriptors with negative words and
    every field in use."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    src = (Path(__file__).resolve().parents[1] / "csrc" / "primitives.cuh").read_text()
    m = re.search(r"^__host__ __device__ __forceinline__ uint64_t spec_digest\(.*?^}\n", src, re.S | re.M)
    assert m, "spec_digest not found in csrc/primitives.cuh"
    specs = [
        L.payload_spec([14336, 32, 32], dtypes=["bfloat16", "int32", "float32"], eplb_stats_num_experts=256),
        L.payload_spec([5760, 64]),
        tuple([-1] * L.SPEC_WORDS),
        tuple(range(-6, 6)),
    ]
    rows = ",\n".join("{" + ", ".join(f"(int32_t){int(v)}" for v in s) + "}" for s in specs)
    prog = tmp_path / "digest.cpp"
    prog.write_text(
        "#include <cstdint>\n#include <cstdio>\n"
        "#define __host__\n#define __device__\n#define __forceinline__ inline\n"
        f"namespace layout {{ constexpr int SPEC_WORDS = {L.SPEC_WORDS}; }}\n"
        + m.group(0)
        + f"int main() {{\n  const int32_t specs[][{L.SPEC_WORDS}] = {{{rows}}};\n"
        + "  for (const auto& s : specs) std::printf(\"%llu\\n\", (unsigned long long)spec_digest(s));\n}\n"
    )
    exe = tmp_path / "digest"
    subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(exe), str(prog)], check=True, capture_output=True, timeout=120)
    got = [int(line) for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                                                 timeout=60).stdout.split()]
    assert got == [L.spec_digest(s) for s in specs]
