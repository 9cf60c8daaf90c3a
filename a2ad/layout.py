"""Workspace and control-block layout: the one place every offset comes from.

Both the daemon (which initializes the aux region) and the clients (host data
plane, CUDA kernels through their launch arguments) take offsets from here; the
CUDA side never recomputes them.

Workspace
---------
Each rank owns one *row*: ``size_per_rank`` bytes. A client maps all rows of a
job into one range, row ``q`` at ``q * row_stride`` (``row_stride`` >=
``size_per_rank``: the backend's page or allocation granularity), so the
workspace is a ``[ep_size, size_per_rank]`` uint8 tensor with ``stride(0) ==
row_stride``.

A row starts with the *aux* region (fixed for a job; every field 128-byte
aligned; all int32)::

    FLAG_VAL                    [1]                round number of this rank (starts at 1)
    LOCAL_TOKEN_COUNTER         [1]                local token count of the current dispatch
    SEND_COUNTERS               [ep_size]          tokens this rank sends to each target
    RECV_COUNTERS               [ep_size]          written by source s: tokens s sent here
    DISPATCH_COMPLETION_FLAGS   [ep_size]          written by source s: = round when its data is here
    COMBINE_COMPLETION_FLAGS    [ep_size]          written by target t: = round when t's combine
                                                   region holds the outputs for this rank
    TOPK_TARGET_RANKS           [max_tokens, 22]   per (token, k): target rank, -1 for a repeat
    TOPK_SEND_INDICES           [max_tokens, 22]   per (token, k): slot at the target, -1 for a repeat
    BLOCK_COUNTERS              [32]               scratch for the CUDA kernels' last-block pattern
    SLOT_TOKENS                 [ep_size, max_tokens]  per (target, slot): the local token sent there
                                                   (this rank's own scratch, CUDA kernels only)
    COMBINE_SLICE_FLAGS         [ep_size, slices]  written by target t: = round when rows
                                                   [j * COMBINE_SLICE_ROWS, +COMBINE_SLICE_ROWS) of
                                                   t's combine region for this rank are staged
                                                   (early readiness; optional, CUDA kernels only)
    RECV_RTS                    [ep_size]          written by source s: the runtime_max_tokens_per_rank
                                                   of its current dispatch (every rank must pass the same)
    DISPATCH_READY              [ep_size] u64      written by source s in one release store:
                                                   ``(high << 32) | round``, high = rt * (max_tokens
                                                   + 1) + (tokens s sent here) when that fits 32
                                                   bits (max_tokens <= 65535), else the count
                                                   (CUDA kernels: the count and rt travel with
                                                   the flag; RECV_RTS is then not written)
    RECV_SPECS                  [ep_size, SPEC_WORDS]  written by source s: the descriptor of its current
                                                   dispatch's payload list (:func:`payload_spec`), compared
                                                   with this rank's own before the round's data is used
    COMBINE_READY               [ep_size] u64      written by target t in one release store:
                                                   ``(combine spec << 32) | round`` (:func:`combine_spec`):
                                                   the combine flag together with what t staged
    PAYLOAD_DATA                                   start of the payload area

``slices`` is ``ceil(max_tokens / COMBINE_SLICE_ROWS)``; a slice flag is a u64 like
COMBINE_READY (``(combine spec << 32) | round``). The six last fields are
not in FlashInfer's MoeAlltoAll metainfo list; they only move PAYLOAD_DATA, and a client checks
the daemon's metainfo against its own, so a daemon and client that disagree on the
layout refuse each other at join.

followed by ``ALIGN_SLACK`` bytes that make room for aligning every payload
region, so that a payload set sized by :func:`workspace_size_per_rank` always
fits.

The payload area is laid out per call (it depends on the payload widths and on
``runtime_max_tokens_per_rank``, see :func:`payload_layout`): first, when the job
gathers EPLB statistics, the region ``[ep_size(source), eplb_stats_num_experts]``
int32 (written by source s: its local statistics of the round); then one region per
dispatch payload, ``[ep_size(source), runtime_max_tokens_per_rank,
bytes_per_token]``, each 128-byte aligned, growing up from PAYLOAD_DATA; and the
combine region ``[ep_size(source), runtime_max_tokens_per_rank,
combine_bytes_per_token]``, 128-byte aligned, ending at the end of the row. Keeping
the two apart at opposite ends is what lets a rank start dispatch R+1 while slower
peers still read its combine region of round R (docs/PROTOCOL.md).

The data-plane protocol over this layout (host and CUDA alike) is documented in
``docs/PROTOCOL.md``.

Control block
-------------
One per job, ``CONTROL_BLOCK_SIZE`` bytes of shared host memory (registered for
GPU access on the CUDA backend)::

    0     u32  magic              CONTROL_MAGIC
    4     u32  layout version     CONTROL_VERSION
    8     u64  generation         bumped by every job-wide re-arm
    16    u32  abort word         0, or an ABORT_* reason; set by the daemon
    20    i32  abort rank         the rank whose loss caused the abort, or -1
    24    u32  ep_size
    28    u32  peer-loss policy   POLICY_RAISE (0) or POLICY_DEGRADE (1), set at creation; the
                                  active-rank fields below mean something only for POLICY_DEGRADE
                                  (a raise job's ranks are all active until it is aborted)
    32    u64  active mask [MASK_WORDS]
                                  rank q is bit (q & 63) of word (q >> 6): set while the daemon
                                  counts rank q as a live member; cleared when q dies or leaves,
                                  set again when a replacement attached. The daemon writes the
                                  words that change, then bumps the mask generation; a reader may
                                  see one update's words torn, which is the same as seeing its
                                  bits change one at a time (every wait re-reads its peer's bit)
    64    u64  mask generation    bumped by the daemon with every change of the active mask
    72    u64  degraded since     CLOCK_MONOTONIC ns at which the mask lost its first bit, 0
                                  while every bit is set
    128   u32  rank state [MAX_EP_SIZE]   RANK_* values, maintained by the daemon
    1152  status record [MAX_EP_SIZE]     one per rank, STATUS_RECORD_SIZE bytes each, written by that
                                  rank's own kernels/host waits when a wait fails:
                                  +0 u32 code (STATUS_*), +4 i32 peer, +8 u32 round,
                                  +12 u32 phase (PHASE_*), +16 u64 waited ns
    9344  input record [MAX_EP_SIZE]      one per rank, INPUT_RECORD_SIZE bytes each, written by that
                                  rank's dispatch (or combine) kernel when its input was wrong
                                  (the round still completed for every rank): +0 u32 code
                                  (INPUT_*), +4 i32 index (the token, or the peer; for a spec
                                  mismatch ``peer | field << 8``, field a SPEC_FIELD_* value),
                                  +8 i32 value (the expert id, or the peer's value), +12 u32
                                  round. The client raises InputError and clears it.
    13440 i32  admit round [MAX_EP_SIZE]  per rank: the first round it takes part in (0 for the ranks
                                  of a full rendezvous), ADMIT_JOINED while a replacement waits for
                                  its first dispatch, ADMIT_READY once that dispatch asks to be let
                                  in (written by the daemon, the replacement and the lowest active
                                  rank in turn; docs/PROTOCOL.md, "Degraded mode"); ADMIT_ROW
                                  where it is kept in the rank's row instead (SLOT_ADMIT_ROUND: a
                                  replacement let into a job that spans nodes)
    14464 i32  input own [MAX_EP_SIZE]    per rank: with a spec mismatch in its input record, this
                                  rank's own value of the field (the record holds the peer's)

(offsets at MAX_EP_SIZE = 256, MASK_WORDS = 4; CONTROL_BLOCK_SIZE is 16384, four pages).
Version 1 of the block (ep_size <= 64: one mask word at 32, 4096 bytes) is not read by this
version: ``ControlBlock.valid`` is false for it and the daemon refuses to adopt such a job
(a2ad/daemon/persist.py).

Rank q takes part in round R when its mask bit is set and ``0 <= admit round[q] <= R``
(:func:`effective_mask`); every wait on a peer also ends when the peer's bit is cleared.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Largest top_k the layout has room for (FlashInfer's MoeAlltoAll limit).
MAX_TOP_K = 22
#: Largest ep_size a job may have.
MAX_EP_SIZE = 256
#: u64 words of a rank mask (rank q is bit (q & 63) of word (q >> 6), words little endian).
MASK_WORDS = MAX_EP_SIZE // 64
#: Most payloads one dispatch may carry.
MAX_PAYLOADS = 6
ALIGN = 128
#: Room for aligning up to MAX_PAYLOADS dispatch regions, the EPLB region and the combine region.
ALIGN_SLACK = (MAX_PAYLOADS + 2) * ALIGN
BLOCK_COUNTER_SLOTS = 32
# What the CUDA kernels keep in BLOCK_COUNTERS (this rank's own scratch, int32 slots).
#: Arrival counters of the last-block pattern (dispatch, combine).
SLOT_DISPATCH_ARRIVAL = 0
SLOT_COMBINE_ARRIVAL = 1
#: The round whose dispatch / combine wait the launch's poller gave up on.
SLOT_DISPATCH_GIVE_UP = 2
SLOT_COMBINE_GIVE_UP = 3
#: The overlapped combine's next pull item (dispatch zeroes it).
SLOT_PULL_WORK = 4
#: Slots 6-7, one u64: ``~((token << 32) | id)`` of the round's smallest bad (token, expert id).
SLOT_BAD_EXPERT = 6
#: The round whose dispatch saw a peer pass another runtime_max_tokens_per_rank.
SLOT_RT_MISMATCH = 8
#: Degraded mode. Slots 10-17, MASK_WORDS u64 words (a rank mask, rank q bit q & 63 of word
#: q >> 6): the round's view (the effective mask its dispatch prologue read); slot 18: the
#: round it is for (-1: the prologue gave up, the round does not run). Slots 20-27, MASK_WORDS
#: u64 words: the ranks whose combine flags the combine's poller saw (what every pulling
#: block counts); slot 28: the round it is for. A job of ep_size <= 64 uses only the first
#: word of each (its kernels keep one-word masks).
SLOT_VIEW = 10
SLOT_VIEW_ROUND = SLOT_VIEW + 2 * MASK_WORDS
SLOT_COMBINE_SEEN = 20
SLOT_COMBINE_SEEN_ROUND = SLOT_COMBINE_SEEN + 2 * MASK_WORDS
#: This rank's admit round when its control-block entry is ADMIT_ROW (a replacement let into a
#: degrade job that spans nodes: every node's ranks read and write it here, in the rank's row,
#: where they all reach it). Zero after every initialization of the row: admitted from round 0.
SLOT_ADMIT_ROUND = 30
#: The claim that elects the single writer of this rank's status record.
SLOT_STATUS_CLAIM = BLOCK_COUNTER_SLOTS - 1
assert SLOT_VIEW % 2 == 0 and SLOT_COMBINE_SEEN % 2 == 0  # u64 words (BLOCK_COUNTERS is 128-aligned)
assert SLOT_RT_MISMATCH < SLOT_VIEW and SLOT_VIEW_ROUND < SLOT_COMBINE_SEEN
assert SLOT_COMBINE_SEEN_ROUND < SLOT_ADMIT_ROUND < SLOT_STATUS_CLAIM
#: int32 words of a dispatch's payload descriptor (:func:`payload_spec`): [0] payload count,
#: [1..6] bytes per token of payload i, [7] dtype codes (4 bits per payload, 0: not given),
#: [8] eplb_stats_num_experts, [9..11] zero.
SPEC_WORDS = 12
#: The fields of a spec mismatch (the input record's index holds ``peer | field << 8``).
SPEC_FIELD_COUNT = 0
SPEC_FIELD_WIDTH = 1  # + payload index
SPEC_FIELD_DTYPE = 7  # + payload index
SPEC_FIELD_EPLB = 13
SPEC_FIELD_COMBINE = 14
#: Elements per scale of the FP8 combine (one power-of-two scale, an E8M0 byte, per block).
FP8_BLOCK = 32
#: Rows of one combine slice: the unit in which a rank announces that part of its
#: combine region is staged (COMBINE_SLICE_FLAGS).
COMBINE_SLICE_ROWS = 8
#: Bytes of a row's combine lines (in its lines tail, after the heads): the staged rows of a
#: small combine as 16-byte lines (8 bytes of data, each 4 beside the round; the FP8 combine's
#: rows as e4m3 bytes and scale words); a combine whose lines fit (:func:`combine_lines_bytes`)
#: takes that path (docs/PROTOCOL.md, "Combine lines"). 1 MiB: on a third of an H100's SMs,
#: lines of up to 1.4 MB were faster than the plain combine and 1.5 MB or more slower (their
#: staging no longer fits one pass of the grid; docs/PERF.md, "Combine lines").
COMBINE_LINES_BYTES = 1 << 20
#: The FP8 combine's lines take at most this much of them: on a third of an H200's SMs FP8 lines
#: of up to 774 KB were faster than its plain combine and 829 KB or more slower (hidden 2880 at
#: T=128, 7168 at T=64: most likely the pull's items outnumber the grid's warps there;
#: docs/PERF.md, "FP8 lines").
COMBINE_LINES_FP8_BYTES = 768 << 10
#: The most ranks of a job whose rows get a lines tail (a rank mask of one word).
MAX_LINES_EP_SIZE = 64
#: Bytes of a lines tail's heads: a 16-byte head per target rank (MAX_LINES_EP_SIZE at most),
#: padded to a page.
LINE_HEADS_BYTES = 4096
#: Offset in a lines tail's heads page of the dispatch digests: a 16-byte line per source rank
#: (MAX_LINES_EP_SIZE at most), written by source s into every peer's row before its dispatch
#: ready word, each of its two u64 words ``(round << 32) | half of a 64-bit digest of s's payload
#: descriptor``; a target whose own descriptor has the same digest need not read s's descriptor
#: after the wait (docs/PROTOCOL.md, "Dispatch digests"). Past the heads; nothing else uses it.
DISPATCH_DIGESTS_OFFSET = 1024
#: Bytes of a row's lines tail: the heads, then the lines. The daemon's CUDA backend allocates
#: every row this much beyond ``size_per_rank`` and zeroes it with the aux region; the tail
#: starts at ``row_stride - ROW_TAIL_BYTES`` (:func:`lines_tail_offset`).
ROW_TAIL_BYTES = LINE_HEADS_BYTES + COMBINE_LINES_BYTES

# Metainfo indices (names as in FlashInfer's MoeAlltoAll API).
FLAG_VAL_OFFSET_INDEX = 0
LOCAL_TOKEN_COUNTER_OFFSET_INDEX = 1
SEND_COUNTERS_OFFSET_INDEX = 2
RECV_COUNTERS_OFFSET_INDEX = 3
DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX = 4
COMBINE_COMPLETION_FLAGS_OFFSET_INDEX = 5
TOPK_TARGET_RANKS_OFFSET_INDEX = 6
TOPK_SEND_INDICES_OFFSET_INDEX = 7
PAYLOAD_DATA_OFFSET_INDEX = 8
BLOCK_COUNTERS_OFFSET_INDEX = 9
NUM_METAINFO_FIELDS = 10

METAINFO_INDEX = {
    "FLAG_VAL_OFFSET_INDEX": FLAG_VAL_OFFSET_INDEX,
    "LOCAL_TOKEN_COUNTER_OFFSET_INDEX": LOCAL_TOKEN_COUNTER_OFFSET_INDEX,
    "SEND_COUNTERS_OFFSET_INDEX": SEND_COUNTERS_OFFSET_INDEX,
    "RECV_COUNTERS_OFFSET_INDEX": RECV_COUNTERS_OFFSET_INDEX,
    "DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX": DISPATCH_COMPLETION_FLAGS_OFFSET_INDEX,
    "COMBINE_COMPLETION_FLAGS_OFFSET_INDEX": COMBINE_COMPLETION_FLAGS_OFFSET_INDEX,
    "TOPK_TARGET_RANKS_OFFSET_INDEX": TOPK_TARGET_RANKS_OFFSET_INDEX,
    "TOPK_SEND_INDICES_OFFSET_INDEX": TOPK_SEND_INDICES_OFFSET_INDEX,
    "PAYLOAD_DATA_OFFSET_INDEX": PAYLOAD_DATA_OFFSET_INDEX,
    "BLOCK_COUNTERS_OFFSET_INDEX": BLOCK_COUNTERS_OFFSET_INDEX,
}

#: Round number a freshly initialized workspace starts at (never 0, so a zeroed
#: flag can never be mistaken for a completed round).
INITIAL_ROUND = 1


def pad_up(x: int, y: int = ALIGN) -> int:
    return ((x + y - 1) // y) * y


@dataclass(frozen=True)
class AuxLayout:
    """Offsets (bytes from the start of a row) of the aux fields of one job."""

    ep_size: int
    max_num_tokens: int
    flag_val: int
    local_token_counter: int
    send_counters: int
    recv_counters: int
    dispatch_completion_flags: int
    combine_completion_flags: int
    topk_target_ranks: int
    topk_send_indices: int
    block_counters: int
    slot_tokens: int
    combine_slice_flags: int
    #: Number of slice flags per target: ceil(max_num_tokens / COMBINE_SLICE_ROWS).
    combine_slices: int
    #: [ep_size] int32, written by source s: its runtime_max_tokens_per_rank this round.
    recv_rts: int
    #: [ep_size] uint64, written by source s: (high << 32) | round, one release store; high is
    #: rt * (max_num_tokens + 1) + count when max_num_tokens <= 65535, else count.
    dispatch_ready: int
    #: [ep_size, SPEC_WORDS] int32, written by source s: its dispatch's payload descriptor.
    recv_specs: int
    #: [ep_size] uint64, written by target t: (combine spec << 32) | round.
    combine_ready: int
    payload_data: int
    #: Bytes the daemon zeroes (everything before PAYLOAD_DATA).
    aux_bytes: int
    #: Aux size as FlashInfer's MoeAlltoAll counts it: PAYLOAD_DATA plus the alignment slack.
    aux_data_size: int

    def metainfo(self) -> list[int]:
        """Offsets in metainfo-index order (FlashInfer's MoeAlltoAll int64 metainfo tensor)."""
        return [
            self.flag_val,
            self.local_token_counter,
            self.send_counters,
            self.recv_counters,
            self.dispatch_completion_flags,
            self.combine_completion_flags,
            self.topk_target_ranks,
            self.topk_send_indices,
            self.payload_data,
            self.block_counters,
        ]


#: The aux values of a CUDA plan (the ``aux`` list of csrc/bindings.cpp's ``make_plan``), in
#: order: ``(name, C type, what)``. The value of a field is the :class:`AuxLayout` attribute of
#: its name, or, for the names in :data:`AUX_PLAN_CONSTANTS`, this module's constant. The
#: fields with a C type are those of the kernels' ``layout::AuxOffsets`` (csrc/layout.h is
#: generated from this tuple, with an index constant ``AUX_<NAME>`` per value); those without
#: one are constants the binding checks against the build (a build from other sources than
#: this module's is refused).
AUX_PLAN_FIELDS = (
    ("flag_val", "int64_t", "FLAG_VAL: this rank's round"),
    ("local_token_counter", "int64_t", "LOCAL_TOKEN_COUNTER"),
    ("send_counters", "int64_t", "[ep_size] int32: tokens sent to each target"),
    ("recv_counters", "int64_t", "[ep_size] int32, written by source s: tokens s sent here"),
    ("dispatch_completion_flags", "int64_t", "[ep_size] int32, written by source s: its round"),
    ("combine_completion_flags", "int64_t", "[ep_size] int32, written by target t: its round"),
    ("topk_target_ranks", "int64_t", "[max_num_tokens, MAX_TOP_K] int32: target of (t, k)"),
    ("topk_send_indices", "int64_t", "[max_num_tokens, MAX_TOP_K] int32: slot of (t, k) there"),
    ("block_counters", "int64_t", "[BLOCK_COUNTER_SLOTS] int32, slots layout::SLOT_*"),
    ("topk_stride", "int", "row stride (int32 elements) of the [max_num_tokens, MAX_TOP_K] arrays"),
    ("block_counter_slots", None, "BLOCK_COUNTER_SLOTS"),
    ("slot_tokens", "int64_t", "[ep_size, max_num_tokens] int32: token sent to (target, slot)"),
    ("max_num_tokens", "int", "the job's max_num_tokens (row stride of slot_tokens)"),
    ("combine_slice_flags", "int64_t", "[ep_size, combine_slices] u64, written by the targets"),
    ("combine_slices", "int", "ceil(max_num_tokens / COMBINE_SLICE_ROWS)"),
    ("combine_slice_rows", None, "COMBINE_SLICE_ROWS"),
    ("recv_rts", "int64_t", "[ep_size] int32, written by source s: its runtime_max_tokens_per_rank"),
    ("dispatch_ready", "int64_t", "[ep_size] u64, written by source s: (high << 32) | round"),
    ("recv_specs", "int64_t", "[ep_size, SPEC_WORDS] int32, written by source s: its payload descriptor"),
    ("combine_ready", "int64_t", "[ep_size] u64, written by target t: (combine spec << 32) | round"),
    ("lines_tail", "int64_t", "the row's lines tail (ROW_TAIL_BYTES past the row: heads, then lines), 0: none"),
    ("row_tail_bytes", None, "ROW_TAIL_BYTES"),
    ("combine_lines_bytes", None, "COMBINE_LINES_BYTES"),
)
#: The values of :data:`AUX_PLAN_FIELDS` that are this module's constants (name -> constant).
AUX_PLAN_CONSTANTS = {"topk_stride": "MAX_TOP_K", "block_counter_slots": "BLOCK_COUNTER_SLOTS",
                      "combine_slice_rows": "COMBINE_SLICE_ROWS", "row_tail_bytes": "ROW_TAIL_BYTES",
                      "combine_lines_bytes": "COMBINE_LINES_BYTES"}


def aux_plan(aux: AuxLayout, lines_tail: int = 0) -> list[int]:
    """The ``aux`` list of a CUDA plan: :data:`AUX_PLAN_FIELDS`' values for ``aux``, in order.
    ``lines_tail`` is the job's :func:`lines_tail_offset` (0: its rows have no lines tail)."""
    g = globals()
    own = {"lines_tail": int(lines_tail)}
    return [int(g[AUX_PLAN_CONSTANTS[name]]) if name in AUX_PLAN_CONSTANTS
            else own[name] if name in own else int(getattr(aux, name))
            for name, _, _ in AUX_PLAN_FIELDS]


def row_bytes_with_tail(size_per_rank: int) -> int:
    """What a row with a lines tail asks its backend for: ``size_per_rank`` rounded up to a
    page, then ROW_TAIL_BYTES (the backend rounds this up to its granularity)."""
    return pad_up(int(size_per_rank), LINE_HEADS_BYTES) + ROW_TAIL_BYTES


def lines_tail_offset(size_per_rank: int, row_stride: int) -> int:
    """Row offset of the lines tail of a row of ``row_stride`` bytes that was allocated with one
    (:func:`row_bytes_with_tail`): its last ROW_TAIL_BYTES. Raises ValueError when they would
    overlap the first ``size_per_rank`` bytes."""
    tail = int(row_stride) - ROW_TAIL_BYTES
    if tail < pad_up(int(size_per_rank), LINE_HEADS_BYTES) or tail % LINE_HEADS_BYTES:
        raise ValueError(f"a row of {row_stride} bytes has no lines tail past {size_per_rank} bytes")
    return tail


def combine_slices(max_num_tokens: int) -> int:
    """Slice flags per target rank: ``ceil(max_num_tokens / COMBINE_SLICE_ROWS)``."""
    return (max_num_tokens + COMBINE_SLICE_ROWS - 1) // COMBINE_SLICE_ROWS


def aux_layout(ep_size: int, max_num_tokens: int) -> AuxLayout:
    if not 1 <= ep_size <= MAX_EP_SIZE:
        raise ValueError(f"ep_size must be in [1, {MAX_EP_SIZE}], got {ep_size}")
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    off = 0

    def take(nbytes: int) -> int:
        nonlocal off
        start = off
        off = pad_up(off + nbytes)
        return start

    flag_val = take(4)
    local_token_counter = take(4)
    send_counters = take(4 * ep_size)
    recv_counters = take(4 * ep_size)
    dispatch_flags = take(4 * ep_size)
    combine_flags = take(4 * ep_size)
    topk_target = take(4 * max_num_tokens * MAX_TOP_K)
    topk_send = take(4 * max_num_tokens * MAX_TOP_K)
    block_counters = take(4 * BLOCK_COUNTER_SLOTS)
    slot_tokens = take(4 * ep_size * max_num_tokens)
    slices = combine_slices(max_num_tokens)
    slice_flags = take(8 * ep_size * slices)
    recv_rts = take(4 * ep_size)
    dispatch_ready = take(8 * ep_size)
    recv_specs = take(4 * SPEC_WORDS * ep_size)
    combine_ready = take(8 * ep_size)
    payload_data = off
    return AuxLayout(
        ep_size=ep_size,
        max_num_tokens=max_num_tokens,
        flag_val=flag_val,
        local_token_counter=local_token_counter,
        send_counters=send_counters,
        recv_counters=recv_counters,
        dispatch_completion_flags=dispatch_flags,
        combine_completion_flags=combine_flags,
        topk_target_ranks=topk_target,
        topk_send_indices=topk_send,
        block_counters=block_counters,
        slot_tokens=slot_tokens,
        combine_slice_flags=slice_flags,
        combine_slices=slices,
        recv_rts=recv_rts,
        dispatch_ready=dispatch_ready,
        recv_specs=recv_specs,
        combine_ready=combine_ready,
        payload_data=payload_data,
        aux_bytes=payload_data,
        aux_data_size=payload_data + ALIGN_SLACK,
    )


def aux_data_size(ep_size: int, max_num_tokens: int) -> int:
    return aux_layout(ep_size, max_num_tokens).aux_data_size


def workspace_size_per_rank(
    ep_size: int,
    max_num_tokens: int,
    total_dispatch_payload_size_per_token: int,
    combine_payload_size_per_token: int,
    eplb_stats_num_experts: int = 0,
) -> int:
    """FlashInfer's MoeAlltoAll formula: pad128(aux) + pad128(dispatch area) + pad128(combine area), plus
    pad128(the EPLB region) when the job gathers ``eplb_stats_num_experts`` statistics."""
    if total_dispatch_payload_size_per_token < 0 or combine_payload_size_per_token < 0:
        raise ValueError("payload sizes per token must be >= 0")
    if eplb_stats_num_experts < 0:
        raise ValueError(f"eplb_stats_num_experts must be >= 0, got {eplb_stats_num_experts}")
    return (
        pad_up(aux_data_size(ep_size, max_num_tokens))
        + pad_up(4 * ep_size * eplb_stats_num_experts)
        + pad_up(ep_size * max_num_tokens * total_dispatch_payload_size_per_token)
        + pad_up(ep_size * max_num_tokens * combine_payload_size_per_token)
    )


def moe_workspace_size_per_rank(
    ep_size: int, top_k: int, max_num_tokens: int, hidden_size: int, extra_payload_bytes_per_token: int = 0,
    eplb_stats_num_experts: int = 0,
) -> int:
    """Size for bf16 hidden states + int32 expert ids + fp32 scales (+ extra), bf16 combine."""
    dispatch = 2 * hidden_size + 4 * top_k + 4 * top_k + extra_payload_bytes_per_token
    combine = 2 * hidden_size
    return workspace_size_per_rank(ep_size, max_num_tokens, dispatch, combine, eplb_stats_num_experts)


# ---------------------------------------------------------------------------
# What every rank must agree on: payload descriptors
# ---------------------------------------------------------------------------
#: 4-bit codes of payload dtypes in a descriptor (0: not given). Keyed by torch's name.
DTYPE_CODES = {
    "uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float16": 6, "bfloat16": 7, "float32": 8,
    "float64": 9, "float8_e4m3fn": 10, "float8_e5m2": 11, "bool": 12, "uint16": 13, "uint32": 14, "uint64": 15,
}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def dtype_code(dtype) -> int:
    """The descriptor code of ``dtype`` (a torch dtype, its name, or already a code)."""
    if isinstance(dtype, int):
        if not 0 <= dtype <= 15:
            raise ValueError(f"dtype code must be in [0, 15], got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    code = DTYPE_CODES.get(name)
    if code is None:
        # other dtypes of one width share a code per width (the width is compared anyway)
        return 0
    return code


def payload_spec(dispatch_bytes_per_token, dtypes=None, eplb_stats_num_experts: int = 0) -> tuple[int, ...]:
    """The SPEC_WORDS int32 words every rank publishes with its dispatch: what its peers
    compare with their own before the round's data is used (a mismatch is an InputError
    on every rank, naming the field and both values)."""
    n = len(dispatch_bytes_per_token)
    if n > MAX_PAYLOADS:
        raise LayoutError(f"at most {MAX_PAYLOADS} payloads, got {n}")
    words = [0] * SPEC_WORDS
    words[0] = n
    for i, b in enumerate(dispatch_bytes_per_token):
        words[1 + i] = int(b)
    if dtypes is not None:
        if len(dtypes) != n:
            raise LayoutError(f"{len(dtypes)} dtypes for {n} payloads")
        packed = 0
        for i, d in enumerate(dtypes):
            packed |= dtype_code(d) << (4 * i)
        words[7] = packed
    words[8] = int(eplb_stats_num_experts)
    return tuple(words)


_M64 = (1 << 64) - 1


def spec_digest(words) -> int:
    """The 64-bit digest of a payload descriptor (:func:`payload_spec`'s SPEC_WORDS words) that
    the CUDA dispatch carries in its digest lines (DISPATCH_DIGESTS_OFFSET): each word, as 32
    bits, is added into the state and mixed by the murmur3 64-bit finalizer (a bijection), so
    descriptors that differ in any word share a digest only by chance (2^-64). The kernels
    compute it as csrc/primitives.cuh ``spec_digest`` does; this is the same function."""
    words = tuple(words)
    if len(words) != SPEC_WORDS:
        raise LayoutError(f"a payload descriptor has {SPEC_WORDS} words, got {len(words)}")
    h = 0x243F6A8885A308D3 ^ SPEC_WORDS
    for w, v in enumerate(words):
        h ^= ((int(v) & 0xFFFFFFFF) + 0x9E3779B97F4A7C15 * (w + 1)) & _M64
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & _M64
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & _M64
        h ^= h >> 33
    return h


#: Combine descriptor bits: hidden (elements) in the low 26, the payload dtype code, and for
#: the FP8 combine (low precision) its flag and whether the payload was in the workspace.
COMBINE_SPEC_HIDDEN_BITS = 26
#: The descriptor a degrade combine publishes with its flag to a source of its round that its
#: dispatch let go of (it left the mask before its tokens came): what was staged for it was
#: not computed from its tokens, so it counts nothing from this rank (hidden 0: no combine
#: publishes it otherwise). docs/PROTOCOL.md, "A round in a degrade job".
COMBINE_SPEC_VOID = 0


def combine_spec(hidden: int, dtype, low_precision: bool = False, payload_in_workspace: bool = False) -> int:
    """The u32 every rank's combine publishes with its flag (COMBINE_READY's high half)."""
    if not 1 <= hidden < 1 << COMBINE_SPEC_HIDDEN_BITS:
        raise LayoutError(f"hidden must be in [1, 2^{COMBINE_SPEC_HIDDEN_BITS}), got {hidden}")
    spec = hidden | (dtype_code(dtype) << COMBINE_SPEC_HIDDEN_BITS)
    if low_precision:
        spec |= 1 << 30
        if payload_in_workspace:
            spec |= 1 << 31
    return spec


def describe_combine_spec(spec: int) -> dict:
    spec &= 0xFFFFFFFF
    return {
        "hidden": spec & ((1 << COMBINE_SPEC_HIDDEN_BITS) - 1),
        "dtype": DTYPE_NAMES.get(spec >> COMBINE_SPEC_HIDDEN_BITS & 15, "?"),
        "low_precision": bool(spec >> 30 & 1),
        "payload_in_workspace (low precision)": bool(spec >> 31 & 1),
    }


def spec_field_name(field: int) -> str:
    if field == SPEC_FIELD_COUNT:
        return "the number of payloads"
    if SPEC_FIELD_WIDTH <= field < SPEC_FIELD_WIDTH + MAX_PAYLOADS:
        return f"input_payloads[{field - SPEC_FIELD_WIDTH}] bytes per token"
    if SPEC_FIELD_DTYPE <= field < SPEC_FIELD_DTYPE + MAX_PAYLOADS:
        return f"input_payloads[{field - SPEC_FIELD_DTYPE}] dtype"
    if field == SPEC_FIELD_EPLB:
        return "eplb_stats_num_experts"
    if field == SPEC_FIELD_COMBINE:
        return "the combine payload"
    return f"field {field}"


def spec_mismatch(mine, theirs) -> tuple[int, int, int] | None:
    """(field, my value, their value) of the first difference of two payload descriptors."""
    for w in range(SPEC_WORDS):
        a, b = int(mine[w]), int(theirs[w])
        if a == b:
            continue
        if w == 0:
            return SPEC_FIELD_COUNT, a, b
        if 1 <= w <= MAX_PAYLOADS:
            return SPEC_FIELD_WIDTH + w - 1, a, b
        if w == 7:
            for i in range(MAX_PAYLOADS):
                da, db = a >> (4 * i) & 15, b >> (4 * i) & 15
                if da != db:
                    return SPEC_FIELD_DTYPE + i, da, db
        if w == 8:
            return SPEC_FIELD_EPLB, a, b
        return SPEC_FIELD_COUNT, a, b
    return None


def spec_value_text(field: int, value: int) -> str:
    if SPEC_FIELD_DTYPE <= field < SPEC_FIELD_DTYPE + MAX_PAYLOADS:
        return DTYPE_NAMES.get(value, "not given") if value else "not given"
    if field == SPEC_FIELD_COMBINE:
        d = describe_combine_spec(value)
        return (f"hidden={d['hidden']} dtype={d['dtype']} low_precision={d['low_precision']}"
                + (" payload_in_workspace" if d["payload_in_workspace (low precision)"] else ""))
    return str(value)


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one FP8 combine row: hidden e4m3 bytes, then hidden / FP8_BLOCK E8M0 scale
    bytes, padded to 16."""
    return (hidden + hidden // FP8_BLOCK + 15) // 16 * 16


def combine_lines_bytes(ep_size: int, rt: int, hidden: int, elem_size: int, low_precision: bool = False) -> int:
    """Bytes of a combine round's lines (docs/PROTOCOL.md, "Combine lines"): every slot of every
    other rank's rows, a 16-byte line per 8 bytes of a row (``hidden * elem_size`` bytes); FP8
    (``low_precision``): a line per 8 e4m3 bytes, and an 8-byte scale word per FP8_BLOCK
    elements. The round takes the lines when this is at most COMBINE_LINES_BYTES (FP8:
    COMBINE_LINES_FP8_BYTES) and its job's rows have a lines tail."""
    rows = (ep_size - 1) * rt
    if low_precision:
        return rows * (16 * (hidden // 8) + 8 * (hidden // FP8_BLOCK))
    return rows * 2 * hidden * elem_size


@dataclass(frozen=True)
class PayloadLayout:
    """Where one call's payloads live in every row (row-relative offsets)."""

    runtime_max_tokens_per_rank: int
    #: Start of each dispatch payload region ``[ep_size, runtime_max, bytes_i]``.
    dispatch_offsets: tuple[int, ...]
    dispatch_bytes_per_token: tuple[int, ...]
    #: Start of the combine region ``[ep_size, runtime_max, combine_bytes]`` (at the end of
    #: the row; ``size_per_rank`` when no combine width was given).
    combine_offset: int
    #: First byte after the dispatch regions.
    dispatch_end: int
    #: The EPLB statistics region ``[ep_size, eplb_stats_num_experts]`` int32 (at the start of
    #: the payload area; 0 experts: none).
    eplb_offset: int = 0
    eplb_stats_num_experts: int = 0
    #: The descriptor the ranks compare (:func:`payload_spec`).
    spec: tuple[int, ...] = ()
    #: The row's size (for the FP8 combine region).
    size_per_rank: int = 0


class LayoutError(ValueError):
    """The requested payloads do not fit the workspace."""


def payload_layout(
    aux: AuxLayout,
    size_per_rank: int,
    runtime_max_tokens_per_rank: int,
    dispatch_bytes_per_token: list[int] | tuple[int, ...],
    combine_bytes_per_token: int = 0,
    *,
    dtypes=None,
    eplb_stats_num_experts: int = 0,
) -> PayloadLayout:
    """Offsets of one call's dispatch payload regions and combine region.

    Raises :class:`LayoutError` naming what does not fit. ``combine_bytes_per_token``
    of 0 checks only the dispatch regions (the combine width is known at combine time).
    ``dtypes`` (torch dtypes or codes, one per payload) and ``eplb_stats_num_experts`` go
    into the descriptor the ranks compare; the latter also reserves the EPLB region.
    """
    rt = runtime_max_tokens_per_rank
    if not 1 <= rt <= aux.max_num_tokens:
        raise LayoutError(
            f"runtime_max_tokens_per_rank must be in [1, max_num_tokens={aux.max_num_tokens}], got {rt}"
        )
    if len(dispatch_bytes_per_token) > MAX_PAYLOADS:
        raise LayoutError(f"at most {MAX_PAYLOADS} payloads, got {len(dispatch_bytes_per_token)}")
    if eplb_stats_num_experts < 0:
        raise LayoutError(f"eplb_stats_num_experts must be >= 0, got {eplb_stats_num_experts}")
    offsets = []
    off = aux.payload_data
    eplb_offset = off
    off = pad_up(off + 4 * aux.ep_size * eplb_stats_num_experts)
    for i, nbytes in enumerate(dispatch_bytes_per_token):
        if nbytes <= 0:
            raise LayoutError(f"payload {i} has {nbytes} bytes per token; must be > 0")
        offsets.append(off)
        off = pad_up(off + aux.ep_size * rt * nbytes)
    dispatch_end = off
    if dispatch_end > size_per_rank:
        raise LayoutError(
            f"payloads of {sum(dispatch_bytes_per_token)} bytes per token need {dispatch_end} bytes "
            f"per rank at runtime_max_tokens_per_rank={rt}, the workspace has {size_per_rank}"
        )
    combine_bytes = aux.ep_size * rt * combine_bytes_per_token
    combine_offset = (size_per_rank - combine_bytes) // ALIGN * ALIGN
    if combine_offset < dispatch_end:
        raise LayoutError(
            f"combine payload of {combine_bytes_per_token} bytes per token needs {dispatch_end + combine_bytes} bytes "
            f"per rank at runtime_max_tokens_per_rank={rt}, the workspace has {size_per_rank}"
        )
    return PayloadLayout(
        runtime_max_tokens_per_rank=rt,
        dispatch_offsets=tuple(offsets),
        dispatch_bytes_per_token=tuple(int(b) for b in dispatch_bytes_per_token),
        combine_offset=combine_offset,
        dispatch_end=dispatch_end,
        eplb_offset=eplb_offset,
        eplb_stats_num_experts=int(eplb_stats_num_experts),
        spec=payload_spec(dispatch_bytes_per_token, dtypes, eplb_stats_num_experts),
        size_per_rank=int(size_per_rank),
    )


def fp8_combine_offset(pl: PayloadLayout, ep_size: int, hidden: int, payload_in_workspace: bool) -> int:
    """Start of the FP8 combine region ``[ep_size, rt, fp8_row_bytes(hidden)]``: at the end of
    the row, or, when the bf16 payload already is the combine region (payload_in_workspace),
    right below it. Raises LayoutError when it does not fit above the dispatch regions."""
    nbytes = ep_size * pl.runtime_max_tokens_per_rank * fp8_row_bytes(hidden)
    top = pl.combine_offset if payload_in_workspace else pl.size_per_rank
    off = (top - nbytes) // ALIGN * ALIGN
    if off < pl.dispatch_end:
        raise LayoutError(
            f"the low-precision combine region of {nbytes} bytes does not fit between the dispatch regions (end "
            f"{pl.dispatch_end}) and {'the combine payload' if payload_in_workspace else 'the end of the row'} "
            f"({top}); make the workspace larger"
        )
    return off


def expert_partition(num_experts: int, ep_size: int) -> tuple[int, int]:
    """``(base, rem)``: ranks ``[0, rem)`` own ``base + 1`` experts, the others ``base``."""
    if num_experts < ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be >= ep_size ({ep_size})")
    return num_experts // ep_size, num_experts % ep_size


def expert_owner(expert: int, num_experts: int, ep_size: int) -> int:
    """The rank that owns ``expert`` under the contiguous partition."""
    base, rem = expert_partition(num_experts, ep_size)
    split = rem * (base + 1)
    if expert < split:
        return expert // (base + 1)
    return rem + (expert - split) // base


def experts_of_rank(rank: int, num_experts: int, ep_size: int) -> range:
    base, rem = expert_partition(num_experts, ep_size)
    start = rank * base + min(rank, rem)
    return range(start, start + base + (1 if rank < rem else 0))


# ---------------------------------------------------------------------------
# Control block
# ---------------------------------------------------------------------------
CONTROL_BLOCK_SIZE = 16384
CONTROL_MAGIC = 0xA2AD0C71
#: 1: ep_size <= 64 (one mask word, 4096 bytes); 2: ep_size <= 256 (MASK_WORDS mask words).
CONTROL_VERSION = 2
CB_MAGIC = 0
CB_VERSION = 4
CB_GENERATION = 8
#: Largest generation a job takes: a re-arm adds one, and the word is a u64.
MAX_GENERATION = 2**63 - 1
CB_ABORT = 16
CB_ABORT_RANK = 20
CB_EP_SIZE = 24
CB_POLICY = 28
#: [MASK_WORDS] u64.
CB_ACTIVE_MASK = 32
CB_MASK_GENERATION = CB_ACTIVE_MASK + 8 * MASK_WORDS
CB_DEGRADED_SINCE_NS = CB_MASK_GENERATION + 8
CB_RANK_STATE = 128
CB_STATUS = CB_RANK_STATE + 4 * MAX_EP_SIZE
STATUS_RECORD_SIZE = 32
STATUS_CODE = 0
STATUS_PEER = 4
STATUS_ROUND = 8
STATUS_PHASE = 12
STATUS_WAITED_NS = 16
CB_INPUT = CB_STATUS + MAX_EP_SIZE * STATUS_RECORD_SIZE
INPUT_RECORD_SIZE = 16
INPUT_CODE = 0
INPUT_INDEX = 4
INPUT_VALUE = 8
INPUT_ROUND = 12
CB_ADMIT_ROUND = CB_INPUT + MAX_EP_SIZE * INPUT_RECORD_SIZE
#: Per rank, its own value of the field a spec mismatch names (i32).
CB_INPUT_OWN = CB_ADMIT_ROUND + 4 * MAX_EP_SIZE

# What a job does when a rank dies or leaves while it runs (the job spec's on_peer_loss).
#: Abort the job: every rank raises PeerLost and recovers with a replacement (the default).
POLICY_RAISE = 0
#: Keep serving without the rank: its mask bit is cleared, its experts' tokens are dropped.
POLICY_DEGRADE = 1
POLICY_NAMES = {POLICY_RAISE: "raise", POLICY_DEGRADE: "degrade"}
POLICY_CODES = {name: code for code, name in POLICY_NAMES.items()}

# Admit-round values that are not rounds (a rank with one of them takes part in no round).
#: The daemon re-initialized a replacement's row; the replacement has not dispatched yet.
ADMIT_JOINED = -1
#: The replacement's first dispatch asks to be let in; the lowest active rank picks its round.
ADMIT_READY = -2
#: In a control block: the rank's admit round is in its own row (SLOT_ADMIT_ROUND of its
#: BLOCK_COUNTERS), which holds ADMIT_JOINED, ADMIT_READY or a round as above. Every node
#: of a job that spans nodes writes this for a replacement let in without a job-wide re-arm,
#: so that all of them agree on its round. Read without the rows (the daemon), it is no
#: round: the rank counts as not admitted.
ADMIT_ROW = -3

# Input errors a rank's kernels found (the input record's code).
INPUT_OK = 0
#: token_selected_experts held an id outside [0, num_experts): that (token, k) went nowhere.
INPUT_BAD_EXPERT = 1
#: A peer passed another runtime_max_tokens_per_rank in the same round: the round completed
#: without data (combine returned zeros) on every rank.
INPUT_RT_MISMATCH = 2
#: A peer's dispatch published another payload descriptor (count, widths, dtypes, EPLB
#: experts): the round moved no data (combine returned zeros) on every rank.
INPUT_SPEC_MISMATCH = 3
#: A peer's combine published another combine descriptor (hidden, dtype, low precision):
#: nothing was pulled from it (its contributions are zeros) on every rank.
INPUT_COMBINE_MISMATCH = 4

# Abort reasons (the abort word).
ABORT_NONE = 0
ABORT_PEER_LOST = 1
ABORT_OPERATOR = 2
ABORT_DESTROYED = 3
#: A rank asked for a job-wide re-arm (after a timeout): every rank must call recover.
ABORT_REARM = 4
#: A live rank of a running job left it cleanly (close/leave); ABORT_PEER_LOST is for deaths.
ABORT_PEER_LEFT = 5
#: Set by a rank itself once it found that no daemon and no fd store holds its job any more
#: (the control block's holder lock is free: see a2ad/control.py, "Holder and rank locks").
ABORT_ORPHANED = 6
ABORT_NAMES = {
    ABORT_NONE: "none",
    ABORT_PEER_LOST: "peer lost",
    ABORT_OPERATOR: "aborted by operator",
    ABORT_DESTROYED: "job destroyed",
    ABORT_REARM: "re-arm requested",
    ABORT_PEER_LEFT: "peer left",
    ABORT_ORPHANED: "no holder",
}

# Rank states.
RANK_EMPTY = 0
RANK_JOINING = 1
RANK_ATTACHED = 2
RANK_LEFT = 3
RANK_DEAD = 4
RANK_STATE_NAMES = {
    RANK_EMPTY: "empty",
    RANK_JOINING: "joining",
    RANK_ATTACHED: "attached",
    RANK_LEFT: "left",
    RANK_DEAD: "dead",
}

# Status codes of a rank's last failed wait.
STATUS_OK = 0
STATUS_TIMEOUT = 1
STATUS_ABORTED = 2
#: Degraded mode: the round's view did not hold this rank (the daemon counted it as gone).
STATUS_NOT_ACTIVE = 3
#: Degraded mode: a rank whose outputs this rank's combine pulled went on to its next round
#: without this rank (its node counted this rank lost): that combine's output is void.
STATUS_LEFT_BEHIND = 4

# Phases a wait can be in.
PHASE_DISPATCH = 1
PHASE_COMBINE = 2
PHASE_NAMES = {PHASE_DISPATCH: "dispatch", PHASE_COMBINE: "combine"}

assert MASK_WORDS * 64 == MAX_EP_SIZE
assert CB_INPUT_OWN + 4 * MAX_EP_SIZE <= CONTROL_BLOCK_SIZE
assert CB_RANK_STATE + 4 * MAX_EP_SIZE <= CB_STATUS
assert CB_DEGRADED_SINCE_NS + 8 <= CB_RANK_STATE
assert CONTROL_BLOCK_SIZE % 4096 == 0


def status_offset(rank: int) -> int:
    return CB_STATUS + rank * STATUS_RECORD_SIZE


def input_offset(rank: int) -> int:
    return CB_INPUT + rank * INPUT_RECORD_SIZE


def input_own_offset(rank: int) -> int:
    return CB_INPUT_OWN + 4 * rank


def admit_offset(rank: int) -> int:
    return CB_ADMIT_ROUND + 4 * rank


def full_mask(ep_size: int) -> int:
    """The active mask of a job whose ranks are all active."""
    return (1 << ep_size) - 1


def effective_mask(active_mask: int, admit_rounds, round: int, row_rounds=None) -> int:
    """The ranks that take part in round ``round``: those whose bit is set in ``active_mask``
    and whose admit round (``admit_rounds[q]``; where that is ADMIT_ROW, ``row_rounds[q]``,
    the rank's row's own word, or no round without ``row_rounds``) is in ``[0, round]``."""
    out = 0
    m = active_mask
    while m:
        q = (m & -m).bit_length() - 1
        m &= m - 1
        a = admit_rounds[q]
        if a == ADMIT_ROW and row_rounds is not None:
            a = int(row_rounds[q])
        if 0 <= a <= round:
            out |= 1 << q
    return out


def mask_ranks(mask: int) -> list[int]:
    """The ranks whose bits are set in ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


MASK_BYTES = 8 * MASK_WORDS


def _check_mask(mask) -> int:
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise TypeError(f"a rank mask must be an int, got {type(mask).__name__}")
    if mask < 0:
        raise ValueError(f"a rank mask must be >= 0, got {mask}")
    if mask >> MAX_EP_SIZE:
        raise ValueError(
            f"rank mask {mask:#x} has bits above rank {MAX_EP_SIZE - 1} (MAX_EP_SIZE={MAX_EP_SIZE})"
        )
    return mask


def mask_words(mask: int, n: int = MASK_WORDS) -> list[int]:
    """``mask`` as ``n`` u64 words, least significant first (rank q: bit q & 63 of word q >> 6).
    Raises ValueError when it has a bit above the ``n`` words."""
    _check_mask(mask)
    if mask >> (64 * n):
        raise ValueError(f"rank mask {mask:#x} does not fit {n} u64 word(s) (ranks 0-{64 * n - 1})")
    return [(mask >> (64 * i)) & 0xFFFFFFFFFFFFFFFF for i in range(n)]


def mask_from_words(words) -> int:
    """The inverse of :func:`mask_words`: u64 (or two's complement int64) words, least
    significant first."""
    out = 0
    for i, w in enumerate(words):
        out |= (int(w) & 0xFFFFFFFFFFFFFFFF) << (64 * i)
    return out


def mask_to_bytes(mask: int) -> bytes:
    """``mask`` as MASK_BYTES (MASK_WORDS u64 words) little-endian bytes: how a mask crosses a
    socket (msgpack carries at most 64-bit ints)."""
    return _check_mask(mask).to_bytes(MASK_BYTES, "little")


def mask_from_bytes(data) -> int:
    """The mask that :func:`mask_to_bytes` wrote. Accepts 8 to MASK_BYTES bytes, a whole
    number of u64 words (a shorter mask leaves the high words zero)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"a rank mask in bytes must be bytes, got {type(data).__name__}")
    n = len(data)
    if n == 0 or n % 8 or n > MASK_BYTES:
        raise ValueError(f"a rank mask in bytes must be 8 to {MASK_BYTES} bytes in whole u64 words, got {n}")
    return int.from_bytes(bytes(data), "little")


def format_ranks(mask: int) -> str:
    """The ranks of ``mask`` as a list of ascending ranges, e.g. ``0-63,65,70-255``; ``none``
    for an empty mask."""
    if mask < 0:
        raise ValueError(f"a rank mask must be >= 0, got {mask}")
    parts = []
    q = 0
    while mask >> q:
        if not mask >> q & 1:
            # skip the run of zeros: the lowest set bit at or above q
            rest = mask >> q
            q += (rest & -rest).bit_length() - 1
            continue
        start = q
        rest = ~(mask >> q)  # lowest zero bit at or above q
        q += (rest & -rest).bit_length() - 1
        parts.append(str(start) if q - 1 == start else f"{start}-{q - 1}")
    return ",".join(parts) if parts else "none"


def parse_ranks(text: str) -> int:
    """The mask of a rank list written by :func:`format_ranks` (``0-63,65``; ``none`` or an
    empty string: no rank). Raises ValueError naming the bad part."""
    text = text.strip()
    if text in ("", "none"):
        return 0
    mask = 0
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"bad rank range {part!r} in {text!r}: expected N or N-M") from None
        if not 0 <= a <= b < MAX_EP_SIZE:
            raise ValueError(f"bad rank range {part!r} in {text!r}: ranks must be in [0, {MAX_EP_SIZE - 1}], low first")
        mask |= ((1 << (b - a + 1)) - 1) << a
    return mask


# ---------------------------------------------------------------------------
# The constants the CUDA sources share, as a C++ header
# ---------------------------------------------------------------------------
#: Every constant csrc/ takes from this module (csrc/layout.h is generated from it).
C_HEADER_CONSTANTS = (
    "MAX_TOP_K",
    "MAX_EP_SIZE",
    "MASK_WORDS",
    "MAX_PAYLOADS",
    "BLOCK_COUNTER_SLOTS",
    "COMBINE_SLICE_ROWS",
    "COMBINE_LINES_BYTES",
    "COMBINE_LINES_FP8_BYTES",
    "LINE_HEADS_BYTES",
    "DISPATCH_DIGESTS_OFFSET",
    "ROW_TAIL_BYTES",
    "INITIAL_ROUND",
    "SLOT_DISPATCH_ARRIVAL",
    "SLOT_COMBINE_ARRIVAL",
    "SLOT_DISPATCH_GIVE_UP",
    "SLOT_COMBINE_GIVE_UP",
    "SLOT_PULL_WORK",
    "SLOT_BAD_EXPERT",
    "SLOT_RT_MISMATCH",
    "SLOT_VIEW",
    "SLOT_VIEW_ROUND",
    "SLOT_COMBINE_SEEN",
    "SLOT_COMBINE_SEEN_ROUND",
    "SLOT_ADMIT_ROUND",
    "SLOT_STATUS_CLAIM",
    "CB_ABORT",
    "CB_STATUS",
    "STATUS_RECORD_SIZE",
    "STATUS_CODE",
    "STATUS_PEER",
    "STATUS_ROUND",
    "STATUS_PHASE",
    "STATUS_WAITED_NS",
    "STATUS_TIMEOUT",
    "STATUS_ABORTED",
    "STATUS_NOT_ACTIVE",
    "STATUS_LEFT_BEHIND",
    "PHASE_DISPATCH",
    "PHASE_COMBINE",
    "CB_INPUT",
    "INPUT_RECORD_SIZE",
    "INPUT_CODE",
    "INPUT_INDEX",
    "INPUT_VALUE",
    "INPUT_ROUND",
    "INPUT_OK",
    "INPUT_BAD_EXPERT",
    "INPUT_RT_MISMATCH",
    "INPUT_SPEC_MISMATCH",
    "INPUT_COMBINE_MISMATCH",
    "CB_INPUT_OWN",
    "SPEC_WORDS",
    "SPEC_FIELD_COUNT",
    "SPEC_FIELD_WIDTH",
    "SPEC_FIELD_DTYPE",
    "SPEC_FIELD_EPLB",
    "SPEC_FIELD_COMBINE",
    "FP8_BLOCK",
    "CB_POLICY",
    "POLICY_RAISE",
    "POLICY_DEGRADE",
    "CB_ACTIVE_MASK",
    "CB_MASK_GENERATION",
    "CONTROL_BLOCK_SIZE",
    "CB_ADMIT_ROUND",
    "ADMIT_JOINED",
    "ADMIT_READY",
    "ADMIT_ROW",
)

C_HEADER_PATH = "csrc/layout.h"


def _c_aux_plan() -> list[str]:
    """The aux plan's part of csrc/layout.h: an index per value, the struct and its filler."""
    lines = ["", "// The aux list of a CUDA plan (AUX_PLAN_FIELDS): the index of each value."]
    lines += [f"constexpr int AUX_{name.upper()} = {i};" for i, (name, _, _) in enumerate(AUX_PLAN_FIELDS)]
    lines += [f"constexpr int AUX_PLAN_FIELD_COUNT = {len(AUX_PLAN_FIELDS)};",
              "inline constexpr const char* AUX_PLAN_FIELD_NAMES[] = {",
              *[f'    "{name}",' for name, _, _ in AUX_PLAN_FIELDS],
              "};",
              "",
              "// The aux fields as the kernels see them: row-relative byte offsets and the sizes they",
              "// need (the values of the aux list that are not constants).",
              "struct AuxOffsets {"]
    lines += [f"  {ctype} {name};  // {what}" for name, ctype, what in AUX_PLAN_FIELDS if ctype]
    lines += ["};",
              "",
              "// The struct from an aux list (anything indexable by AUX_*, checked by the caller).",
              "template <typename List>",
              "inline AuxOffsets aux_offsets_from(const List& v) {",
              "  AuxOffsets a;"]
    lines += [f"  a.{name} = static_cast<{ctype}>(v[AUX_{name.upper()}]);" for name, ctype, _ in AUX_PLAN_FIELDS
              if ctype]
    lines += ["  return a;", "}"]
    return lines


def c_header() -> str:
    """The text of csrc/layout.h: :data:`C_HEADER_CONSTANTS` as ``constexpr`` values and the
    aux plan (:data:`AUX_PLAN_FIELDS`) as index constants and a struct."""
    g = globals()
    lines = [
        "// Generated from a2ad/layout.py by `python -m a2ad.layout > csrc/layout.h`; do not edit.",
        "// The constants the kernels share with Python (tests/test_layout.py checks this file is current).",
        "#pragma once",
        "",
        "#include <stdint.h>",
        "",
        "namespace a2ad {",
        "namespace layout {",
        "",
    ]
    lines += [f"constexpr int {name} = {int(g[name])};" for name in C_HEADER_CONSTANTS]
    lines += _c_aux_plan()
    lines += ["", "}  // namespace layout", "}  // namespace a2ad", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.stdout.write(c_header())
