// a2ad MoE all-to-all kernels: launch interface.
//
// Raw pointers, sizes and a cudaStream_t only; no torch. Every offset below is
// computed by a2ad/layout.py and passed in; every constant shared with Python comes
// from layout.h, which is generated from that module. The protocol these kernels
// implement is docs/PROTOCOL.md; how they synchronize is described in csrc/README.md.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "layout.h"

namespace a2ad {

constexpr int kMaxPayloads = layout::MAX_PAYLOADS;
constexpr int kMaxTopK = layout::MAX_TOP_K;  // checked against top_k; the stride is passed
constexpr int kMaxEpSize = layout::MAX_EP_SIZE;
// u64 words of a rank mask (rank q: bit q & 63 of word q >> 6). Kernels of a job with
// ep_size <= 64 keep one-word masks.
constexpr int kMaskWords = layout::MASK_WORDS;
static_assert(kMaskWords * 64 == kMaxEpSize, "a mask word per 64 ranks");

// Diagnostics: stages of dispatch switched off to time the others. They break the
// protocol's guarantees (every bit but kDiagDoubleFence may deliver wrong or stale data),
// so they exist only in the timing build (compiled with -DA2AD_KERNEL_TIMING, which
// a2ad.bench.kernel_timing asks for); a production build refuses a plan with any of them.
constexpr int kDiagSkipCopy = 1;     // no payload stores (routing, counters, fences, flags, wait as usual)
constexpr int kDiagSkipFence = 2;    // no block fence before the arrival (where the build has one)
constexpr int kDiagNoWait = 4;       // publish counts and flags, but do not wait for the peers'
constexpr int kDiagNoPublish = 8;    // neither publish nor wait (no cross-rank step at all)
constexpr int kDiagNoop = 16;        // the kernel returns at entry (the launch / graph-node floor)
constexpr int kDiagDoubleFence = 32; // one block fence more than the build has (its cost, by addition; correct)
constexpr int kDiagNoSpecCheck = 64; // after the wait, the peers' payload descriptors are not compared (still stored)
constexpr int kDiagGpuScopePublish = 128; // the ready words released at gpu scope, not sys (wrong across GPUs: the sys scope's cost)
#ifdef A2AD_KERNEL_TIMING
constexpr bool kTimingBuild = true;
#else
constexpr bool kTimingBuild = false;
#endif

// The workspace as the kernels see it: row q (rank q's memory) starts at
// base + q * row_stride; `ep_rank` is this rank.
struct Workspace {
  uint8_t* base;
  int64_t row_stride;
  int ep_rank;
  int ep_size;
};

// Row-relative byte offsets of the aux fields (layout.AuxLayout) and the sizes the kernels
// index them with: the struct generated from layout.AUX_PLAN_FIELDS into layout.h.
using AuxOffsets = layout::AuxOffsets;

// The job's control block as the kernels see it (host memory registered for GPU
// access). Offsets inside it are layout::CB_* and this rank's records.
struct Control {
  uint8_t* block;             // device pointer of the registered control block
  int ep_rank;                // whose status and input records these kernels write
  uint64_t timeout_ns;        // every spin wait gives up after this long
  bool degrade;               // the job's policy is POLICY_DEGRADE (docs/PROTOCOL.md, "Degraded mode")
};

// How many SMs a launch may assume are its own (0: the whole device). Kernels
// whose blocks wait on each other (combine) size their grid so that it is
// co-resident within this many SMs. Several ranks sharing one GPU (tests) must
// split the SMs between them.
struct LaunchLimits {
  int sm_budget;
};

// The caller's active-rank mask: a device tensor of `words` u64 words (may be null; words
// past `words` count as zero: they hold no rank below ep_size) ANDed with kMaskWords words
// given at launch (all ones: none).
struct CallerMask {
  const int64_t* ptr;
  int words;
  uint64_t value[kMaskWords];
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
  int diag;                   // kDiag* bits (timing build only; 0 otherwise)
  // The payload descriptor every peer compares with its own (layout.payload_spec).
  int32_t spec[layout::SPEC_WORDS];
  uint64_t spec_digest;       // set by launch_dispatch: spec_digest(spec) (the dispatch digests)
  // Set by launch_dispatch: how payload i is cut into copy items (the kernel's Items).
  int item_chunks[kMaxPayloads];  // items per token
  uint32_t item_vec16;            // bit i: payload i moves in 16-byte vectors, a chunk per item
  int items_per_token;            // the sum of item_chunks
  // EPLB statistics (eplb_experts > 0): this rank's [eplb_experts] int32 go to row
  // eplb_offset + 4 * me * eplb_experts of every peer; eplb_out (may be null) gets the
  // gathered [ep_size, eplb_experts] (zeros for a rank outside the round).
  const int32_t* eplb_local;
  int32_t* eplb_out;
  int eplb_experts;
  int64_t eplb_offset;
  // The caller's active-rank mask, ANDed with the job's.
  CallerMask caller_mask;
  // Low-latency pairs (pair_group > 0; a2ad.deep_ep's, the job's top_k is 1): token u of the
  // launch is pair (u / pair_group, u % pair_group) of the caller's [T, pair_group] expert ids,
  // pair_ids64 (int64) or experts (int32); an id < 0 sends nothing and is not reported.
  // Payload 0 holds the caller's T rows (pair u sends row u / pair_group); the last payload
  // (8 bytes, no source: payload[] is null) is written by the kernel, (u / pair_group, id).
  int pair_group;
  const int64_t* pair_ids64;
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

// Bytes of one FP8 combine row (layout.fp8_row_bytes): hidden e4m3 bytes, then one E8M0 scale
// byte per FP8_BLOCK elements, padded to 16 bytes.
__host__ __device__ inline int64_t fp8_row_bytes(int64_t hidden) {
  return (hidden + hidden / layout::FP8_BLOCK + 15) / 16 * 16;
}

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
  int overlap_stage_blocks;   // set by launch_combine: > 0 stages slice by slice with this many blocks
  // Degraded mode only (ctl.degrade): per token, 1 when it lost at least one expert's
  // contribution ([local_num_tokens], device); the ranks the combine counted, as
  // kMaskWords host-mapped u64 words (read by the host once the stream ran) and as
  // kMaskWords device u64 words (for the model, on the stream; a job of ep_size <= 64
  // writes only the first word of each). All may be null otherwise.
  uint8_t* degraded;
  uint64_t* seen_out;
  uint64_t* seen_dev;
  // The combine descriptor (layout.combine_spec) published with the flag and compared.
  uint32_t spec;
  // FP8 combine (bf16 only): the rows peers pull are e4m3 with one E8M0 scale per
  // FP8_BLOCK elements (layout.fp8_row_bytes per row, region at combine_offset); this
  // rank's own rows are read from the payload.
  bool low_precision;
  CallerMask caller_mask;
  // Low-latency pairs (a2ad.deep_ep; group > 0, bf16, 16-byte rows, not low_precision): the
  // job's tokens are (token, k) pairs, `group` per token. The payload is the expert outputs
  // in the caller's order (payload_rows rows): slot j of source s is payload row
  // stage_index[s * rt + j], staged (the received slots) and read (this rank's own) through
  // it. Out row u (local_num_tokens / group of them) is the sum over k of
  // group_weights[u, k] * the pair u * group + k's row, in float32 in k order, leaving out a
  // pair whose expert id (group_ids64 or group_ids32 [u, k]) is negative.
  const int64_t* stage_index;
  int64_t payload_rows;
  int group;
  const float* group_weights;
  const int64_t* group_ids64;
  const int32_t* group_ids32;
};

struct InitializeParams {
  uint8_t* row;               // this rank's row
  int64_t aux_bytes;          // zero [0, aux_bytes)
  int64_t flag_val;           // offset of FLAG_VAL
  int32_t initial_round;      // layout.INITIAL_ROUND
};

// All launches return the launch error (cudaSuccess when queued); none of them
// synchronizes the stream. In degraded mode launch_dispatch queues a one-block prologue
// (admission and the round's view) before the dispatch kernel.
cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream);
cudaError_t launch_sanitize(const SanitizeParams& p, cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream);
cudaError_t launch_initialize(const InitializeParams& p, cudaStream_t stream);
// Load every kernel of the extension on the current device now. Under CUDA's lazy loading a
// kernel is loaded at its first launch, and a load can wait for the kernels already running on
// the device: with several ranks of one job in one process (a caller-owned workspace), a rank's
// first sanitize or quantize would then wait behind a peer's dispatch that is itself waiting
// for that rank (the dispatch times out). The planes call this before their first launch.
cudaError_t load_dispatch_kernels();
cudaError_t load_combine_kernels();
cudaError_t load_sanitize_kernels();
cudaError_t load_quantize_kernels();

