// a2ad MoE all-to-all kernels: dispatch, sanitize, combine, initialize.
//
// The protocol is docs/PROTOCOL.md; the synchronization scheme is described in
// csrc/README.md. Every offset arrives in the launch parameters (computed by
// a2ad/layout.py). No kernel traps: a wait that gives up records why in the
// rank's status record (control block, host memory) and returns.
#include "moe_a2a.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>
#include <utility>
#include <vector>

namespace a2ad {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kDispatchThreads = 256;
constexpr int kCombineThreads = 256;
constexpr int kSanitizeThreads = 256;
constexpr int kInitializeThreads = 256;
// 16-byte vectors each lane keeps in flight per copy/pull step.
constexpr int kCopyUnroll = 4;
// Pull (combine): 16-byte vectors per lane per item, and sends whose loads are
// in flight together (kPullSends x kPullVecs loads per lane before any use).
constexpr int kPullVecs = 2;
constexpr int kPullSends = 4;
// Scalar elements per lane per pull item (the unaligned fallback).
constexpr int kPullScalars = 4;
// BLOCK_COUNTERS slots used by the kernels (the last one is the status claim).
constexpr int kSlotDispatch = 0;        // arrival counter of dispatch
constexpr int kSlotCombine = 1;         // arrival counter of combine
constexpr int kSlotDispatchGiveUp = 2;  // round whose dispatch wait the poller gave up on
constexpr int kSlotCombineGiveUp = 3;   // round whose combine wait the poller gave up on
constexpr int kSlotPullWork = 4;        // combine (kVariantOverlap): next pull item; dispatch zeroes it
constexpr int kSlotBadExpert = 6;       // slots 6-7, u64: ~((token << 32) | id) of the smallest bad (token, id)
constexpr int kSlotRtMismatch = 8;      // round whose dispatch saw a peer pass another rt (its combine moves nothing)
constexpr int kMinBlockCounterSlots = 10;  // ... and the last slot: the status-record claim
// The abort word lives in host memory: read it once every this many polls.
constexpr uint32_t kAbortPollEvery = 64;
// kVariantOverlap: staged bytes and row width below which the launcher keeps the plain path
// (a small staging is cheaper spread over the whole grid than slice by slice), the default
// 1 / share of the grid that stages (variant bits 8-11 override it), and the
// 16-byte accesses in flight per stager thread (a slice is staged with few round trips).
constexpr int64_t kOverlapMinBytes = int64_t{16} << 20;
constexpr int64_t kOverlapMinRowBytes = 8192;  // narrower rows: the per-slice release costs more than it hides
constexpr int kOverlapStageShare = 2;  // measured: 1/2 196.1 us, 1/3 196.5, 1/4 198.4, 1/6 226.0 (T=4096)
constexpr int kStageUnroll = 8;

enum WaitResult : int { kWaitOk = 0, kWaitTimeout = 1, kWaitAborted = 2, kWaitStopped = 3 };

// ---------------------------------------------------------------------------
// Memory-model primitives
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

__device__ __forceinline__ uint8_t* row_of(const Workspace& ws, int q) { return ws.base + (int64_t)q * ws.row_stride; }

template <typename T>
__device__ __forceinline__ T* at(uint8_t* row, int64_t off) {
  return reinterpret_cast<T*>(row + off);
}

// ---------------------------------------------------------------------------
// Bounded waits and the status record
// ---------------------------------------------------------------------------
__device__ void write_status(const Control& c, uint32_t code, int peer, int round, uint32_t phase, uint64_t waited) {
  uint8_t* b = c.block;
  *reinterpret_cast<volatile int32_t*>(b + c.status_peer) = peer;
  *reinterpret_cast<volatile uint32_t*>(b + c.status_round) = static_cast<uint32_t>(round);
  *reinterpret_cast<volatile uint32_t*>(b + c.status_phase) = phase;
  *reinterpret_cast<volatile uint64_t*>(b + c.status_waited_ns) = waited;
  __threadfence_system();  // the host must never see the code before the fields
  *reinterpret_cast<volatile uint32_t*>(b + c.status_code) = code;
  __threadfence_system();
}

// This rank's input record: fields first, the code last, each system-visible in that order.
__device__ void write_input(const Control& c, uint32_t code, int index, int value, int round) {
  uint8_t* b = c.block;
  *reinterpret_cast<volatile int32_t*>(b + c.input_index) = index;
  *reinterpret_cast<volatile int32_t*>(b + c.input_value) = value;
  *reinterpret_cast<volatile uint32_t*>(b + c.input_round) = static_cast<uint32_t>(round);
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(b + c.input_code) = code;
  __threadfence_system();
}

// Spin until *flag == want (acquire), the deadline passes, or the wait is
// called off. The launch's *poller* block reads the job's abort word (host
// memory, so only every kAbortPollEvery polls) and gives up after
// c.timeout_ns. The other blocks watch `give_up` (device memory) instead, where
// the poller posts the round it gave up on; their own deadline is twice as
// long, a backstop only: they started waiting before the poller did (it is the
// last block to arrive), and a flag the poller saw can no longer change before
// this launch ends, so they cannot miss what the poller saw. Any thread also
// stops once another thread of its block gave up (*stop).
__device__ int spin_until_equal(const int* flag, int want, const Control& c, bool poller, const int* give_up,
                                const volatile int* stop, uint64_t* waited, bool lazy_abort) {
  // lazy_abort: the first read of the host-mapped abort word (a PCIe round
  // trip, ~1 us) comes after kAbortPollEvery polls, not before the second poll.
  const uint32_t abort_phase = lazy_abort ? kAbortPollEvery - 1 : 0;
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(c.block + c.abort_word);
  const uint64_t limit = poller ? c.timeout_ns : 2 * c.timeout_ns;
  const uint64_t t0 = global_timer_ns();
  for (uint32_t it = 0;; ++it) {
    if (ld_acquire_sys(flag) == want) return kWaitOk;
    const uint64_t now = global_timer_ns();
    *waited = now - t0;
    if (poller) {
      if (it % kAbortPollEvery == abort_phase && ld_relaxed_sys_u32(abort_word) != 0) return kWaitAborted;
    } else {
      if (ld_volatile(give_up) == want) return kWaitStopped;
      __nanosleep(64);  // many blocks may wait: keep their polls off the flags' L2 lines
    }
    if (now - t0 >= limit) return kWaitTimeout;
    if (*stop) return kWaitStopped;
  }
}

// Threads [0, ep_size) of the block each wait until flags[q] == round. Returns
// true when every flag arrived. A thread that gives up on its own (timeout or
// abort) posts the round to *give_up, so that the launch's other waiting
// blocks stop too, and writes the status record unless another thread of this
// rank already did (claimed through *claim, in device memory).
__device__ bool block_wait_flags(const int* flags, int ep_size, int round, const Control& c, uint32_t phase,
                                 bool poller, int* claim, int* give_up, bool lazy_abort) {
  __shared__ int s_stop;
  volatile int* stop = &s_stop;
  if (threadIdx.x == 0) *stop = 0;
  __syncthreads();
  const int q = threadIdx.x;
  if (q < ep_size) {
    uint64_t waited = 0;
    const int r = spin_until_equal(flags + q, round, c, poller, give_up, stop, &waited, lazy_abort);
    if (r != kWaitOk) {
      *stop = 1;
      if (r != kWaitStopped) {
        *reinterpret_cast<volatile int*>(give_up) = round;
        if (atomicCAS(claim, 0, 1) == 0) {
          write_status(c, r == kWaitTimeout ? c.code_timeout : c.code_aborted, q, round, phase, waited);
        }
      }
    }
  }
  __syncthreads();
  return *stop == 0;
}

// Last-block pattern: every thread fences its own writes system-wide, then the
// block arrives on *counter. Returns true (in every thread) in the block that
// arrived last; that block resets the counter for the next launch.
// single_fast: a grid of one block needs no counter (it is the last block).
// block_fence (kVariantBlockFence): no per-thread fence; after __syncthreads
// thread 0 fences once before it arrives (cumulativity: the barrier orders the
// block's writes before that fence, as in a cooperative-groups grid sync). A
// one-block launch with single_fast needs no fence here at all: the caller
// publishes with st.release.sys after this barrier, which is itself a release
// pattern covering every write the barrier ordered before it.
// diag: kDiagSkipFence / kDiagDoubleFence (timing only).
__device__ bool arrive_last(int* counter, bool single_fast = false, bool block_fence = false, int diag = 0) {
  __shared__ int s_last;
  const bool fence = (diag & kDiagSkipFence) == 0;
  if (fence && !block_fence) {
    fence_acq_rel_sys();
    if (diag & kDiagDoubleFence) fence_acq_rel_sys();
  }
  __syncthreads();
  if (single_fast && gridDim.x == 1) return true;
  if (threadIdx.x == 0) {
    if (fence && block_fence) fence_acq_rel_sys();
    const int done = atomic_add_acq_rel_gpu(counter, 1);
    const int last = done == static_cast<int>(gridDim.x) - 1;
    if (last) {
      *reinterpret_cast<volatile int*>(counter) = 0;
      fence_acq_rel_sys();
    }
    s_last = last;
  }
  __syncthreads();
  return s_last != 0;
}

// ---------------------------------------------------------------------------
// Copies
// ---------------------------------------------------------------------------
template <typename V, int kUnroll = kCopyUnroll>
__device__ __forceinline__ void copy_vectors(uint8_t* dst, const uint8_t* src, int64_t n, int64_t tid, int64_t nthreads) {
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  int64_t i = tid;
  // (unroll 1: the unrolled body already keeps kUnroll loads in flight, and
  //  it spares a 64-bit trip-count division)
#pragma unroll 1
  for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * nthreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * nthreads] = r[u];
  }
