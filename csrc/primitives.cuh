// Device primitives the a2ad kernels share: memory-model loads/stores and fences,
// the status and input records, bounded waits, the last-block arrival, and copies.
// Header-only; every function is inline (each kernel file gets its own copy).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "moe_a2a.cuh"

namespace a2ad {
namespace dev {

constexpr unsigned kFullMask = 0xffffffffu;
// 16-byte vectors each lane keeps in flight per copy step.
constexpr int kCopyUnroll = 4;
// The abort word lives in host memory (a PCIe round trip, ~1 us): a poller reads it
// once every this many polls, the first time after that many.
constexpr uint32_t kAbortPollEvery = 64;
constexpr uint32_t kGiveUpPollEvery = 8;
constexpr uint32_t kSpinPolls = 16;

// kWaitLeft (degraded mode): the peer's bit was cleared from the active mask; it is no
// longer waited for, and that is not a failure.
enum WaitResult : int { kWaitOk = 0, kWaitTimeout = 1, kWaitAborted = 2, kWaitStopped = 3, kWaitLeft = 4 };

// ---------------------------------------------------------------------------
// Memory model
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

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
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

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A line: 16 bytes, two u64 words each accessed as one (an aligned 8-byte access is single-copy
// atomic), each word 4 bytes of data in its low half and a round in its high half: a reader
// that sees the round in both words sees both data halves of that round.
__device__ __forceinline__ void st_line(void* p, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

// A line word: 4 bytes of data in the low half, the round in the high half.
__device__ __forceinline__ uint64_t line_word(uint32_t data, uint32_t round) {
  return (static_cast<uint64_t>(round) << 32) | data;
}

// One line word alone (the FP8 lines' scale words).
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ ulonglong2 ld_line(const void* p) {
  ulonglong2 v;
  asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// A release add whose result nobody waits for (red: no round trip for the issuing thread).
__device__ __forceinline__ void red_add_release_gpu(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Programmatic dependent launch (the launchers allow it): a kernel may be scheduled while
// the kernel before it on the stream finishes. wait_prior_grid() returns once that kernel
// completed and its memory is visible (at once when there is no such dependency);
// every kernel calls it before touching memory. allow_dependents() lets the next kernel
// be scheduled (it still waits for this one's completion before touching memory).
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Thread-block clusters (sm_90 code only: the launchers start a cluster only where the
// kernel's code is sm_90 or later, launch::cluster_fits; elsewhere these trap).
// cluster_arrive_release: this thread's writes so far are released at cluster scope to the
// threads that wait on the cluster barrier; the thread may then exit (a wait counts only the
// threads that have not exited). cluster_wait: arrive (releasing nothing) and wait for every
// other thread of the cluster, acquiring what they released. A release at a wider scope by
// a waiting thread after that covers what the others wrote before their arrival (causality
// order is transitive), as the last block's st.release.sys after an arrival does.
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ int ld_volatile(const int* p) { return *reinterpret_cast<const volatile int*>(p); }

// A received count as a number of rows: [0, rt] (a count out of range moves nothing past the
// source's rt slots).
__device__ __forceinline__ int received_rows(int count, int rt) { return count < 0 ? 0 : count > rt ? rt : count; }

// Ask L2 for the 32-byte sectors of [p, p + bytes), lane `lane` of `lanes` taking every
// lanes-th sector. For the few words a kernel later hits with an atomic or a dependent
// read: asked for at entry, their HBM fetch overlaps the kernel's first loads instead
// of stalling it where they are used (every launch may find L2 cold).
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes, int lane, int lanes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = a & ~uintptr_t{31};
  const int sectors = static_cast<int>((a + bytes - first + 31) / 32);
  // (unroll 1: a few sectors per lane at most; unrolled, this loop was 2 KB of code on the
  //  entry path of every launch, fetched cold after an L2 flush)
#pragma unroll 1
  for (int i = lane; i < sectors; i += lanes) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(first + 32 * static_cast<uintptr_t>(i)));
  }
}

__device__ __forceinline__ uint8_t* row_of(const Workspace& ws, int q) { return ws.base + (int64_t)q * ws.row_stride; }

template <typename T>
__device__ __forceinline__ T* at(uint8_t* row, int64_t off) {
  return reinterpret_cast<T*>(row + off);
}

// The ready word of dispatch: what source s tells target q in one store. The low half is
// the round; the high half the count and, when the job's max_num_tokens (mnt) lets both
// fit in 32 bits, the source's rt too: rt * (mnt + 1) + count. Then the target learns both
// from the word it waited for, with no read of RECV_RTS after the wait.
__host__ __device__ __forceinline__ bool rt_in_ready_word(int mnt) {
  return mnt >= 0 && (int64_t)(mnt + 1) * (mnt + 1) <= (int64_t{1} << 32);
}

__host__ __device__ __forceinline__ uint64_t ready_word(int count, int rt, int mnt, int round) {
  uint32_t high = static_cast<uint32_t>(count);
  if (rt_in_ready_word(mnt)) {
    high = static_cast<uint32_t>(rt) * static_cast<uint32_t>(mnt + 1) + static_cast<uint32_t>(count);
  }
  return (static_cast<uint64_t>(high) << 32) | static_cast<uint32_t>(round);
}

// A 64-bit digest of a payload descriptor (layout.payload_spec, SPEC_WORDS words): what the
// dispatch digests carry (docs/PROTOCOL.md, "Dispatch digests"). Every word goes through the
// murmur3 64-bit finalizer, a bijection, chained, so that descriptors that differ in any word
// collide only by chance (2^-64).
__host__ __device__ __forceinline__ uint64_t spec_digest(const int32_t* spec) {
  uint64_t h = 0x243f6a8885a308d3ull ^ static_cast<uint64_t>(layout::SPEC_WORDS);
  for (int w = 0; w < layout::SPEC_WORDS; ++w) {
    h ^= static_cast<uint64_t>(static_cast<uint32_t>(spec[w])) + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(w + 1);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
  }
  return h;
}

// ---------------------------------------------------------------------------
// Status and input records (control block, host memory)
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ volatile T* cb_field(const Control& c, int64_t off) {
  return reinterpret_cast<volatile T*>(c.block + off);
}

// This rank's status record: fields first, the code last, each system-visible in that order.
__device__ inline void write_status(const Control& c, uint32_t code, int peer, int round, uint32_t phase,
                                    uint64_t waited) {
  const int64_t rec = layout::CB_STATUS + (int64_t)c.ep_rank * layout::STATUS_RECORD_SIZE;
  *cb_field<int32_t>(c, rec + layout::STATUS_PEER) = peer;
  *cb_field<uint32_t>(c, rec + layout::STATUS_ROUND) = static_cast<uint32_t>(round);
  *cb_field<uint32_t>(c, rec + layout::STATUS_PHASE) = phase;
  *cb_field<uint64_t>(c, rec + layout::STATUS_WAITED_NS) = waited;
  __threadfence_system();  // the host must never see the code before the fields
  *cb_field<uint32_t>(c, rec + layout::STATUS_CODE) = code;
  __threadfence_system();
}

// This rank's input record (what dispatch found wrong in the input while still
// completing the round for every rank), in the same order.
__device__ inline void write_input(const Control& c, uint32_t code, int index, int value, int round, int own = 0) {
  const int64_t rec = layout::CB_INPUT + (int64_t)c.ep_rank * layout::INPUT_RECORD_SIZE;
  *cb_field<int32_t>(c, layout::CB_INPUT_OWN + 4 * (int64_t)c.ep_rank) = own;
  *cb_field<int32_t>(c, rec + layout::INPUT_INDEX) = index;
  *cb_field<int32_t>(c, rec + layout::INPUT_VALUE) = value;
  *cb_field<uint32_t>(c, rec + layout::INPUT_ROUND) = static_cast<uint32_t>(round);
  __threadfence_system();
  *cb_field<uint32_t>(c, rec + layout::INPUT_CODE) = code;
  __threadfence_system();
}

// ---------------------------------------------------------------------------
// Bounded waits
// ---------------------------------------------------------------------------
// A flag that is ready when it holds `want` (int32), or, for a dispatch ready word,
// when its low half does (then `value` is its high half: the count).
struct FlagProbe {
  const int* flag;
  int want;
  __device__ __forceinline__ bool ready(int* /*value*/) const { return ld_acquire_sys(flag) == want; }
};

// A u64 ready word whose low half is the round: `value` gets the high half.
struct ReadyProbe {
  const uint64_t* word;
  int want;
  __device__ __forceinline__ bool ready(int* value) const {
    const uint64_t w = ld_acquire_sys_u64(word);
    if (static_cast<uint32_t>(w) != static_cast<uint32_t>(want)) return false;
    *value = static_cast<int>(w >> 32);
    return true;
  }
};

// ---------------------------------------------------------------------------
// Rank masks
// ---------------------------------------------------------------------------
// A set of ranks as W little-endian u64 words: rank q is bit (q & 63) of word (q >> 6).
// The kernels take W as a template parameter, chosen at launch from ep_size: 1 up to 64
// ranks (then every operation is the one of a plain u64), kMaskWords above. Indices are
// compile-time constants in every loop, so a mask stays in registers.
template <int W>
struct RankMask {
  static_assert(W >= 1 && W <= kMaskWords, "mask words");
  uint64_t w[W];

  __host__ __device__ __forceinline__ static RankMask all() {
    RankMask m;
#pragma unroll
    for (int i = 0; i < W; ++i) m.w[i] = ~0ull;
    return m;
  }
  __host__ __device__ __forceinline__ static RankMask none() {
    RankMask m;
#pragma unroll
    for (int i = 0; i < W; ++i) m.w[i] = 0;
    return m;
  }
  // The word holding rank q (0 <= q < 64 * W).
  __device__ __forceinline__ uint64_t word_of(int q) const {
    if constexpr (W == 1) {
      return w[0];
    } else {
      // (an OR of masked words, not a select: a select chain is folded into an indexed
      //  load, which puts the mask in local memory)
      const int k = q >> 6;
      uint64_t x = 0;
#pragma unroll
      for (int i = 0; i < W; ++i) x |= w[i] & (0ull - static_cast<uint64_t>(k == i));
      return x;
    }
  }
  // Whether rank q (0 <= q < 64 * W) is in the set.
  __device__ __forceinline__ bool has(int q) const {
    if constexpr (W == 1) return (w[0] >> q & 1) != 0;
    return (word_of(q) >> (q & 63) & 1) != 0;
  }
  __device__ __forceinline__ bool is_all() const {
    bool a = true;
#pragma unroll
    for (int i = 0; i < W; ++i) a = a && w[i] == ~0ull;
    return a;
  }
  __device__ __forceinline__ bool any() const {
    uint64_t o = 0;
#pragma unroll
    for (int i = 0; i < W; ++i) o |= w[i];
    return o != 0;
  }
  // The lowest rank in the set, -1 when it is empty.
  __device__ __forceinline__ int lowest() const {
    int r = -1;
#pragma unroll
    for (int i = W - 1; i >= 0; --i) {
      if (w[i] != 0) r = 64 * i + __ffsll(static_cast<long long>(w[i])) - 1;
    }
    return r;
  }
  __device__ __forceinline__ void clear(int q) {
    const int k = q >> 6;
    const uint64_t bit = 1ull << (q & 63);
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] &= ~(bit & (0ull - static_cast<uint64_t>(k == i)));
  }
  __device__ __forceinline__ RankMask operator&(const RankMask& o) const {
    RankMask m;
#pragma unroll
    for (int i = 0; i < W; ++i) m.w[i] = w[i] & o.w[i];
    return m;
  }
  __device__ __forceinline__ RankMask without(const RankMask& o) const {
    RankMask m;
#pragma unroll
    for (int i = 0; i < W; ++i) m.w[i] = w[i] & ~o.w[i];
    return m;
  }
  // Read from / written to W u64 words of memory (volatile: another kernel's or thread's).
  __device__ __forceinline__ static RankMask load(const void* p) {
    RankMask m;
    const volatile unsigned long long* v = reinterpret_cast<const volatile unsigned long long*>(p);
#pragma unroll
    for (int i = 0; i < W; ++i) m.w[i] = v[i];
    return m;
  }
  __device__ __forceinline__ void store(void* p) const {
    volatile unsigned long long* v = reinterpret_cast<volatile unsigned long long*>(p);
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = w[i];
  }
};

// Shared-memory words a block gathers a mask in (atomicOr of one rank's bit at a time).
template <int W>
__device__ __forceinline__ void shared_set(unsigned long long* s, int q) {
  if constexpr (W == 1) {
    atomicOr(s, 1ull << q);
  } else {
    atomicOr(s + (q >> 6), 1ull << (q & 63));
  }
}

template <int W>
__device__ __forceinline__ RankMask<W> shared_mask(const unsigned long long* s) {
  RankMask<W> m;
#pragma unroll
  for (int i = 0; i < W; ++i) m.w[i] = s[i];
  return m;
}

// The round's view with the caller's active-rank mask ANDed in (all ones: every rank, as
// without a mask in a job without degraded mode).
template <int W>
__device__ __forceinline__ RankMask<W> with_caller_mask(RankMask<W> view, const CallerMask& cm, int ep, bool degrade) {
  RankMask<W> m;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    m.w[i] = cm.value[i];
    if (cm.ptr != nullptr) {
      m.w[i] &= i < cm.words ? static_cast<uint64_t>(reinterpret_cast<const volatile int64_t*>(cm.ptr)[i]) : 0ull;
    }
  }
  if (m.is_all()) return view;
  view = view & m;
  bool every = !degrade;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const int n = ep - 64 * i;  // ranks of word i
    const uint64_t full = n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1;
    every = every && (view.w[i] & full) == full;
  }
  if (every) view = RankMask<W>::all();  // every rank: the plain path
  return view;
}

// Word (q >> 6) of the job's active mask: the one holding rank q's bit (degraded mode;
// host memory). The daemon may change the words of one update one at a time: a reader of
// one rank's bit reads only its word.
__device__ __forceinline__ uint64_t active_word(const Control& c, int q) {
  return ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(c.block + layout::CB_ACTIVE_MASK) + (q >> 6));
}

