// a2ad MoE all-to-all kernels: launch interface.
//
// Raw pointers, sizes and a cudaStream_t only; no torch. Every offset below is
// computed by a2ad/layout.py and passed in; nothing here recomputes the layout.
// The protocol these kernels implement is docs/PROTOCOL.md; how they
// synchronize is described in csrc/README.md.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace a2ad {

constexpr int kMaxPayloads = 6;   // layout.MAX_PAYLOADS
constexpr int kMaxTopK = 22;      // layout.MAX_TOP_K (checked against top_k, the stride is passed)
constexpr int kMaxEpSize = 64;    // layout.MAX_EP_SIZE

// Kernel variants (bit mask, DispatchParams/CombineParams::variant; 0 is the
// original code path). client/cuda_plane.py passes A2AD_KERNEL_VARIANT.
constexpr int kVariantSkipSelfStage = 1;  // combine: stage only the rows peers pull; own rows are read from the payload
constexpr int kVariantLowLatency = 2;     // both: single-block launches skip the arrival counter, the abort word is
                                          // first read after kAbortPollEvery polls, dispatch reads R up front
constexpr int kVariantWidePull = 4;       // combine: 4 x 16 B vectors per lane per pull item instead of 2
constexpr int kVariantBlockFence = 8;    // both: one fence.acq_rel.sys per block after __syncthreads (by the
                                          // thread that then arrives), not one per thread; a one-block launch
                                          // with bit 2 needs none besides the flags' st.release.sys
constexpr int kVariantOverlap = 16;       // combine: part of the grid stages slice by slice and tells the
                                          // puller per slice (COMBINE_SLICE_FLAGS); the rest pull from the start,
                                          // in the peers' slot order (SLOT_TOKENS), taking items from a counter.
                                          // Implies bit 1. Used when a rank stages >= 16 MB of rows >= 8 KB.
constexpr int kVariantLocalSlots = 32;    // dispatch: a one-block launch numbers its sends in shared memory
                                          // (no global atomics) and publishes the counts it holds
constexpr int kVariantPrefetch = 64;      // dispatch: each warp loads its first copy item of a tile before
                                          // the routing step, so the payload read overlaps the routing
constexpr int kVariantStageShareShift = 8;  // bits 8-11: with kVariantOverlap, 1 / share of the grid stages
                                             // (0: the default, 2)
constexpr int kDefaultVariant = kVariantSkipSelfStage | kVariantLowLatency | kVariantWidePull | kVariantBlockFence |
                                kVariantOverlap | kVariantLocalSlots;  // 63
constexpr int kVariantMask = 0xffff;      // the variant bits; the bits above carry the diagnostics

// Diagnostics (TIMING ONLY: every bit but kDiagDoubleFence breaks the protocol's
// guarantees, so a round run with them may deliver wrong or stale data). They ride in
// the high half of the `variant` word (variant | diag << kDiagShift); client/cuda_plane.py
// sets them only from A2AD_KERNEL_DIAG, never by default. All of them act on dispatch.
constexpr int kDiagShift = 16;
constexpr int kDiagSkipCopy = 1;     // no payload stores (routing, counters, fences, flags, wait as usual)
constexpr int kDiagSkipFence = 2;    // no per-thread / per-block system fence before the arrival
constexpr int kDiagNoWait = 4;       // publish counts and flags, but do not wait for the peers' flags
constexpr int kDiagNoPublish = 8;    // neither publish counts/flags nor wait (no cross-rank step at all)
constexpr int kDiagNoop = 16;        // the kernel returns at entry (same grid: the launch / graph-node floor)
constexpr int kDiagDoubleFence = 32; // the per-thread system fence twice (its cost, by addition; correct)

// The workspace as the kernels see it: row q (rank q's memory) starts at
// base + q * row_stride; `me` is this rank.
struct Workspace {
  uint8_t* base;
  int64_t row_stride;
  int ep_rank;
  int ep_size;
};

// Row-relative byte offsets of the aux fields (layout.AuxLayout), plus the
// row stride (in int32 elements) of the [max_num_tokens, MAX_TOP_K] arrays.
struct AuxOffsets {
  int64_t flag_val;
  int64_t local_token_counter;
  int64_t send_counters;
  int64_t recv_counters;
  int64_t dispatch_completion_flags;
  int64_t combine_completion_flags;
  int64_t topk_target_ranks;
  int64_t topk_send_indices;
  int64_t block_counters;
  int topk_stride;            // layout.MAX_TOP_K
  int block_counter_slots;    // layout.BLOCK_COUNTER_SLOTS
  int64_t slot_tokens;        // [ep_size, max_num_tokens] int32: token sent to (target, slot)
  int max_num_tokens;         // the job's max_num_tokens (row stride of slot_tokens)
  int64_t combine_slice_flags;  // [ep_size, combine_slices] int32, written by the targets
  int combine_slices;         // ceil(max_num_tokens / combine_slice_rows)
  int combine_slice_rows;     // layout.COMBINE_SLICE_ROWS
  int64_t recv_rts;           // [ep_size] int32, written by source s: its runtime_max_tokens_per_rank
};