#pragma unroll 1
  for (; i < n; i += nthreads) d[i] = s[i];
}

// Copy n bytes with the widest access both pointers allow (16/8/4/2/1 bytes),
// threads tid of nthreads cooperating, kUnroll accesses in flight per thread.
// Any width, any alignment.
template <int kUnroll = kCopyUnroll>
__device__ void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, int64_t tid, int64_t nthreads) {
  if (n <= 0) return;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  const int shift = (mis & 15) == 0 ? 4 : (mis & 7) == 0 ? 3 : (mis & 3) == 0 ? 2 : (mis & 1) == 0 ? 1 : 0;
  const int64_t w = int64_t{1} << shift;
  int64_t head = (w - (reinterpret_cast<uintptr_t>(dst) & (w - 1))) & (w - 1);
  if (head > n) head = n;
  for (int64_t b = tid; b < head; b += nthreads) dst[b] = src[b];
  dst += head;
  src += head;
  n -= head;
  const int64_t nv = n >> shift;
  switch (shift) {
    case 4: copy_vectors<uint4, kUnroll>(dst, src, nv, tid, nthreads); break;
    case 3: copy_vectors<uint2, kUnroll>(dst, src, nv, tid, nthreads); break;
    case 2: copy_vectors<uint32_t, kUnroll>(dst, src, nv, tid, nthreads); break;
    case 1: copy_vectors<uint16_t, kUnroll>(dst, src, nv, tid, nthreads); break;
    default: copy_vectors<uint8_t, kUnroll>(dst, src, nv, tid, nthreads); break;
  }
  for (int64_t b = (nv << shift) + tid; b < n; b += nthreads) dst[b] = src[b];
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------
__device__ __forceinline__ int expert_owner(int e, int num_experts, int ep_size) {
  const int base = num_experts / ep_size, rem = num_experts % ep_size;
  const int split = rem * (base + 1);
  return e < split ? e / (base + 1) : rem + (e - split) / base;
}

// Tokens routed per block step (one routing warp each).
constexpr int kTileMax = kDispatchThreads / 32;

// Per-block routing results of the current tile: for token w of the tile,
// lane k of s_target/s_slot holds send (w, k); s_sends[w] is the mask of sends.
struct TileRouting {
  int target[kTileMax][32];
  int slot[kTileMax][32];
  unsigned sends[kTileMax];
};

// Copy chunk `c` of payload i of token t to every send of the token. With
// 16-byte vectors, a chunk is 32 lanes x kCopyUnroll vectors, loaded once and
// stored to every target; otherwise the chunk is the whole row, copied with
// the widest access the alignment allows, target by target.
// The 16-byte path in two halves: load chunk c of payload i of token t (any
// time, routing not needed), then store it to every send of tile token w.
__device__ __forceinline__ void load_chunk16(const DispatchParams& p, int t, int i, int c, int lane,
                                             uint4 (&r)[kCopyUnroll]) {
  const int64_t nb = p.payload_bytes[i];
  const int64_t nvec = nb / 16;
  const int64_t v0 = (int64_t)c * 32 * kCopyUnroll;
  const uint4* s4 = reinterpret_cast<const uint4*>(p.payload[i] + (int64_t)t * nb);
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    r[u] = v < nvec ? s4[v] : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void store_chunk16(const DispatchParams& p, const TileRouting& tr, int w, int i, int c,
                                              int lane, const uint4 (&r)[kCopyUnroll]) {
  const int64_t nb = p.payload_bytes[i];
  const int64_t nvec = nb / 16;
  const int64_t v0 = (int64_t)c * 32 * kCopyUnroll;
  const int64_t region = p.payload_offset[i] + (int64_t)p.ws.ep_rank * p.rt * nb;
  for (unsigned m = tr.sends[w]; m != 0; m &= m - 1) {
    const int k = __ffs(m) - 1;
    uint4* d4 = reinterpret_cast<uint4*>(row_of(p.ws, tr.target[w][k]) + region + (int64_t)tr.slot[w][k] * nb);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < nvec) d4[v] = r[u];
    }
  }
}