// Number of SMs of `device` (cached after the first query).
cudaError_t sm_count(int device, int* out);

// ---------------------------------------------------------------------------------------------
// a2ad.deep_ep's local steps on the CUDA backend (csrc/ll.cu): a DeepEP low-latency round is
// a round of a top_k = 1 job whose tokens are the (token, k) pairs.
// ---------------------------------------------------------------------------------------------
// A dispatch's routing: topk_idx [T, K], int64 or int32 (one of the pointers is null).
struct LlRouting {
  const int64_t* idx64;
  const int32_t* idx32;
  int64_t T;
  int K;
};

struct LlPackParams {
  const uint16_t* x;  // bf16 [T, H]
  LlRouting routing;
  int H;              // % 128 == 0
  int rank, lx;       // this rank, experts per rank
  int32_t* route;     // [T * K]: the expert, or rank * lx for a pair with none
  int32_t* meta;      // [T * K, 2]: (token, expert or -1)
  uint8_t* rows;      // e4m3 [T * K, H]
  float* scales;      // [T * K, H / 128]
  int round_scale;
};

struct LlArrangeParams {
  const int32_t* meta;  // received (token, expert): source s slot j at meta + s * meta_src_stride + 2 j
  int64_t meta_src_stride;
  const int32_t* counts;  // this rank's RECV_COUNTERS [ep]
  const uint8_t* rows;    // received rows: source s slot j at rows + s * rows_src_stride + j * row_bytes
  int64_t rows_src_stride;
  const float* scales;    // fp8: received scales, source s slot j at scales + s * scales_src_stride + j * ns
  int64_t scales_src_stride;
  int ep, rt, lx, rank, ns, row_bytes, r_total;  // r_total = ep * num_max
  int ue8m0;
  int slots_per_block;    // a multiple of 32
  uint8_t* out_rows;      // [lx, r_total, row_bytes]
  float* out_scales;      // fp8 float32 scales: [lx, ns, r_total] in memory
  uint8_t* out_ue8m0;     // fp8 UE8M0 scales: int32 [lx, ns / 4, r_total] in memory, as bytes
  int32_t* recv_count;    // [lx]
  int32_t* src_info;      // [lx, r_total]
  int64_t* layout_range;  // [lx, ep]
  int64_t* dest;          // [ep * rt]: each slot's row of out_rows (0: none)
  int32_t* stats;         // [lx], added to, or null
};

int ll_arrange_smem_bytes(int lx, int ep, int slots_per_block);
cudaError_t launch_ll_pack(const LlPackParams& p, cudaStream_t stream);
// ll_arrange follows a kernel that waits for the peers (dispatch): `early` false launches it
// once that one completed (ranks sharing one GPU; launch.cuh says why).
cudaError_t launch_ll_arrange(const LlArrangeParams& p, cudaStream_t stream, bool early);
cudaError_t load_ll_kernels();

}  // namespace a2ad