// Spin until the probe is ready (acquire), the deadline passes, or the wait is
// called off. The launch's *poller* block reads the job's abort word (host memory,
// first after kAbortPollEvery polls, then every kAbortPollEvery) and gives up after
// c.timeout_ns. Other waiting blocks watch `give_up` (device memory) instead, where
// the poller posts the round it gave up on; their own deadline is twice as long, a
// backstop only: they started waiting before the poller did (it is the last block
// to arrive), and a flag the poller saw can no longer change before this launch
// ends, so they cannot miss what the poller saw. Any thread also stops once another
// thread of its block gave up (*stop). With watch >= 0 (degraded mode, the poller) the
// abort-word polls also read the active mask and the wait ends with kWaitLeft once bit
// `watch` is cleared.
template <typename Probe>
__device__ __forceinline__ int spin_wait(const Probe& probe, int round, const Control& c, bool poller, const int* give_up,
                         const volatile int* stop, uint64_t* waited, int* value, int watch = -1) {
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(c.block + layout::CB_ABORT);
  const uint64_t limit = poller ? c.timeout_ns : 2 * c.timeout_ns;
  const uint64_t t0 = global_timer_ns();
  for (uint32_t it = 0;; ++it) {
    if (probe.ready(value)) return kWaitOk;
    const uint64_t now = global_timer_ns();
    *waited = now - t0;
    if (poller) {
      if (it % kAbortPollEvery == kAbortPollEvery - 1) {
        // the probe was read before the abort word and the mask: a peer may have published,
        // finished its round and left in between; what it published is complete, so one
        // more look (ordered after the read that saw it leave) decides
        int why = kWaitOk;
        if (ld_relaxed_sys_u32(abort_word) != 0) why = kWaitAborted;
        else if (watch >= 0 && (active_word(c, watch) >> (watch & 63) & 1) == 0) why = kWaitLeft;
        if (why != kWaitOk) {
          fence_acq_rel_sys();
          return probe.ready(value) ? kWaitOk : why;
        }
      }
    } else {
      // (the give-up word every kGiveUpPollEvery polls, not in every one: each read is a
      // round trip that would delay seeing the flag; sleeps only after kSpinPolls polls)
      if (it % kGiveUpPollEvery == kGiveUpPollEvery - 1 && ld_volatile(give_up) == round) return kWaitStopped;
      if (it >= kSpinPolls) __nanosleep(64);  // many blocks may wait: keep their polls off the flags' L2 lines
    }
    if (now - t0 >= limit) return kWaitTimeout;
    if (*stop) return kWaitStopped;
  }
}