__device__ void dispatch_copy_chunk(const DispatchParams& p, const TileRouting& tr, int w, int t, int i, int c,
                                    bool vec16, int lane) {
  const unsigned sends = tr.sends[w];
  const int64_t nb = p.payload_bytes[i];
  const uint8_t* src = p.payload[i] + (int64_t)t * nb;
  const int64_t region = p.payload_offset[i] + (int64_t)p.ws.ep_rank * p.rt * nb;
  if (vec16) {
    uint4 r[kCopyUnroll];
    load_chunk16(p, t, i, c, lane, r);
    store_chunk16(p, tr, w, i, c, lane, r);
  } else {
    for (unsigned m = sends; m != 0; m &= m - 1) {
      const int k = __ffs(m) - 1;
      copy_bytes<>(row_of(p.ws, tr.target[w][k]) + region + (int64_t)tr.slot[w][k] * nb, src, nb, lane, 32);
    }
  }
}

// Copy item -> (tile token w, payload i, chunk c); chunks[] per payload.
__device__ __forceinline__ void decode_item(int item, int per_token, const int (&chunks)[kMaxPayloads], int* w,
                                            int* i, int* c) {
  *w = item / per_token;
  int cc = item - *w * per_token;
  int ii = 0;
#pragma unroll
  for (int j = 0; j < kMaxPayloads - 1; ++j) {
    if (ii == j && cc >= chunks[j]) {
      cc -= chunks[j];
      ii = j + 1;
    }
  }
  *i = ii;
  *c = cc;
}

// The last block of dispatch tells the host what was wrong with the input, without stopping
// the round. A peer that passed another rt wins over a bad expert id; the combine of a round
// with such a peer moves no data (kSlotRtMismatch). Kept off the common path: the bad-id key
// is taken before the wait (routing is over once the block arrived last), and after the wait
// each waiting thread checks its own source's rt, so no extra dependent read follows it.
__device__ unsigned long long take_bad_expert(int* block_counters) {
  auto* bad = reinterpret_cast<volatile unsigned long long*>(block_counters + kSlotBadExpert);
  const unsigned long long inv = *bad;
  if (inv != 0) *bad = 0;
  return inv;
}

__device__ void report_input(const DispatchParams& p, int* block_counters, int round, int peer, int peer_rt,
                             unsigned long long bad_inv) {
  if (peer >= 0) {
    block_counters[kSlotRtMismatch] = round;
    write_input(p.ctl, p.ctl.code_rt_mismatch, peer, peer_rt, round);
  } else if (bad_inv != 0) {
    const unsigned long long key = ~bad_inv;
    write_input(p.ctl, p.ctl.code_bad_expert, static_cast<int>(key >> 32),
                static_cast<int>(static_cast<uint32_t>(key)), round);
  }
}

// Grid: any size >= 1. A block takes tiles of p.tile_tokens consecutive
// tokens (grid-stride): warp w routes token w of the tile, then every warp of
// the block copies (token, payload, chunk) items, so that a few tokens still
// spread their bytes over the whole block. No block waits on another: the
// last block to arrive publishes the counts and flags and is the only one that
// waits for the peers.
__global__ void __launch_bounds__(kDispatchThreads) dispatch_kernel(const DispatchParams p) {
  __shared__ TileRouting tr;
  const int diag = p.variant >> kDiagShift;  // 0 unless A2AD_KERNEL_DIAG (timing only)
  if (diag & kDiagNoop) return;
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  int* send_counters = at<int>(my_row, p.aux.send_counters);
  int* block_counters = at<int>(my_row, p.aux.block_counters);
  int* topk_target = at<int>(my_row, p.aux.topk_target_ranks);
  int* topk_send = at<int>(my_row, p.aux.topk_send_indices);
  int* slot_tokens = at<int>(my_row, p.aux.slot_tokens);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *at<int>(my_row, p.aux.local_token_counter) = p.local_num_tokens;
    block_counters[kSlotPullWork] = 0;  // the next combine's item counter (the previous combine is over)
  }
  const bool low_latency = (p.variant & kVariantLowLatency) != 0;
  // One-block launch: number the sends in shared memory, no global atomics.
  const bool local_slots = (p.variant & kVariantLocalSlots) != 0 && gridDim.x == 1;
  const bool prefetch = (p.variant & kVariantPrefetch) != 0 && (diag & kDiagSkipCopy) == 0;
  __shared__ int s_count[kMaxEpSize];
  if (local_slots) {
    for (int q = threadIdx.x; q < ep; q += blockDim.x) s_count[q] = 0;
    __syncthreads();
  }
  // R; only combine changes it, and the previous combine finished before this launch.
  const int early_round = low_latency ? ld_volatile(at<int>(my_row, p.aux.flag_val)) : 0;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int warps = kDispatchThreads / 32;
  const int tile = p.tile_tokens;
  // Chunks per token of each payload (uniform: with 16-byte rows the source
  // alignment is the same for every token).
  int chunks[kMaxPayloads];
  bool vec16[kMaxPayloads];
  int per_token = 0;
#pragma unroll
  for (int i = 0; i < kMaxPayloads; ++i) {
    chunks[i] = 0;
    vec16[i] = false;
    if (i < p.num_payloads) {
      const int64_t nb = p.payload_bytes[i];
      vec16[i] = (nb % 16) == 0 && (reinterpret_cast<uintptr_t>(p.payload[i]) % 16) == 0 &&
                 ((reinterpret_cast<uintptr_t>(p.ws.base) + p.payload_offset[i]) % 16) == 0 &&
                 (p.ws.row_stride % 16) == 0;
      chunks[i] = vec16[i] ? static_cast<int>((nb / 16 + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll)) : 1;
      per_token += chunks[i];
    }
  }

