// Generated from a2ad/layout.py by `python -m a2ad.layout > csrc/layout.h`; do not edit.
// The constants the kernels share with Python (tests/test_layout.py checks this file is current).
#pragma once

namespace a2ad {
namespace layout {

constexpr int MAX_TOP_K = 22;
constexpr int MAX_EP_SIZE = 256;
constexpr int MASK_WORDS = 4;
constexpr int MAX_PAYLOADS = 6;
constexpr int BLOCK_COUNTER_SLOTS = 32;
constexpr int COMBINE_SLICE_ROWS = 8;
constexpr int INITIAL_ROUND = 1;
constexpr int SLOT_DISPATCH_ARRIVAL = 0;
constexpr int SLOT_COMBINE_ARRIVAL = 1;
constexpr int SLOT_DISPATCH_GIVE_UP = 2;
constexpr int SLOT_COMBINE_GIVE_UP = 3;
constexpr int SLOT_PULL_WORK = 4;
constexpr int SLOT_BAD_EXPERT = 6;
constexpr int SLOT_RT_MISMATCH = 8;
constexpr int SLOT_VIEW = 10;
constexpr int SLOT_VIEW_ROUND = 12;
constexpr int SLOT_COMBINE_SEEN = 14;
constexpr int SLOT_COMBINE_SEEN_ROUND = 16;
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

}  // namespace layout
}  // namespace a2ad