// What a thread that gave up on its own does: post the round to *give_up (the
// launch's other waiting blocks stop too) and write the status record unless
// another thread of this rank already did (claimed through *claim, device memory).
__device__ inline void give_up_wait(const Control& c, int result, int peer, int round, uint32_t phase,
                                    uint64_t waited, int* claim, int* give_up) {
  *reinterpret_cast<volatile int*>(give_up) = round;
  if (atomicCAS(claim, 0, 1) == 0) {
    write_status(c, result == kWaitTimeout ? layout::STATUS_TIMEOUT : layout::STATUS_ABORTED, peer, round, phase,
                 waited);
  }
}

// A wait of one thread that leaves the job's abort word to the launch's poller (it waits for
// the launch's own blocks, or for what the poller or a peer writes while the poller watches):
// polls ready() (0: not yet) until it returns a result, which this returns; or until
// *give_up holds the round (when give_up_watch: the poller gave up), or `limit` ns passed:
// then it posts the round to *give_up, writes the status record (TIMEOUT naming `peer`)
// unless another thread had, and returns 0. The first `spins` polls are back to back, then it
// sleeps between them.
template <typename Ready>
__device__ __forceinline__ int local_wait(Ready ready, const Control& c, int peer, int round, uint32_t phase,
                                          uint64_t limit, uint32_t spins, bool give_up_watch, int* claim,
                                          int* give_up) {
  uint64_t t0 = 0;
#pragma unroll 1
  for (uint32_t it = 0;; ++it) {
    const int r = ready();
    if (r != 0) return r;
    if (give_up_watch && ld_volatile(give_up) == round) return 0;
    const uint64_t now = global_timer_ns();
    if (it == 0) t0 = now;
    if (now - t0 >= limit) {
      give_up_wait(c, kWaitTimeout, peer, round, phase, now - t0, claim, give_up);
      return 0;
    }
    if (it >= spins) __nanosleep(64);
  }
}