#pragma unroll 1
  for (int t0 = blockIdx.x * tile; t0 < p.local_num_tokens; t0 += gridDim.x * tile) {
    const int ntok = min(tile, p.local_num_tokens - t0);
    const int items = ntok * per_token;
    // kVariantPrefetch: this warp's first copy item of the tile is loaded now, under the routing.
    uint4 pre[kCopyUnroll];
    bool have_pre = false;
    if (prefetch && warp < items) {
      int w, i, c;
      decode_item(warp, per_token, chunks, &w, &i, &c);
#pragma unroll
      for (int j = 0; j < kMaxPayloads; ++j) {
        if (j == i && vec16[j]) {
          load_chunk16(p, t0 + w, j, c, lane, pre);
          have_pre = true;
        }
      }
    }
    // Routing: lane k of warp w handles (t0 + w, k). A send is the smallest k with its target.
    if (warp < ntok) {
      const int t = t0 + warp;
      int target = -1;
      if (lane < p.top_k) {
        const int e = p.experts[(int64_t)t * p.top_k + lane];
        if (e >= 0 && e < p.num_experts) {
          target = expert_owner(e, p.num_experts, ep);
        } else {  // routed nowhere; the smallest (token, id) is reported after the round
          const unsigned long long key =
              (static_cast<unsigned long long>(static_cast<uint32_t>(t)) << 32) | static_cast<uint32_t>(e);
          atomicMax(reinterpret_cast<unsigned long long*>(block_counters + kSlotBadExpert), ~key);
        }
      }
      const unsigned same = __match_any_sync(kFullMask, target);
      const bool is_send = target >= 0 && __ffs(same) - 1 == lane;
      int slot = -1;
      if (is_send) slot = local_slots ? atomicAdd(s_count + target, 1) : atomicAdd(send_counters + target, 1);
      if (is_send && slot < p.rt) slot_tokens[(int64_t)target * p.aux.max_num_tokens + slot] = t;
      if (lane < p.top_k) {
        topk_target[(int64_t)t * p.aux.topk_stride + lane] = is_send ? target : -1;
        topk_send[(int64_t)t * p.aux.topk_stride + lane] = is_send ? slot : -1;
      }
      tr.target[warp][lane] = target;
      tr.slot[warp][lane] = slot;
      // slot < T <= rt always holds (one send per token and target); never
      // write outside the region even if it did not.
      const unsigned sends = __ballot_sync(kFullMask, is_send && slot < p.rt);
      if (lane == 0) tr.sends[warp] = sends;
    }
    __syncthreads();
    // Copy: items (token w, payload i, chunk c), spread over the block's warps.
#pragma unroll 1
    for (int item = warp; item < items; item += warps) {
      int w, i, c;
      decode_item(item, per_token, chunks, &w, &i, &c);
      if (tr.sends[w] != 0 && (diag & kDiagSkipCopy) == 0) {
        if (have_pre && item == warp) {
#pragma unroll
          for (int j = 0; j < kMaxPayloads; ++j) {
            if (j == i) store_chunk16(p, tr, w, j, c, lane, pre);
          }
        } else {
#pragma unroll
          for (int j = 0; j < kMaxPayloads; ++j) {  // constant indices keep chunks/vec16 in registers
            if (j == i) dispatch_copy_chunk(p, tr, w, t0 + w, j, c, vec16[j], lane);
          }
        }
      }
    }
    __syncthreads();  // tr is rewritten by the next tile
  }

  const bool block_fence = (p.variant & kVariantBlockFence) != 0;
  if (!arrive_last(block_counters + kSlotDispatch, low_latency, block_fence, diag)) return;
  if (diag & kDiagNoPublish) return;
  // Last block: every token's counter increment and payload store is visible.
  const int round = low_latency ? early_round : ld_volatile(at<int>(my_row, p.aux.flag_val));  // R
  const int q = threadIdx.x;
  if (q < ep) {
    int count;
    if (local_slots) {
      count = s_count[q];      // this block numbered every send (arrive_last synchronized the block)
      send_counters[q] = count;  // after dispatch SEND_COUNTERS hold the counts (combine zeroes them)
    } else {
      count = ld_volatile(send_counters + q);
    }
    uint8_t* peer = row_of(p.ws, q);
    *reinterpret_cast<volatile int*>(peer + p.aux.recv_counters + 4 * (int64_t)me) = count;
    *reinterpret_cast<volatile int*>(peer + p.aux.recv_rts + 4 * (int64_t)me) = p.rt;
    st_release_sys(at<int>(peer, p.aux.dispatch_completion_flags + 4 * (int64_t)me), round);
  }
  if (diag & kDiagNoWait) return;
  const unsigned long long bad_inv = threadIdx.x == 0 ? take_bad_expert(block_counters) : 0;
  // Only this block waits, so it is the poller (no other block needs telling).
  if (!block_wait_flags(at<int>(my_row, p.aux.dispatch_completion_flags), ep, round, p.ctl, p.ctl.phase_dispatch,
                        /*poller=*/true, block_counters + p.aux.block_counter_slots - 1,
                        block_counters + kSlotDispatchGiveUp, low_latency)) {
    return;
  }
  __shared__ int s_peer, s_peer_rt;
  if (threadIdx.x == 0) s_peer = kMaxEpSize;
  __syncthreads();
  if (q < ep) {
    const int r = ld_volatile(at<int>(my_row, p.aux.recv_rts) + q);  // written before q's flag, now acquired
    if (r != p.rt) atomicMin(&s_peer, q);
  }
  __syncthreads();
  if (threadIdx.x == 0 && (s_peer < kMaxEpSize || bad_inv != 0)) {
    const int peer = s_peer < kMaxEpSize ? s_peer : -1;
    s_peer_rt = peer >= 0 ? ld_volatile(at<int>(my_row, p.aux.recv_rts) + peer) : 0;
    report_input(p, block_counters, round, peer, s_peer_rt, bad_inv);
  }
}

// ---------------------------------------------------------------------------
// Sanitize
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kSanitizeThreads) sanitize_kernel(const SanitizeParams p) {
  const int* recv = at<int>(row_of(p.ws, p.ws.ep_rank), p.aux.recv_counters);
  const uint32_t top_k = static_cast<uint32_t>(p.top_k), rt = static_cast<uint32_t>(p.rt);
  const uint32_t n = static_cast<uint32_t>(p.ws.ep_size) * rt * top_k;  // the launcher checks n < 2^31
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint32_t sj = i / top_k, k = i - sj * top_k;
    const uint32_t s = sj / rt, j = sj - s * rt;
    if (static_cast<int>(j) >= ld_volatile(recv + s)) {
      p.ids[s * p.ids_stride_src + j * p.ids_stride_slot + k * p.ids_stride_k] = p.invalid_id;
    }
  }
}