// The job's control block as the kernels see it (host memory registered for
// GPU access). All offsets are absolute byte offsets into the block, from
// layout.py (CB_ABORT, status_offset(ep_rank) + STATUS_*); the codes and the
// phase numbers come from layout.py too.
struct Control {
  uint8_t* block;             // device pointer of the registered control block
  int64_t abort_word;         // u32
  int64_t status_code;        // u32, written last
  int64_t status_peer;        // i32
  int64_t status_round;       // u32
  int64_t status_phase;       // u32
  int64_t status_waited_ns;   // u64, 8-byte aligned
  uint32_t code_timeout;      // layout.STATUS_TIMEOUT
  uint32_t code_aborted;      // layout.STATUS_ABORTED
  uint32_t phase_dispatch;    // layout.PHASE_DISPATCH
  uint32_t phase_combine;     // layout.PHASE_COMBINE
  uint64_t timeout_ns;        // every spin wait gives up after this long
  // This rank's input record (layout.input_offset(ep_rank) + INPUT_*): what dispatch found
  // wrong in the input while still completing the round for every rank.
  int64_t input_code;         // u32, written last
  int64_t input_index;        // i32: the token, or the peer
  int64_t input_value;        // i32: the expert id, or the peer's runtime_max_tokens_per_rank
  int64_t input_round;        // u32
  uint32_t code_bad_expert;   // layout.INPUT_BAD_EXPERT
  uint32_t code_rt_mismatch;  // layout.INPUT_RT_MISMATCH
};

// How many SMs a launch may assume are its own (0: the whole device). Kernels
// whose blocks wait on each other (combine) size their grid so that it is
// co-resident within this many SMs. Several ranks sharing one GPU (tests) must
// split the SMs between them.
struct LaunchLimits {
  int sm_budget;
};

struct DispatchParams {
  Workspace ws;
  AuxOffsets aux;
  Control ctl;
  LaunchLimits lim;
  const int32_t* experts;     // [local_num_tokens, top_k] int32, contiguous, device
  int local_num_tokens;       // T (<= rt)
  int top_k;                  // <= kMaxTopK
  int num_experts;            // >= ep_size
  int rt;                     // runtime_max_tokens_per_rank
  int num_payloads;           // <= kMaxPayloads
  const uint8_t* payload[kMaxPayloads];        // [T, payload_bytes[i]] contiguous, device
  int64_t payload_bytes[kMaxPayloads];         // bytes per token (> 0, any width)
  int64_t payload_offset[kMaxPayloads];        // row-relative start of region [ep_size, rt, bytes]
  int tile_tokens;            // set by launch_dispatch (tokens a block routes per step)
  int variant;                // kVariant* bits
};

struct SanitizeParams {
  Workspace ws;
  AuxOffsets aux;
  int32_t* ids;               // the received expert-id payload of this rank (a view of its row)
  int64_t ids_stride_src;     // element strides of ids as [ep_size, rt, top_k]
  int64_t ids_stride_slot;
  int64_t ids_stride_k;
  int rt;
  int top_k;
  int32_t invalid_id;
};

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct CombineParams {
  Workspace ws;
  AuxOffsets aux;
  Control ctl;
  LaunchLimits lim;
  const uint8_t* payload;     // [ep_size, rt, hidden] contiguous, device; ignored if in workspace
  bool payload_in_workspace;  // payload already is this rank's combine region
  void* out;                  // [local_num_tokens, hidden] contiguous, device
  DType dtype;
  int64_t hidden;             // elements per token
  int local_num_tokens;
  int top_k;
  int rt;
  int64_t combine_offset;     // row-relative start of region [ep_size, rt, hidden]
  int variant;                // kVariant* bits
  int overlap_stage_blocks;   // set by launch_combine: > 0 runs kVariantOverlap with this many stagers
};

struct InitializeParams {
  uint8_t* row;               // this rank's row
  int64_t aux_bytes;          // zero [0, aux_bytes)
  int64_t flag_val;           // offset of FLAG_VAL
  int32_t initial_round;      // layout.INITIAL_ROUND
};

// All launches return the launch error (cudaSuccess when queued); none of them
// synchronizes the stream.
cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream);
cudaError_t launch_sanitize(const SanitizeParams& p, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream);
cudaError_t launch_initialize(const InitializeParams& p, cudaStream_t stream);

// Number of SMs of `device` (cached after the first query).
cudaError_t sm_count(int device, int* out);

}  // namespace a2ad

// The launchers under C-style names, as plain aliases.
inline cudaError_t a2ad_launch_dispatch(const a2ad::DispatchParams& p, cudaStream_t s) { return a2ad::launch_dispatch(p, s); }
inline cudaError_t a2ad_launch_sanitize(const a2ad::SanitizeParams& p, cudaStream_t s) { return a2ad::launch_sanitize(p, s); }
inline cudaError_t a2ad_launch_combine(const a2ad::CombineParams& p, cudaStream_t s) { return a2ad::launch_combine(p, s); }
inline cudaError_t a2ad_launch_initialize(const a2ad::InitializeParams& p, cudaStream_t s) { return a2ad::launch_initialize(p, s); }