// Threads [0, ep_size) of the block each wait for peer q's probe (probe_of(q)); the
// block must have at least ep_size threads (every launch that waits has kMaxEpSize).
// Returns true (in every thread) when the wait completed; `value` gets what the probe
// read (the count of a ready word). Degraded mode (`view` not all ones, the poller only):
// only the peers of the view are waited for, a peer whose bit is cleared meanwhile is let
// go, and *seen gets (in every thread) the peers whose probe was ready (otherwise: all
// ones). With `bad` (combine): *bad gets (in every thread) the peers whose probe value
// differs from `expect` (their descriptor is not this rank's).
template <int W, typename ProbeOf>
__device__ __forceinline__ bool block_wait(ProbeOf probe_of, int ep_size, int round, const Control& c, uint32_t phase,
                                           bool poller, int* claim, int* give_up, int* value, const RankMask<W>& view,
                                           RankMask<W>* seen = nullptr, RankMask<W>* bad = nullptr, int expect = 0) {
  __shared__ int s_stop;
  __shared__ unsigned long long s_seen[W], s_bad[W];
  volatile int* stop = &s_stop;
  if (threadIdx.x == 0) {
    *stop = 0;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      s_seen[i] = 0;
      s_bad[i] = 0;
    }
  }
  __syncthreads();
  const int q = threadIdx.x;
  const bool degrade = !view.is_all();
  if (q < ep_size && view.has(q)) {
    uint64_t waited = 0;
    const int r = spin_wait(probe_of(q), round, c, poller, give_up, stop, &waited, value, degrade && c.degrade ? q : -1);
    if (r == kWaitOk) {
      if (degrade) shared_set<W>(s_seen, q);
      if (bad != nullptr && *value != expect) shared_set<W>(s_bad, q);
    } else if (r != kWaitLeft) {
      *stop = 1;
      if (r != kWaitStopped) give_up_wait(c, r, q, round, phase, waited, claim, give_up);
    }
  }
  __syncthreads();
  if (seen != nullptr) *seen = degrade ? shared_mask<W>(s_seen) : RankMask<W>::all();
  if (bad != nullptr) *bad = shared_mask<W>(s_bad);
  return *stop == 0;
}