// ---------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kPerVec = 4;
  __device__ static __forceinline__ void add(const uint4& v, float* a) {
    a[0] += __uint_as_float(v.x);
    a[1] += __uint_as_float(v.y);
    a[2] += __uint_as_float(v.z);
    a[3] += __uint_as_float(v.w);
  }
  __device__ static __forceinline__ uint4 pack(const float* a) {
    return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]), __float_as_uint(a[3]));
  }
  __device__ static __forceinline__ float load_one(const void* p) { return __ldcg(static_cast<const float*>(p)); }
  __device__ static __forceinline__ void store_one(void* p, float f) { *static_cast<float*>(p) = f; }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kPerVec = 8;
  __device__ static __forceinline__ void add2(uint32_t w, float* a) {
    a[0] += __uint_as_float(w << 16);
    a[1] += __uint_as_float(w & 0xffff0000u);
  }
  __device__ static __forceinline__ void add(const uint4& v, float* a) {
    add2(v.x, a);
    add2(v.y, a + 2);
    add2(v.z, a + 4);
    add2(v.w, a + 6);
  }
  __device__ static __forceinline__ uint32_t pack2(float lo, float hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
  }
  __device__ static __forceinline__ uint4 pack(const float* a) {
    return make_uint4(pack2(a[0], a[1]), pack2(a[2], a[3]), pack2(a[4], a[5]), pack2(a[6], a[7]));
  }
  __device__ static __forceinline__ float load_one(const void* p) {
    return __uint_as_float(static_cast<uint32_t>(__ldcg(static_cast<const unsigned short*>(p))) << 16);
  }
  __device__ static __forceinline__ void store_one(void* p, float f) {
    *static_cast<unsigned short*>(p) = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

template <>
struct Elem<__half> {
  static constexpr int kPerVec = 8;
  __device__ static __forceinline__ void add2(uint32_t w, float* a) {
    a[0] += __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    a[1] += __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  __device__ static __forceinline__ void add(const uint4& v, float* a) {
    add2(v.x, a);
    add2(v.y, a + 2);
    add2(v.z, a + 4);
    add2(v.w, a + 6);
  }
  __device__ static __forceinline__ uint32_t pack2(float lo, float hi) {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
  }
  __device__ static __forceinline__ uint4 pack(const float* a) {
    return make_uint4(pack2(a[0], a[1]), pack2(a[2], a[3]), pack2(a[4], a[5]), pack2(a[6], a[7]));
  }
  __device__ static __forceinline__ float load_one(const void* p) {
    return __half2float(__ushort_as_half(__ldcg(static_cast<const unsigned short*>(p))));
  }
  __device__ static __forceinline__ void store_one(void* p, float f) {
    *static_cast<unsigned short*>(p) = __half_as_ushort(__float2half_rn(f));
  }
};

struct PullGeometry {
  int64_t units;        // 16-byte vectors (kVec) or elements per token
  int64_t per_chunk;    // units one warp handles per item
  int64_t chunks;       // items per token
};

template <typename T, bool kVec, int kVecs = kPullVecs>
__host__ __device__ inline PullGeometry pull_geometry(int64_t hidden) {
  PullGeometry g;
  g.units = kVec ? hidden / Elem<T>::kPerVec : hidden;
  g.per_chunk = kVec ? 32 * kVecs : 32 * kPullScalars;
  g.chunks = (g.units + g.per_chunk - 1) / g.per_chunk;
  return g;
}

// out[t, chunk c] = sum over the token's sends of the target's combine row, in
// float32. One warp per (token, chunk) item; the loads of kPullSends sends are
// issued together.
// Own sends are read from the payload (not staged) with kVariantSkipSelfStage or kVariantOverlap.
__host__ __device__ inline bool self_from_payload(const CombineParams& p) {
  return (p.variant & (kVariantSkipSelfStage | kVariantOverlap)) != 0 && !p.payload_in_workspace;
}

// Lane k (< top_k) of the warp gets send k of token t: target rank and slot
// there, -1/-1 for a repeat or an invalid entry.
__device__ __forceinline__ void token_sends(const CombineParams& p, int t, int lane, int* target, int* slot) {
  uint8_t* my_row = row_of(p.ws, p.ws.ep_rank);
  int tq = -1, sq = -1;
  if (lane < p.top_k) {
    tq = ld_volatile(at<int>(my_row, p.aux.topk_target_ranks) + (int64_t)t * p.aux.topk_stride + lane);
    sq = ld_volatile(at<int>(my_row, p.aux.topk_send_indices) + (int64_t)t * p.aux.topk_stride + lane);
  }
  const bool valid = tq >= 0 && tq < p.ws.ep_size && sq >= 0 && sq < p.rt;
  *target = valid ? tq : -1;
  *slot = valid ? sq : -1;
}

template <typename T, bool kVec, int kVecs>
__device__ void pull_item(const CombineParams& p, int t, uint32_t c, const PullGeometry& g, int lane, int target,
                          int slot) {
  const int me = p.ws.ep_rank;
  unsigned sends = __ballot_sync(kFullMask, target >= 0);
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t unit_bytes = kVec ? 16 : (int64_t)sizeof(T);
  const int64_t first = c * static_cast<uint32_t>(g.per_chunk);  // first unit of this chunk (fits 32 bits)
  const uint8_t* region = p.ws.base + p.combine_offset + (int64_t)me * p.rt * row_bytes + first * unit_bytes;
  // Own sends: with kVariantSkipSelfStage the rows were not staged; read them from the payload.
  const uint8_t* self_region = self_from_payload(p) ? p.payload + (int64_t)me * p.rt * row_bytes + first * unit_bytes
                                                 : region + (int64_t)me * p.ws.row_stride;

  constexpr int kUnits = kVec ? kVecs : kPullScalars;
  // Sends whose loads are in flight together: as many loads per lane as the
  // default geometry (wider items batch fewer sends).
  constexpr int kSends = kVec ? (kPullSends * kPullVecs + kVecs - 1) / kVecs : kPullSends;
  constexpr int kPer = kVec ? Elem<T>::kPerVec : 1;
  float acc[kUnits * kPer];
#pragma unroll
  for (int a = 0; a < kUnits * kPer; ++a) acc[a] = 0.f;
  bool in[kUnits];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) in[u] = first + u * 32 + lane < g.units;
  // Load buffers (only the one of this path is used).
  uint4 vbuf[kSends][kVec ? kUnits : 1];
  float sbuf[kSends][kVec ? 1 : kUnits];
#pragma unroll
  for (int b = 0; b < kSends; ++b) {
#pragma unroll
    for (int u = 0; u < (kVec ? kUnits : 1); ++u) vbuf[b][u] = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < (kVec ? 1 : kUnits); ++u) sbuf[b][u] = 0.f;
  }

  while (sends != 0) {
    const uint8_t* src[kSends];
    bool has[kSends];
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      has[b] = sends != 0;  // warp-uniform
      const int k = has[b] ? __ffs(sends) - 1 : 0;
      if (has[b]) sends &= sends - 1;
      const int tq = __shfl_sync(kFullMask, target, k), sq = __shfl_sync(kFullMask, slot, k);
      src[b] = (tq == me ? self_region : region + (int64_t)tq * p.ws.row_stride) + (int64_t)sq * row_bytes;
    }
    // Every load of the batch is issued before the first use; an absent send
    // loads nothing and is skipped when accumulating (warp-uniform).
    if constexpr (kVec) {
#pragma unroll
      for (int b = 0; b < kSends; ++b) {
#pragma unroll
        for (int u = 0; u < kUnits; ++u) {
          if (has[b] && in[u]) vbuf[b][u] = __ldcg(reinterpret_cast<const uint4*>(src[b]) + u * 32 + lane);
        }
      }
#pragma unroll
      for (int b = 0; b < kSends; ++b) {
        if (has[b]) {
#pragma unroll
          for (int u = 0; u < kUnits; ++u) Elem<T>::add(vbuf[b][u], acc + u * kPer);  // !in[u]: never stored
        }
      }
    } else {
#pragma unroll
      for (int b = 0; b < kSends; ++b) {
#pragma unroll
        for (int u = 0; u < kUnits; ++u) {
          if (has[b] && in[u]) sbuf[b][u] = Elem<T>::load_one(src[b] + (u * 32 + lane) * sizeof(T));
        }
      }
#pragma unroll
      for (int b = 0; b < kSends; ++b) {
        if (has[b]) {
#pragma unroll
          for (int u = 0; u < kUnits; ++u) acc[u] += sbuf[b][u];
        }
      }
    }
  }

  uint8_t* out_row = static_cast<uint8_t*>(p.out) + (int64_t)t * row_bytes + first * unit_bytes;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if (in[u]) {
      const int v = u * 32 + lane;
      if constexpr (kVec) {
        reinterpret_cast<uint4*>(out_row)[v] = Elem<T>::pack(acc + u * kPer);
      } else {
        Elem<T>::store_one(out_row + v * sizeof(T), acc[u]);
      }
    }
  }
}

