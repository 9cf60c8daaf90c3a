// Generated from a2ad/layout.py by `python -m a2ad.layout > csrc/layout.h`; do not edit.
// The constants the kernels share with Python (tests/test_layout.py checks this file is current).
#pragma once

#include <stdint.h>

namespace a2ad {
namespace layout {

constexpr int MAX_TOP_K = 22;
constexpr int MAX_EP_SIZE = 256;
constexpr int MASK_WORDS = 4;
constexpr int MAX_PAYLOADS = 6;
constexpr int BLOCK_COUNTER_SLOTS = 32;
constexpr int COMBINE_SLICE_ROWS = 8;
constexpr int COMBINE_LINES_BYTES = 1048576;
constexpr int COMBINE_LINES_FP8_BYTES = 786432;
constexpr int LINE_HEADS_BYTES = 4096;
constexpr int DISPATCH_DIGESTS_OFFSET = 1024;
constexpr int ROW_TAIL_BYTES = 1052672;
constexpr int INITIAL_ROUND = 1;
constexpr int SLOT_DISPATCH_ARRIVAL = 0;
constexpr int SLOT_COMBINE_ARRIVAL = 1;
constexpr int SLOT_DISPATCH_GIVE_UP = 2;
constexpr int SLOT_COMBINE_GIVE_UP = 3;
constexpr int SLOT_PULL_WORK = 4;
constexpr int SLOT_BAD_EXPERT = 6;
constexpr int SLOT_RT_MISMATCH = 8;
constexpr int SLOT_VIEW = 10;
constexpr int SLOT_VIEW_ROUND = 18;
constexpr int SLOT_COMBINE_SEEN = 20;
constexpr int SLOT_COMBINE_SEEN_ROUND = 28;
constexpr int SLOT_ADMIT_ROUND = 30;
constexpr int SLOT_STATUS_CLAIM = 31;
constexpr int CB_ABORT = 16;
constexpr int CB_STATUS = 1152;
constexpr int STATUS_RECORD_SIZE = 32;
constexpr int STATUS_CODE = 0;
constexpr int STATUS_PEER = 4;
constexpr int STATUS_ROUND = 8;
constexpr int STATUS_PHASE = 12;
constexpr int STATUS_WAITED_NS = 16;
constexpr int STATUS_TIMEOUT = 1;
constexpr int STATUS_ABORTED = 2;
constexpr int STATUS_NOT_ACTIVE = 3;
constexpr int STATUS_LEFT_BEHIND = 4;
constexpr int PHASE_DISPATCH = 1;
constexpr int PHASE_COMBINE = 2;
constexpr int CB_INPUT = 9344;
constexpr int INPUT_RECORD_SIZE = 16;
constexpr int INPUT_CODE = 0;
constexpr int INPUT_INDEX = 4;
constexpr int INPUT_VALUE = 8;
constexpr int INPUT_ROUND = 12;
constexpr int INPUT_OK = 0;
constexpr int INPUT_BAD_EXPERT = 1;
constexpr int INPUT_RT_MISMATCH = 2;
constexpr int INPUT_SPEC_MISMATCH = 3;
constexpr int INPUT_COMBINE_MISMATCH = 4;
constexpr int CB_INPUT_OWN = 14464;
constexpr int SPEC_WORDS = 12;
constexpr int SPEC_FIELD_COUNT = 0;
constexpr int SPEC_FIELD_WIDTH = 1;
constexpr int SPEC_FIELD_DTYPE = 7;
constexpr int SPEC_FIELD_EPLB = 13;
constexpr int SPEC_FIELD_COMBINE = 14;
constexpr int FP8_BLOCK = 32;
constexpr int CB_POLICY = 28;
constexpr int POLICY_RAISE = 0;
constexpr int POLICY_DEGRADE = 1;
constexpr int CB_ACTIVE_MASK = 32;
constexpr int CB_MASK_GENERATION = 64;
constexpr int CONTROL_BLOCK_SIZE = 16384;
constexpr int CB_ADMIT_ROUND = 13440;
constexpr int ADMIT_JOINED = -1;
constexpr int ADMIT_READY = -2;
constexpr int ADMIT_ROW = -3;

// The aux list of a CUDA plan (AUX_PLAN_FIELDS): the index of each value.
constexpr int AUX_FLAG_VAL = 0;
constexpr int AUX_LOCAL_TOKEN_COUNTER = 1;
constexpr int AUX_SEND_COUNTERS = 2;
constexpr int AUX_RECV_COUNTERS = 3;
constexpr int AUX_DISPATCH_COMPLETION_FLAGS = 4;
constexpr int AUX_COMBINE_COMPLETION_FLAGS = 5;
constexpr int AUX_TOPK_TARGET_RANKS = 6;
constexpr int AUX_TOPK_SEND_INDICES = 7;
constexpr int AUX_BLOCK_COUNTERS = 8;
constexpr int AUX_TOPK_STRIDE = 9;
constexpr int AUX_BLOCK_COUNTER_SLOTS = 10;
constexpr int AUX_SLOT_TOKENS = 11;
constexpr int AUX_MAX_NUM_TOKENS = 12;
constexpr int AUX_COMBINE_SLICE_FLAGS = 13;
constexpr int AUX_COMBINE_SLICES = 14;
constexpr int AUX_COMBINE_SLICE_ROWS = 15;
constexpr int AUX_RECV_RTS = 16;
constexpr int AUX_DISPATCH_READY = 17;
constexpr int AUX_RECV_SPECS = 18;
constexpr int AUX_COMBINE_READY = 19;
constexpr int AUX_LINES_TAIL = 20;
constexpr int AUX_ROW_TAIL_BYTES = 21;
constexpr int AUX_COMBINE_LINES_BYTES = 22;
constexpr int AUX_PLAN_FIELD_COUNT = 23;
inline constexpr const char* AUX_PLAN_FIELD_NAMES[] = {
    "flag_val",
    "local_token_counter",
    "send_counters",
    "recv_counters",
    "dispatch_completion_flags",
    "combine_completion_flags",
    "topk_target_ranks",
    "topk_send_indices",
    "block_counters",
    "topk_stride",
    "block_counter_slots",
    "slot_tokens",
    "max_num_tokens",
    "combine_slice_flags",
    "combine_slices",
    "combine_slice_rows",
    "recv_rts",
    "dispatch_ready",
    "recv_specs",
    "combine_ready",
    "lines_tail",
    "row_tail_bytes",
    "combine_lines_bytes",
};

// The aux fields as the kernels see them: row-relative byte offsets and the sizes they
// need (the values of the aux list that are not constants).
struct AuxOffsets {
  int64_t flag_val;  // FLAG_VAL: this rank's round
  int64_t local_token_counter;  // LOCAL_TOKEN_COUNTER
  int64_t send_counters;  // [ep_size] int32: tokens sent to each target
  int64_t recv_counters;  // [ep_size] int32, written by source s: tokens s sent here
  int64_t dispatch_completion_flags;  // [ep_size] int32, written by source s: its round
  int64_t combine_completion_flags;  // [ep_size] int32, written by target t: its round
  int64_t topk_target_ranks;  // [max_num_tokens, MAX_TOP_K] int32: target of (t, k)
  int64_t topk_send_indices;  // [max_num_tokens, MAX_TOP_K] int32: slot of (t, k) there
  int64_t block_counters;  // [BLOCK_COUNTER_SLOTS] int32, slots layout::SLOT_*
  int topk_stride;  // row stride (int32 elements) of the [max_num_tokens, MAX_TOP_K] arrays
  int64_t slot_tokens;  // [ep_size, max_num_tokens] int32: token sent to (target, slot)
  int max_num_tokens;  // the job's max_num_tokens (row stride of slot_tokens)
  int64_t combine_slice_flags;  // [ep_size, combine_slices] u64, written by the targets
  int combine_slices;  // ceil(max_num_tokens / COMBINE_SLICE_ROWS)
  int64_t recv_rts;  // [ep_size] int32, written by source s: its runtime_max_tokens_per_rank
  int64_t dispatch_ready;  // [ep_size] u64, written by source s: (high << 32) | round
  int64_t recv_specs;  // [ep_size, SPEC_WORDS] int32, written by source s: its payload descriptor
  int64_t combine_ready;  // [ep_size] u64, written by target t: (combine spec << 32) | round
  int64_t lines_tail;  // the row's lines tail (ROW_TAIL_BYTES past the row: heads, then lines), 0: none
};

// The struct from an aux list (anything indexable by AUX_*, checked by the caller).
template <typename List>
inline AuxOffsets aux_offsets_from(const List& v) {
  AuxOffsets a;
  a.flag_val = static_cast<int64_t>(v[AUX_FLAG_VAL]);
  a.local_token_counter = static_cast<int64_t>(v[AUX_LOCAL_TOKEN_COUNTER]);
  a.send_counters = static_cast<int64_t>(v[AUX_SEND_COUNTERS]);
  a.recv_counters = static_cast<int64_t>(v[AUX_RECV_COUNTERS]);
  a.dispatch_completion_flags = static_cast<int64_t>(v[AUX_DISPATCH_COMPLETION_FLAGS]);
  a.combine_completion_flags = static_cast<int64_t>(v[AUX_COMBINE_COMPLETION_FLAGS]);
  a.topk_target_ranks = static_cast<int64_t>(v[AUX_TOPK_TARGET_RANKS]);
  a.topk_send_indices = static_cast<int64_t>(v[AUX_TOPK_SEND_INDICES]);
  a.block_counters = static_cast<int64_t>(v[AUX_BLOCK_COUNTERS]);
  a.topk_stride = static_cast<int>(v[AUX_TOPK_STRIDE]);
  a.slot_tokens = static_cast<int64_t>(v[AUX_SLOT_TOKENS]);
  a.max_num_tokens = static_cast<int>(v[AUX_MAX_NUM_TOKENS]);
  a.combine_slice_flags = static_cast<int64_t>(v[AUX_COMBINE_SLICE_FLAGS]);
  a.combine_slices = static_cast<int>(v[AUX_COMBINE_SLICES]);
  a.recv_rts = static_cast<int64_t>(v[AUX_RECV_RTS]);
  a.dispatch_ready = static_cast<int64_t>(v[AUX_DISPATCH_READY]);
  a.recv_specs = static_cast<int64_t>(v[AUX_RECV_SPECS]);
  a.combine_ready = static_cast<int64_t>(v[AUX_COMBINE_READY]);
  a.lines_tail = static_cast<int64_t>(v[AUX_LINES_TAIL]);
  return a;
}

}  // namespace layout
}  // namespace a2ad