// ---------------------------------------------------------------------------
// Last-block arrival
// ---------------------------------------------------------------------------
// What the blocks publish through the arrival: kRemote, writes into peers' memory
// (dispatch's payload stores); kLocal, writes into this GPU's memory only (combine's
// staging), which peers read through this GPU's L2.
enum class Writes { kRemote, kLocal };

// Whether a kRemote arrival fences (fence.acq_rel.sys) before its atomic. Without it (the
// default), the gpu-scope acq_rel arrival releases the block's peer stores to the last
// block and the last block's st.release.sys covers them for the peers: causality order is
// transitive, and each pair synchronizes at a scope that holds both of its threads (the
// argument kLocal relies on; the memory model does not tell local from peer memory).
// A2AD_REMOTE_ARRIVAL_FENCE=1 builds the fenced arrival (for timing it against this).
#ifndef A2AD_REMOTE_ARRIVAL_FENCE
#define A2AD_REMOTE_ARRIVAL_FENCE 0
#endif
constexpr bool kRemoteArrivalFence = A2AD_REMOTE_ARRIVAL_FENCE != 0;

// After __syncthreads, thread 0 arrives on *counter. Returns true (in every thread) in
// the block that arrived last; that block resets the counter for the next launch, and
// the caller publishes with st.release.sys after this call.
// - The arrival is a gpu-scope acq_rel atomic: it releases the block's writes, ordered
//   before it by the barrier, to the last block, whose system-scope release then covers
//   them for the peers (see kRemoteArrivalFence; kRemote with the fence: thread 0 first
//   runs fence.acq_rel.sys, which makes the block's writes visible system-wide by itself,
//   as in a cooperative-groups grid sync).
// A grid of one block needs neither counter nor fence: it is the last block, and the
// caller's st.release.sys after this barrier is itself a release covering every write
// the barrier ordered before it.
// skip_fence / double_fence: timing diagnostics only (kRemote): no fence even where the
// build fences; one fence more than the build has (its cost, by addition).
__device__ inline bool arrive_last(int* counter, Writes writes, bool skip_fence = false, bool double_fence = false) {
  __shared__ int s_last;
  __syncthreads();
  if (gridDim.x == 1) return true;
  if (threadIdx.x == 0) {
    if (writes == Writes::kRemote && !skip_fence) {
      if (kRemoteArrivalFence) fence_acq_rel_sys();
      if (double_fence) fence_acq_rel_sys();
    }
    const int last = atomic_add_acq_rel_gpu(counter, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) *reinterpret_cast<volatile int*>(counter) = 0;  // the next launch counts from zero
    s_last = last;
  }
  __syncthreads();
  return s_last != 0;
}