// kVariantOverlap, puller side: wait until the row `slot` that target `q`
// stages for this rank is ready: its slice flag or its whole-region flag equals
// `round`. Not the poller (the launch's last block is): stop when the poller
// posted this round to *give_up, give up on our own only after twice the
// timeout (then post it and write the status record, as the poller would).
__device__ bool wait_slice(const CombineParams& p, uint8_t* my_row, int q, int slot, int round, int* give_up,
                           int* claim) {
  const int* slice = at<int>(my_row, p.aux.combine_slice_flags) +
                     (int64_t)q * p.aux.combine_slices + slot / p.aux.combine_slice_rows;
  const int* whole = at<int>(my_row, p.aux.combine_completion_flags) + q;
  const uint64_t t0 = global_timer_ns();
  for (;;) {
    if (ld_acquire_sys(slice) == round || ld_acquire_sys(whole) == round) return true;
    if (ld_volatile(give_up) == round) return false;
    const uint64_t waited = global_timer_ns() - t0;
    if (waited >= 2 * p.ctl.timeout_ns) {
      *reinterpret_cast<volatile int*>(give_up) = round;
      if (atomicCAS(claim, 0, 1) == 0) write_status(p.ctl, p.ctl.code_timeout, q, round, p.ctl.phase_combine, waited);
      return false;
    }
    __nanosleep(64);
  }
}

// kVariantOverlap, stager side (blocks [0, nstage)): rows received from each
// source s != me, COMBINE_SLICE_ROWS at a time and slice-major (slice j of every
// source before slice j + 1), copied into the own combine region; after each
// slice the block tells source s (st.release.sys on s's slice flag, after the
// barrier: the release covers the whole block's copy, as in arrive_last).
__device__ void stage_slices(const CombineParams& p, const int* recv, int round, int nstage) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  const int64_t row_bytes = p.hidden * (int64_t)(p.dtype == DType::kFloat32 ? 4 : 2);
  const int S = p.aux.combine_slice_rows;
  int max_rows = 0;
  for (int s = 0; s < ep; ++s) {
    if (s == me) continue;
    const int r = ld_volatile(recv + s);
    max_rows = max(max_rows, min(max(r, 0), p.rt));
  }
  const int nj = (max_rows + S - 1) / S;
  const int others = ep - 1;
#pragma unroll 1
  for (int gsl = blockIdx.x; gsl < nj * others; gsl += nstage) {
    const int j = gsl / others, si = gsl - j * others;
    const int s = si < me ? si : si + 1;
    const int rows = min(max(ld_volatile(recv + s), 0), p.rt);
    const int r0 = j * S;
    if (r0 >= rows) continue;  // block-uniform
    const int r1 = min(r0 + S, rows);
    const int64_t off = ((int64_t)s * p.rt + r0) * row_bytes;
    copy_bytes<kStageUnroll>(my_row + p.combine_offset + off, p.payload + off, (r1 - r0) * row_bytes, threadIdx.x,
                             blockDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      st_release_sys(at<int>(row_of(p.ws, s), p.aux.combine_slice_flags) + (int64_t)me * p.aux.combine_slices + j,
                     round);
    }
  }
}

// Grid: at most as many blocks as can be co-resident within lim.sm_budget SMs
// (the launcher sizes it), because blocks wait for the flag that the last
// block of the same grid writes. Phases: stage -> arrive (last block: flags,
// reset SEND_COUNTERS, FLAG_VAL = R + 1) -> wait for every peer -> pull.
// kVariantOverlap (the launcher's choice: enough rows to stage, payload not in the
// workspace, ep > 1): only the first overlap_stage_blocks blocks stage,
// slice by slice; every block pulls as soon as it arrived, items taken from a
// counter in the order (tokens with no remote send) then (target q, slot s,
// chunk): the order in which q stages, so pullers rarely wait; each item waits
// for its rows' slices. Only the last block waits for the whole-region flags.
template <typename T, bool kVec, int kVecs>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const CombineParams p) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  int* block_counters = at<int>(my_row, p.aux.block_counters);
  const int round = ld_volatile(at<int>(my_row, p.aux.flag_val));
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int* recv = at<int>(my_row, p.aux.recv_counters);
  // The dispatch of this round saw a peer pass another rt: the regions do not line up, so
  // nothing is pulled and the output is zeros; the flags still go round so that every rank
  // completes the round (every rank saw the mismatch).
  const bool mismatch = ld_volatile(block_counters + kSlotRtMismatch) == round;
  if (mismatch) {
    uint8_t* out = static_cast<uint8_t*>(p.out);
    const int64_t n = (int64_t)p.local_num_tokens * row_bytes;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
      out[i] = 0;
    }
  }
  const bool overlap = p.overlap_stage_blocks > 0;  // the launcher decides (kVariantOverlap, enough to stage)
  const int nstage = p.overlap_stage_blocks;
  // kVariantOverlap: this rank's send counts, as positions (read before arriving: the last block zeroes them).
  __shared__ int s_pos[kMaxEpSize + 1];
  if (overlap && threadIdx.x == 0) {
    const int* send = at<int>(my_row, p.aux.send_counters);
    int acc = 0;
    for (int q = 0; q < ep; ++q) {
      s_pos[q] = acc;
      if (q != me) acc += min(max(ld_volatile(send + q), 0), p.rt);
    }
    s_pos[ep] = acc;
  }

  // 1. Stage the rows that were received (RECV_COUNTERS) into the own combine region.
  if (overlap) {
    if (static_cast<int>(blockIdx.x) < nstage) stage_slices(p, recv, round, nstage);
  } else if (!p.payload_in_workspace) {
    const uint32_t nthreads = gridDim.x * blockDim.x;  // the launcher keeps grids small
    const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t stride = nthreads / static_cast<uint32_t>(ep);
    const bool skip_self = self_from_payload(p);
    for (int s = 0; s < ep; ++s) {
      if (skip_self && s == me) continue;  // only this rank pulls its own rows: read from the payload
      int rows = ld_volatile(recv + s);
      rows = rows < 0 ? 0 : rows > p.rt ? p.rt : rows;
      const int64_t off = (int64_t)s * p.rt * row_bytes;
      // rotate the threads per source so that small copies spread over the grid
      const uint32_t my = (tid + static_cast<uint32_t>(s) * stride) % nthreads;
      copy_bytes<>(my_row + p.combine_offset + off, p.payload + off, rows * row_bytes, my, nthreads);
    }
  }

  // 2. Release; the last block tells every peer that its outputs are ready.
  const bool low_latency = (p.variant & kVariantLowLatency) != 0;
  const bool last = arrive_last(block_counters + kSlotCombine, low_latency, (p.variant & kVariantBlockFence) != 0);
  if (last) {
    const int q = threadIdx.x;
    if (q < ep) {
      st_release_sys(at<int>(row_of(p.ws, q), p.aux.combine_completion_flags + 4 * (int64_t)me), round);
      // The next dispatch counts from zero (it cannot zero them itself before its atomics).
      at<int>(my_row, p.aux.send_counters)[q] = 0;
    }
    if (threadIdx.x == 0) *at<int>(my_row, p.aux.flag_val) = round + 1;  // every block read R before arriving
  }

  // 3. Wait for every peer. Blocks with nothing to pull leave now; the last
  //    block always waits, so the launch never completes before every peer's
  //    outputs are ready (the next dispatch relies on that). With overlap only
  //    the last block waits here; the others wait per item (wait_slice).
  const PullGeometry g = pull_geometry<T, kVec, kVecs>(p.hidden);
  const uint32_t chunks = static_cast<uint32_t>(g.chunks);  // the launcher checks T * chunks < 2^31
  const uint32_t items = mismatch ? 0u : static_cast<uint32_t>(p.local_num_tokens) * chunks;
  constexpr uint32_t warps = kCombineThreads / 32;
  const uint32_t first_item = blockIdx.x * warps;
  int* claim = block_counters + p.aux.block_counter_slots - 1;
  int* give_up = block_counters + kSlotCombineGiveUp;
  if (!overlap && !last && first_item >= items) return;
  if ((last || !overlap) && !block_wait_flags(at<int>(my_row, p.aux.combine_completion_flags), ep, round, p.ctl,
                                              p.ctl.phase_combine, /*poller=*/last, claim, give_up, low_latency)) {
    return;
  }

  // 4. Pull and reduce.
  const int lane = threadIdx.x % 32;
  if (!overlap) {
    const uint32_t nw = gridDim.x * warps;
#pragma unroll 1
    for (uint32_t item = first_item + threadIdx.x / 32; item < items; item += nw) {
      const int t = static_cast<int>(item / chunks);
      int target, slot;
      token_sends(p, t, lane, &target, &slot);
      pull_item<T, kVec, kVecs>(p, t, item % chunks, g, lane, target, slot);
    }
    return;
  }
  const uint32_t ntok = static_cast<uint32_t>(p.local_num_tokens);
  const uint32_t total = mismatch ? 0u : ntok + static_cast<uint32_t>(s_pos[ep]) * chunks;  // launcher: < 2^31
  const int* slot_tokens = at<int>(my_row, p.aux.slot_tokens);
#pragma unroll 1
  for (;;) {
    uint32_t item = 0;
    if (lane == 0) item = static_cast<uint32_t>(atomicAdd(block_counters + kSlotPullWork, 1));
    item = __shfl_sync(kFullMask, item, 0);
    if (item >= total) break;
    int t, target, slot;
    if (item < ntok) {  // a token with no remote send: all of it, here (nobody waits for it)
      t = static_cast<int>(item);
      token_sends(p, t, lane, &target, &slot);
      if (__any_sync(kFullMask, target >= 0 && target != me)) continue;
      for (uint32_t c = 0; c < chunks; ++c) pull_item<T, kVec, kVecs>(p, t, c, g, lane, target, slot);
      continue;
    }
    const uint32_t pos = (item - ntok) / chunks, c = (item - ntok) % chunks;
    int q = 0;  // the target whose slot range holds pos: the last q with s_pos[q] <= pos
    for (int b = kMaxEpSize; b > 0; b >>= 1) {
      if (q + b < ep && static_cast<uint32_t>(s_pos[q + b]) <= pos) q += b;
    }
    t = slot_tokens[(int64_t)q * p.aux.max_num_tokens + (pos - s_pos[q])];
    if (t < 0 || t >= p.local_num_tokens) continue;  // never written this round: cannot happen
    token_sends(p, t, lane, &target, &slot);
    // The token's item belongs to its lowest remote target; the others skip it.
    const int primary = __reduce_min_sync(kFullMask, target >= 0 && target != me ? target : kMaxEpSize);
    if (primary != q) continue;
    bool ok = true;
    if (target >= 0 && target != me) ok = wait_slice(p, my_row, target, slot, round, give_up, claim);
    if (!__all_sync(kFullMask, ok)) return;  // __all_sync also orders the acquires before every lane's loads
    pull_item<T, kVec, kVecs>(p, t, c, g, lane, target, slot);
  }
}

// ---------------------------------------------------------------------------
// Initialize (tests; the daemon initializes rows itself)
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kInitializeThreads) initialize_kernel(const InitializeParams p) {
  const int64_t words = p.aux_bytes / 4;
  int32_t* w = reinterpret_cast<int32_t*>(p.row);
  const int64_t flag_word = p.flag_val / 4;
#pragma unroll 1
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < words; i += (int64_t)gridDim.x * blockDim.x) {
    w[i] = i == flag_word ? p.initial_round : 0;
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------
struct DeviceInfo {
  int device;
  int sms;
};

std::mutex g_mutex;
std::vector<DeviceInfo> g_devices;
std::vector<std::pair<std::pair<int, const void*>, int>> g_occupancy;

cudaError_t current_sms(int* device, int* sms) {
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  return sm_count(*device, sms);
}

cudaError_t occupancy(int device, const void* fn, int threads, int* out) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& e : g_occupancy) {
      if (e.first.first == device && e.first.second == fn) {
        *out = e.second;
        return cudaSuccess;
      }
    }
  }
  int n = 0;
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, 0);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_occupancy.push_back({{device, fn}, n});
  *out = n;
  return cudaSuccess;
}

// Blocks that fit at once on the SMs this launch may use.
cudaError_t resident_blocks(const void* fn, int threads, const LaunchLimits& lim, int* out) {
  int device = 0, sms = 0, occ = 0;
  cudaError_t err = current_sms(&device, &sms);
  if (err != cudaSuccess) return err;
  err = occupancy(device, fn, threads, &occ);
  if (err != cudaSuccess) return err;
  if (occ < 1) return cudaErrorLaunchOutOfResources;
  const int budget = lim.sm_budget > 0 && lim.sm_budget < sms ? lim.sm_budget : sms;
  *out = budget * occ;
  return cudaSuccess;
}

bool valid_workspace(const Workspace& ws) {
  return ws.base != nullptr && ws.ep_size >= 1 && ws.ep_size <= kMaxEpSize && ws.ep_rank >= 0 &&
         ws.ep_rank < ws.ep_size && ws.row_stride > 0;
}