// ---------------------------------------------------------------------------
// Copies
// ---------------------------------------------------------------------------
// Where vector v of a copy lies in both buffers: v itself (a plain range), or, with
// SkipRange, v past [skip, skip + len) (one copy of the regions either side of a gap).
struct Contiguous {
  __device__ __forceinline__ int64_t operator()(int64_t v) const { return v; }
};

struct SkipRange {
  int64_t skip, len;
  __device__ __forceinline__ int64_t operator()(int64_t v) const { return v < skip ? v : v + len; }
};

// Vectors [0, n) (placed by `place`) from src to dst, threads tid of nthreads
// cooperating, kUnroll loads in flight per thread.
template <typename V, int kUnroll, bool kBatchRest, typename Place = Contiguous>
__device__ __forceinline__ void copy_vectors(uint8_t* dst, const uint8_t* src, int64_t n, int64_t tid, int64_t nthreads,
                                             Place place = Place{}) {
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  int64_t i = tid;
  // (unroll 1: the unrolled body already keeps kUnroll loads in flight, and
  //  it spares a 64-bit trip-count division)
#pragma unroll 1
  for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[place(i + u * nthreads)];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[place(i + u * nthreads)] = r[u];
  }
  // The rest (fewer than kUnroll vectors per thread). kBatchRest: every load is issued
  // before the first store. A plain loop waits for each load in turn (a store may alias
  // the next load), so a small copy from cold memory pays that latency up to kUnroll - 1
  // times; batched, the rest costs kUnroll - 1 more registers per vector.
  if constexpr (kBatchRest && kUnroll > 1) {
    V r[kUnroll - 1];
#pragma unroll
    for (int u = 0; u < kUnroll - 1; ++u) {
      if (i + u * nthreads < n) r[u] = s[place(i + u * nthreads)];
    }
#pragma unroll
    for (int u = 0; u < kUnroll - 1; ++u) {
      if (i + u * nthreads < n) d[place(i + u * nthreads)] = r[u];
    }
  } else {
#pragma unroll 1
    for (; i < n; i += nthreads) d[place(i)] = s[place(i)];
  }
}

// Copy n bytes with the widest access both pointers allow (16/8/4/2/1 bytes),
// threads tid of nthreads cooperating, kUnroll accesses in flight per thread.
// Any width, any alignment. kBatchRest: see copy_vectors (for callers with registers to spare).
template <int kUnroll = kCopyUnroll, bool kBatchRest = false>
__device__ inline void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, int64_t tid, int64_t nthreads) {
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
    case 4: copy_vectors<uint4, kUnroll, kBatchRest>(dst, src, nv, tid, nthreads); break;
    case 3: copy_vectors<uint2, kUnroll, kBatchRest>(dst, src, nv, tid, nthreads); break;
    case 2: copy_vectors<uint32_t, kUnroll, kBatchRest>(dst, src, nv, tid, nthreads); break;
    case 1: copy_vectors<uint16_t, kUnroll, kBatchRest>(dst, src, nv, tid, nthreads); break;
    default: copy_vectors<uint8_t, kUnroll, kBatchRest>(dst, src, nv, tid, nthreads); break;
  }
  for (int64_t b = (nv << shift) + tid; b < n; b += nthreads) dst[b] = src[b];
}

}  // namespace dev
}  // namespace a2ad