bool valid_aux(const AuxOffsets& a) {
  return a.topk_stride >= 1 && a.block_counter_slots >= kMinBlockCounterSlots;
}

bool valid_control(const Control& c) { return c.block != nullptr && c.status_waited_ns % 8 == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

cudaError_t sm_count(int device, int* out) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& d : g_devices) {
      if (d.device == device) {
        *out = d.sms;
        return cudaSuccess;
      }
    }
  }
  int n = 0;
  cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_devices.push_back({device, n});
  *out = n;
  return cudaSuccess;
}

cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  if (!valid_workspace(p.ws) || !valid_aux(p.aux) || !valid_control(p.ctl)) return cudaErrorInvalidValue;
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > p.aux.topk_stride || p.num_experts < p.ws.ep_size ||
      p.local_num_tokens < 0 || p.local_num_tokens > p.rt || p.num_payloads < 0 || p.num_payloads > kMaxPayloads ||
      (p.local_num_tokens > 0 && p.experts == nullptr)) {
    return cudaErrorInvalidValue;
  }
  for (int i = 0; i < p.num_payloads; ++i) {
    if (p.payload_bytes[i] <= 0 || (p.local_num_tokens > 0 && p.payload[i] == nullptr)) return cudaErrorInvalidValue;
  }
  int resident = 0;
  cudaError_t err = resident_blocks(reinterpret_cast<const void*>(&dispatch_kernel), kDispatchThreads, p.lim, &resident);
  if (err != cudaSuccess) return err;
  // Tokens per block step: as few as fill the SMs (small T spreads each token
  // over a whole block), at most one routing warp per token.
  DispatchParams q = p;
  const int64_t tile = ceil_div(p.local_num_tokens, resident);
  q.tile_tokens = static_cast<int>(tile < 1 ? 1 : tile > kTileMax ? kTileMax : tile);
  const int64_t want = ceil_div(p.local_num_tokens, q.tile_tokens);
  const int grid = static_cast<int>(want < 1 ? 1 : want < resident ? want : resident);
  dispatch_kernel<<<grid, kDispatchThreads, 0, stream>>>(q);
  return cudaGetLastError();
}

cudaError_t launch_sanitize(const SanitizeParams& p, cudaStream_t stream) {
  if (!valid_workspace(p.ws) || p.ids == nullptr || p.rt < 1 || p.top_k < 1) return cudaErrorInvalidValue;
  const int64_t n = (int64_t)p.ws.ep_size * p.rt * p.top_k;
  if (n >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t want = ceil_div(n, kSanitizeThreads);
  const int grid = static_cast<int>(want < 1 ? 1 : want > 1024 ? 1024 : want);
  sanitize_kernel<<<grid, kSanitizeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

namespace {
template <typename T, bool kVec, int kVecs>
cudaError_t launch_combine_typed(const CombineParams& p, cudaStream_t stream) {
  const void* fn = reinterpret_cast<const void*>(&combine_kernel<T, kVec, kVecs>);
  int resident = 0;
  cudaError_t err = resident_blocks(fn, kCombineThreads, p.lim, &resident);
  if (err != cudaSuccess) return err;
  const PullGeometry g = pull_geometry<T, kVec, kVecs>(p.hidden);
  if ((int64_t)p.local_num_tokens * g.chunks >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t pull_blocks = ceil_div((int64_t)p.local_num_tokens * g.chunks, kCombineThreads / 32);
  if ((int64_t)p.local_num_tokens * (g.chunks + 1) >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t staged_sources = self_from_payload(p) ? p.ws.ep_size - 1 : p.ws.ep_size;
  const int64_t stage_blocks =
      p.payload_in_workspace ? 0 : ceil_div(staged_sources * p.rt * row_bytes, kCombineThreads * 16 * kCopyUnroll);
  int64_t want = pull_blocks > stage_blocks ? pull_blocks : stage_blocks;
  if (want < 1) want = 1;
  const int grid = static_cast<int>(want < resident ? want : resident);
  CombineParams q = p;
  q.overlap_stage_blocks = 0;
  const int64_t stage_bytes = staged_sources * p.rt * row_bytes;  // an upper bound (rt rows per source)
  if ((p.variant & kVariantOverlap) != 0 && !p.payload_in_workspace && p.ws.ep_size > 1 &&
      stage_bytes >= kOverlapMinBytes && row_bytes >= kOverlapMinRowBytes) {
    const int share = (p.variant >> kVariantStageShareShift) & 0xf;
    const int stagers = grid / (share > 0 ? share : kOverlapStageShare);
    q.overlap_stage_blocks = stagers < 1 ? 1 : stagers;
  }
  combine_kernel<T, kVec, kVecs><<<grid, kCombineThreads, 0, stream>>>(q);
  return cudaGetLastError();
}
}  // namespace

cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  if (!valid_workspace(p.ws) || !valid_aux(p.aux) || !valid_control(p.ctl)) return cudaErrorInvalidValue;
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > p.aux.topk_stride || p.hidden < 1 || p.rt < 1 ||
      p.local_num_tokens < 0 || p.local_num_tokens > p.rt || (p.local_num_tokens > 0 && p.out == nullptr) ||
      (!p.payload_in_workspace && p.payload == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int elem = p.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = p.hidden * elem;
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.ws.base + p.combine_offset) % 16 == 0 && p.ws.row_stride % 16 == 0 &&
                   (!self_from_payload(p) || reinterpret_cast<uintptr_t>(p.payload) % 16 == 0);
  const bool wide = (p.variant & kVariantWidePull) != 0;
  switch (p.dtype) {
    case DType::kFloat32:
      return vec ? (wide ? launch_combine_typed<float, true, 4>(p, stream)
                         : launch_combine_typed<float, true, kPullVecs>(p, stream))
                 : launch_combine_typed<float, false, kPullVecs>(p, stream);
    case DType::kFloat16:
      return vec ? (wide ? launch_combine_typed<__half, true, 4>(p, stream)
                         : launch_combine_typed<__half, true, kPullVecs>(p, stream))
                 : launch_combine_typed<__half, false, kPullVecs>(p, stream);
    case DType::kBFloat16:
      return vec ? (wide ? launch_combine_typed<__nv_bfloat16, true, 4>(p, stream)
                         : launch_combine_typed<__nv_bfloat16, true, kPullVecs>(p, stream))
                 : launch_combine_typed<__nv_bfloat16, false, kPullVecs>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_initialize(const InitializeParams& p, cudaStream_t stream) {
  if (p.row == nullptr || p.aux_bytes < 4 || p.aux_bytes % 4 != 0 || p.flag_val < 0 || p.flag_val % 4 != 0 ||
      p.flag_val >= p.aux_bytes || reinterpret_cast<uintptr_t>(p.row) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t want = ceil_div(p.aux_bytes / 4, kInitializeThreads);
  const int grid = static_cast<int>(want > 1024 ? 1024 : want);
  initialize_kernel<<<grid, kInitializeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace a2ad
