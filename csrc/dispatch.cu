// Dispatch: route every token to the ranks that own its experts, copy its payloads
// into their rows, and tell every peer how many tokens it got, in one ready word.
// The scheme is described in csrc/README.md ("Dispatch").
#include "primitives.cuh"
#include "launch.cuh"

namespace a2ad {
namespace {

using namespace dev;

constexpr int kThreads = 256;
static_assert(kThreads >= kMaxEpSize, "block_wait and the per-peer steps take a thread per rank");
static_assert(kMaxEpSize <= 256, "a spec mismatch's input record packs the peer in 8 bits (peer | field << 8)");
constexpr int kWarps = kThreads / 32;
// Tokens routed per block step (one routing warp each).
constexpr int kTileMax = kWarps;
// Copy items a warp holds in registers at once (their loads are in flight together).
constexpr int kBatch = 2;

__device__ __forceinline__ bool diag(const DispatchParams& p, int bit) { return kTimingBuild && (p.diag & bit) != 0; }

__device__ __forceinline__ int expert_owner(int e, int num_experts, int ep_size) {
  const int base = num_experts / ep_size, rem = num_experts % ep_size;
  const int split = rem * (base + 1);
  return e < split ? e / (base + 1) : rem + (e - split) / base;
}

// Per-block routing of the current tile: for token w of the tile, lane k of
// target/slot holds send (w, k); sends[w] is the mask of the token's sends.
struct TileRouting {
  int target[kTileMax][32];
  int slot[kTileMax][32];
  unsigned sends[kTileMax];
  int pair_id[kTileMax];  // low-latency pairs: token w's expert id
};

// Low-latency pairs: the expert id of pair u (< 0: none; an int64 id past int32 stays
// outside [0, num_experts)).
__device__ __forceinline__ int pair_expert(const DispatchParams& p, int u) {
  if (p.pair_ids64 == nullptr) return p.experts[u] < 0 ? -1 : p.experts[u];
  const int64_t v = p.pair_ids64[u];
  return v < 0 ? -1 : v > INT32_MAX ? INT32_MAX : static_cast<int>(v);
}

// The row of payload i that token t sends (low-latency pairs: payload 0 is per token of the
// caller, one row per pair_group pairs).
template <bool kPairs>
__device__ __forceinline__ int64_t source_row(const DispatchParams& p, int i, int t) {
  if constexpr (kPairs) {
    if (i == 0) return t / p.pair_group;
  }
  return t;
}

// How each payload is cut into copy items (planned on the host, plan_items): with 16-byte
// rows and pointers a chunk is 32 lanes x kCopyUnroll vectors, loaded once and stored to
// every send; otherwise the item is the whole row, copied with the widest access the
// alignment allows.
struct Items {
  int chunks[kMaxPayloads];
  bool vec16[kMaxPayloads];
  int per_token;

  __device__ explicit Items(const DispatchParams& p) : per_token(p.items_per_token) {
#pragma unroll
    for (int i = 0; i < kMaxPayloads; ++i) {
      chunks[i] = p.item_chunks[i];
      vec16[i] = (p.item_vec16 >> i & 1) != 0;
    }
  }

  // item -> (tile token w, payload i, chunk c)
  __device__ __forceinline__ void decode(int item, int* w, int* i, int* c) const {
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

  __device__ __forceinline__ bool is_vec16(int i) const {
    bool v = false;
#pragma unroll
    for (int j = 0; j < kMaxPayloads; ++j) v = j == i ? vec16[j] : v;  // constant indices: stays in registers
    return v;
  }
};

// One copy item in flight: where it comes from and, for a 16-byte chunk, its loaded data.
struct Item {
  int w, i, c;    // tile token, payload, chunk; w < 0: none
  bool vec16;
  uint4 r[kCopyUnroll];
};

template <bool kPairs>
__device__ __forceinline__ void load_item(const DispatchParams& p, const Items& items, int t0, int item, int nitems,
                                          int lane, Item& it) {
  it.w = -1;
  if (item >= nitems) return;
  items.decode(item, &it.w, &it.i, &it.c);
  it.vec16 = items.is_vec16(it.i);
  if (!it.vec16 || diag(p, kDiagSkipCopy)) return;
  const int64_t nb = p.payload_bytes[it.i];
  const int64_t nvec = nb / 16;
  const int64_t v0 = (int64_t)it.c * 32 * kCopyUnroll;
  const uint4* src = reinterpret_cast<const uint4*>(p.payload[it.i] + source_row<kPairs>(p, it.i, t0 + it.w) * nb);
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    it.r[u] = v < nvec ? src[v] : make_uint4(0, 0, 0, 0);
  }
}

// A row whose size or address is not a multiple of 16 bytes, copied by a warp (out of line:
// the common 16-byte rows keep this code out of their path).
__device__ __noinline__ void copy_row_unaligned(uint8_t* dst, const uint8_t* src, int64_t nb, int lane) {
  copy_bytes<>(dst, src, nb, lane, 32);
}

// Store the item to every send of its token (routing must be in `tr`).
// kOutOfLine: an unaligned row is copied by copy_row_unaligned (with up to 64 ranks; the
// wider masks' kernels keep it inline, where the call would spill registers).
template <bool kPairs, bool kOutOfLine>
__device__ __forceinline__ void store_item(const DispatchParams& p, const TileRouting& tr, int t0, int lane,
                                           const Item& it) {
  if (it.w < 0 || diag(p, kDiagSkipCopy)) return;
  const int64_t nb = p.payload_bytes[it.i];
  const int64_t region = p.payload_offset[it.i] + (int64_t)p.ws.ep_rank * p.rt * nb;
  const unsigned sends = tr.sends[it.w];
  if (it.vec16) {
    const int64_t nvec = nb / 16;
    const int64_t v0 = (int64_t)it.c * 32 * kCopyUnroll;
    for (unsigned m = sends; m != 0; m &= m - 1) {
      const int k = __ffs(m) - 1;
      uint4* dst = reinterpret_cast<uint4*>(row_of(p.ws, tr.target[it.w][k]) + region + (int64_t)tr.slot[it.w][k] * nb);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t v = v0 + u * 32 + lane;
        if (v < nvec) dst[v] = it.r[u];
      }
    }
  } else {
    if constexpr (kPairs) {
      if (it.i == p.num_payloads - 1) {  // the pair's metadata: (token, expert id), written here
        if (lane == 0) {
          for (unsigned m = sends; m != 0; m &= m - 1) {
            const int k = __ffs(m) - 1;
            int* dst = reinterpret_cast<int*>(row_of(p.ws, tr.target[it.w][k]) + region + (int64_t)tr.slot[it.w][k] * nb);
            dst[0] = (t0 + it.w) / p.pair_group;
            dst[1] = tr.pair_id[it.w];
          }
        }
        return;
      }
    }
    const uint8_t* src = p.payload[it.i] + source_row<kPairs>(p, it.i, t0 + it.w) * nb;
    for (unsigned m = sends; m != 0; m &= m - 1) {
      const int k = __ffs(m) - 1;
      uint8_t* dst = row_of(p.ws, tr.target[it.w][k]) + region + (int64_t)tr.slot[it.w][k] * nb;
      if constexpr (kOutOfLine) {
        copy_row_unaligned(dst, src, nb, lane);
      } else {
        copy_bytes<>(dst, src, nb, lane, 32);
      }
    }
  }
}

// The bad-id word of the round, taken (and cleared) by the last block once routing is over.
__device__ __forceinline__ unsigned long long take_bad_expert(int* block_counters) {
  auto* bad = reinterpret_cast<volatile unsigned long long*>(block_counters + layout::SLOT_BAD_EXPERT);
  const unsigned long long inv = *bad;
  if (inv != 0) *bad = 0;
  return inv;
}

// The field a payload descriptor's first differing word w names (layout.spec_mismatch),
// with both values (*a: this rank's, *b: the peer's; for the dtype word, the codes).
__device__ __forceinline__ int spec_field(int w, int* a, int* b) {
  if (w == 0) return layout::SPEC_FIELD_COUNT;
  if (w <= kMaxPayloads) return layout::SPEC_FIELD_WIDTH + w - 1;
  if (w == 7) {
    const int x = *a ^ *b;
    const int i = (__ffs(x) - 1) / 4;  // the lowest payload whose code differs
    *a = *a >> (4 * i) & 15;
    *b = *b >> (4 * i) & 15;
    return layout::SPEC_FIELD_DTYPE + i;
  }
  if (w == 8) return layout::SPEC_FIELD_EPLB;
  return layout::SPEC_FIELD_COUNT;
}

// The dispatch digests of a row (docs/PROTOCOL.md, "Dispatch digests"): in its lines tail's
// heads page, a line per source; null where the job's rows have no lines tail.
__device__ __forceinline__ uint4* dispatch_digests(const DispatchParams& p, uint8_t* row) {
  return p.aux.lines_tail != 0 ? at<uint4>(row, p.aux.lines_tail + layout::DISPATCH_DIGESTS_OFFSET) : nullptr;
}

// This rank's digest line, R in both words, into the rows of the round's ranks (lanes of one
// warp; a job with a lines tail has at most 64 ranks). The release of the ready words covers it.
template <int W>
__device__ __forceinline__ void store_digests(const DispatchParams& p, const RankMask<W>& view, int round, int lane) {
  const uint64_t a = line_word(static_cast<uint32_t>(p.spec_digest), static_cast<uint32_t>(round));
  const uint64_t b = line_word(static_cast<uint32_t>(p.spec_digest >> 32), static_cast<uint32_t>(round));
#pragma unroll 1  // (at most two steps: up to 64 ranks; unrolled, it was 2.9 KB of code at each call)
  for (int q = lane; q < p.ws.ep_size; q += 32) {
    if (view.has(q)) st_line(dispatch_digests(p, row_of(p.ws, q)) + p.ws.ep_rank, a, b);
  }
}

// Probe of the ready word peer q wrote into this rank's row. With digests, each poll also
// reads q's digest line (before the ready word, so both loads are in flight together); once
// the ready word holds the round, *same says whether that line held the round in both words
// and this rank's digest: then q's descriptor is this rank's and need not be read.
struct ReadyProbeDigest {
  ReadyProbe word;
  const uint4* digest;  // null: no digests
  uint64_t mine;
  bool* same;
  __device__ __forceinline__ bool ready(int* value) const {
    ulonglong2 d = make_ulonglong2(0, 0);
    if (digest != nullptr) d = ld_line(digest);
    if (!word.ready(value)) return false;
    const uint32_t r = static_cast<uint32_t>(word.want);
    *same = d.x == line_word(static_cast<uint32_t>(mine), r) && d.y == line_word(static_cast<uint32_t>(mine >> 32), r);
    return true;
  }
};

struct ReadyWords {
  const uint64_t* words;
  int round;
  const uint4* digests;
  uint64_t mine;
  bool* same;
  __device__ ReadyProbeDigest operator()(int q) const {
    return ReadyProbeDigest{ReadyProbe{words + q, round}, digests != nullptr ? digests + q : nullptr, mine, same};
  }
};

// Grid: any size >= 1. A block takes tiles of p.tile_tokens consecutive tokens
// (grid-stride): warp w routes token w of the tile; the block's warps copy (token,
// payload, chunk) items, kBatch at a time per warp; warps that route nothing take the
// first items and load them before the routing is done. No block waits on another: the last
// block to arrive publishes one ready word per peer and is the only one that waits.
// W: the words of a rank mask (1 when ep_size <= 64). kPairs: low-latency pairs
// (DispatchParams says what). kPlain: only a round that is not degraded and gathers no
// EPLB statistics (the code of those two is left out: a smaller kernel, whose code a round
// after an L2 flush fetches cold). kSmall (with kPlain): a launch whose tiles hold fewer tokens
// than the block has warps (p.tile_tokens < kWarps, small T), so every tile has warps that
// route nothing; its early and later copy passes share one run of code, with no branch over
// the other's code on the path (the general form keeps them apart: with full tiles, large
// T, the shared loop measured 1% slower at hidden 7168). kCluster (with kSmall, not kPairs):
// a launch of one token as one cluster of gridDim.x blocks. Each block routes the token (one
// token: every target's slot is 0 in each block's own count, so all agree) and copies its
// share of the items, so that the stores leave from several SMs (one SM's stores are the
// bound: about 43 GB/s); block 0 alone writes the routing arrays, records a bad id, and,
// once every other block arrived on the cluster barrier (in place of the arrival counter),
// publishes and waits.
template <int W, bool kPairs, bool kPlain = false, bool kSmall = false, bool kCluster = false>
__global__ void __launch_bounds__(kThreads) dispatch_kernel(const DispatchParams p) {
  static_assert(!kCluster || (kSmall && !kPairs), "the cluster form is the small form of one token");
  constexpr int kRanks = 64 * W;  // the most ranks this instantiation serves
  const bool degrade = !kPlain && p.ctl.degrade;
  const int eplb_experts = p.eplb_experts;  // (read once, at entry)
  __shared__ TileRouting tr;
  __shared__ int s_count[kRanks];
  wait_prior_grid();
  if (diag(p, kDiagNoop)) return;
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  int* send_counters = at<int>(my_row, p.aux.send_counters);
  int* block_counters = at<int>(my_row, p.aux.block_counters);
  int* topk_target = at<int>(my_row, p.aux.topk_target_ranks);
  int* topk_send = at<int>(my_row, p.aux.topk_send_indices);
  int* slot_tokens = at<int>(my_row, p.aux.slot_tokens);
  // R: only combine changes it, and the previous combine finished before this launch
  // (in degraded mode the prologue may have set it: a replacement's first round).
  const int round = ld_volatile(at<int>(my_row, p.aux.flag_val));
  // Degraded mode: the ranks of this round, as the prologue read them; a round whose
  // prologue gave up (or found this rank gone) does not run here.
  RankMask<W> view = RankMask<W>::all();
  if (degrade) {
    if (ld_volatile(block_counters + layout::SLOT_VIEW_ROUND) != round) return;
    view = RankMask<W>::load(block_counters + layout::SLOT_VIEW);
  }
  view = with_caller_mask<W>(view, p.caller_mask, ep, degrade);
  // A one-block launch numbers its sends in shared memory (no global atomics); so does each
  // block of the cluster form, where block 0 leads: it alone writes what the routing records.
  const bool one_block = kCluster || gridDim.x == 1;
  const bool lead = !kCluster || blockIdx.x == 0;
  // The words this launch's atomics and its last block hit: fetched into L2 now, while
  // the routing reads the expert ids (they would be two more cold misses after it).
  if (threadIdx.x < 32) {
    prefetch_l2(block_counters, 4 * layout::BLOCK_COUNTER_SLOTS, threadIdx.x, 32);
    if (!one_block) prefetch_l2(send_counters, 4 * ep, threadIdx.x, 32);
    if constexpr (!kPairs) {
      // the expert ids of this block's first tile: the routing's first cold read, which it
      // issues only once its code (a branch away) is fetched
      const int t0 = blockIdx.x * p.tile_tokens;
      if (t0 < p.local_num_tokens) {
        prefetch_l2(p.experts + (int64_t)t0 * p.top_k, 4 * min(p.tile_tokens, p.local_num_tokens - t0) * p.top_k,
                    threadIdx.x, 32);
      }
    }
  }
  // The ready word carries rt with the count (job-wide: max_num_tokens is the same everywhere).
  const int mnt = p.aux.max_num_tokens;
  const bool compact = rt_in_ready_word(mnt);
  if (blockIdx.x == 0) {
    const int q = threadIdx.x;
    if (!compact && q < ep && view.has(q)) {
      // Every peer checks this rank's rt against its own; the fence (or release) before
      // the ready word covers this store. (Compact: the ready word carries rt.)
      *reinterpret_cast<volatile int*>(row_of(p.ws, q) + p.aux.recv_rts + 4 * (int64_t)me) = p.rt;
    }
    if (q < ep && view.has(q)) {
      // The payload descriptor: every peer compares it with its own after the wait (the
      // fence or release before the ready word covers these stores).
      uint4* d = reinterpret_cast<uint4*>(row_of(p.ws, q) + p.aux.recv_specs + 4 * layout::SPEC_WORDS * (int64_t)me);
#pragma unroll
      for (int w = 0; w < layout::SPEC_WORDS / 4; ++w) {
        d[w] = make_uint4(p.spec[4 * w], p.spec[4 * w + 1], p.spec[4 * w + 2], p.spec[4 * w + 3]);
      }
    }
    if constexpr (!kPlain) {  // (plain: none, and no division by the zero eplb_experts is there)
      if (eplb_experts > 0) {
        // EPLB statistics: this rank's row of every peer's region (covered like the above).
        const int E = eplb_experts;
        for (int i = threadIdx.x; i < ep * E; i += blockDim.x) {
          const int tq = i / E, e = i - tq * E;
          if (view.has(tq)) {
            at<int32_t>(row_of(p.ws, tq), p.eplb_offset)[(int64_t)me * E + e] = p.eplb_local[e];
          }
        }
      }
    }
    if (one_block && q < ep) s_count[q] = 0;
    if (threadIdx.x == 0) {
      *at<int>(my_row, p.aux.local_token_counter) = p.local_num_tokens;
      block_counters[layout::SLOT_PULL_WORK] = 0;  // the next combine's item counter (the previous combine is over)
    }
    if (one_block) __syncthreads();
  } else if constexpr (kCluster) {
    if (threadIdx.x < ep) s_count[threadIdx.x] = 0;
    __syncthreads();
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Items items(p);
  const int tile = p.tile_tokens;
  // The dispatch digests go out from block 0's last warp: in its first tile where it routes
  // nothing (its item loads issued, it waits there for the round word, loaded at entry, not a
  // routing warp), else after the tiles. (W > 1: no lines tail, no digests.)
  bool digest_warp = W == 1 && p.aux.lines_tail != 0 && blockIdx.x == 0 && warp == kWarps - 1;

  // Routing: lane k of warp w handles (t0 + w, k) of the tile. A send is the smallest k with
  // its target.
  auto route = [&](int t) {
    int target = -1;
    if (lane < p.top_k) {
      int e;
      if constexpr (kPairs) {
        e = pair_expert(p, t);  // (top_k is 1)
        tr.pair_id[warp] = e;
      } else {
        e = p.experts[(int64_t)t * p.top_k + lane];
      }
      if (e >= 0 && e < p.num_experts) {
        target = expert_owner(e, p.num_experts, ep);
      } else if ((!kPairs || e >= 0) && lead) {  // routed nowhere; the smallest (token, id) is reported after the round
        const unsigned long long key =
            (static_cast<unsigned long long>(static_cast<uint32_t>(t)) << 32) | static_cast<uint32_t>(e);
        atomicMax(reinterpret_cast<unsigned long long*>(block_counters + layout::SLOT_BAD_EXPERT), ~key);
      }
    }
    const unsigned same = __match_any_sync(kFullMask, target);
    // The first (t, k) of each target; in degraded mode one whose target is not in the
    // round's view is dropped: TOPK_TARGET_RANKS keeps the target, no slot, nothing sent.
    const bool first_k = target >= 0 && __ffs(same) - 1 == lane;
    const bool is_send = first_k && view.has(target);
    int slot = -1;
    if (is_send) slot = one_block ? atomicAdd(s_count + target, 1) : atomicAdd(send_counters + target, 1);
    if (is_send && slot < p.rt && lead) slot_tokens[(int64_t)target * p.aux.max_num_tokens + slot] = t;
    if (lane < p.top_k && lead) {
      topk_target[(int64_t)t * p.aux.topk_stride + lane] = first_k ? target : -1;
      topk_send[(int64_t)t * p.aux.topk_stride + lane] = is_send ? slot : -1;
    }
    tr.target[warp][lane] = target;
    tr.slot[warp][lane] = slot;
    // slot < T <= rt always holds (one send per token and target); never write
    // outside the region even if it did not.
    const unsigned sends = __ballot_sync(kFullMask, is_send && slot < p.rt);
    if (lane == 0) tr.sends[warp] = sends;
  };

  // The cluster form: every block takes the one tile, and its items go round-robin over the
  // blocks (item j to block j % nb), nb = 1 elsewhere.
  const int nb = kCluster ? gridDim.x : 1, bi = kCluster ? blockIdx.x : 0;
#pragma unroll 1
  for (int t0 = kCluster ? 0 : blockIdx.x * tile; t0 < p.local_num_tokens; t0 += kCluster ? tile : gridDim.x * tile) {
    const int ntok = min(tile, p.local_num_tokens - t0);
    const int nitems = ntok * items.per_token;
    const int idle = kWarps - ntok;  // warps that route nothing
    Item batch[kBatch];
    if constexpr (kSmall) {
      // (every tile has idle warps: tile_tokens < kWarps) The idle warps take up to kBatch
      // items each and load them before the routing is known (early: first + b * stride, below
      // nearly); after it every warp takes the rest round-robin, kBatch at a time. One copy
      // of the load and store code serves both passes, and the path is one run of code
      // (every launch fetches it, cold after an L2 flush; see the kernel's comment).
      const int nearly = min(nitems, kBatch * idle * nb);
      int first = (warp - ntok) * nb + bi, stride = idle * nb, limit = nearly;
      bool pending = warp >= ntok && first < nearly;  // early
#pragma unroll 1
      for (bool routed = false;; routed = true) {
        if (pending) {
#pragma unroll
          for (int b = 0; b < kBatch; ++b) load_item<kPairs>(p, items, t0, first + b * stride, limit, lane, batch[b]);
        }
        if (!routed) {
          if (digest_warp && warp >= ntok) {
            store_digests<W>(p, view, round, lane);
            digest_warp = false;
          }
          if (warp < ntok) route(t0 + warp);
          __syncthreads();
        }
        if (pending) {
#pragma unroll
          for (int b = 0; b < kBatch; ++b) store_item<kPairs, W == 1>(p, tr, t0, lane, batch[b]);
        }
        first = routed ? first + kBatch * kWarps * nb : nearly + warp * nb + bi;
        stride = kWarps * nb;
        limit = nitems;
        pending = first < nitems;
        if (!pending) break;
      }
    } else {
      // The warps that route nothing (a partial tile) take up to kBatch items each and load
      // them before the routing is known (early); the rest go round-robin over every warp
      // after it, kBatch at a time.
      const int nearly = min(nitems, kBatch * idle);
      const bool early = warp >= ntok && warp - ntok < nearly;
      if (early) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) load_item<kPairs>(p, items, t0, warp - ntok + b * idle, nearly, lane, batch[b]);
      }
      if (digest_warp && warp >= ntok) {
        store_digests<W>(p, view, round, lane);
        digest_warp = false;
      }
      if (warp < ntok) route(t0 + warp);
      __syncthreads();
      if (early) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) store_item<kPairs, W == 1>(p, tr, t0, lane, batch[b]);
      }
#pragma unroll 1
      for (int base = nearly + warp; base < nitems; base += kBatch * kWarps) {
#pragma unroll
        for (int b = 0; b < kBatch; ++b) load_item<kPairs>(p, items, t0, base + b * kWarps, nitems, lane, batch[b]);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) store_item<kPairs, W == 1>(p, tr, t0, lane, batch[b]);
      }
    }
    __syncthreads();  // tr is rewritten by the next tile
  }
  if (digest_warp) store_digests<W>(p, view, round, lane);

  if constexpr (kCluster) {
    if (blockIdx.x != 0) {
      cluster_arrive_release();  // this block's stores, to block 0, whose release covers them for the peers
      return;
    }
    cluster_wait();    // every other block's stores (its own arrival needs no release: it publishes them)
    __syncthreads();   // and this block's, before its publishing threads' releases (as arrive_last's barrier)
  } else if (!arrive_last(block_counters + layout::SLOT_DISPATCH_ARRIVAL, Writes::kRemote, diag(p, kDiagSkipFence),
                          diag(p, kDiagDoubleFence))) {
    return;
  }
  allow_dependents();  // the other blocks are gone; this one only publishes and waits
  if (diag(p, kDiagNoPublish)) return;
  // Last block: every send is numbered and every payload store of the grid is visible.
  // One release store per peer carries the count and the round.
  const int q = threadIdx.x;
  if (q < ep && view.has(q)) {
    int count;
    if (one_block) {
      count = s_count[q];        // this block numbered every send (arrive_last synchronized the block)
      send_counters[q] = count;  // after dispatch SEND_COUNTERS hold the counts (combine zeroes them)
    } else {
      count = ld_volatile(send_counters + q);
    }
    uint64_t* word = at<uint64_t>(row_of(p.ws, q), p.aux.dispatch_ready + 8 * (int64_t)me);
    const uint64_t v = ready_word(min(count, mnt), p.rt, mnt, round);
    if (diag(p, kDiagGpuScopePublish)) {
      st_release_gpu_u64(word, v);
    } else {
      st_release_sys_u64(word, v);
    }
  } else if (one_block && q < ep) {
    send_counters[q] = 0;  // a rank outside the view: nothing was numbered for it
  }
  if (diag(p, kDiagNoWait)) return;
  const unsigned long long bad_inv = threadIdx.x == 0 ? take_bad_expert(block_counters) : 0;
  // What the sources sent that differs from this rank's (the lowest such peer), set before the
  // wait: the barrier in block_wait orders these stores before every thread's atomicMin after it.
  __shared__ int s_peer, s_spec_peer;
  if (threadIdx.x == 0) {
    s_peer = kRanks;
    s_spec_peer = kRanks;
  }
  // Only this block waits, so it is the poller (no other block needs telling).
  int count = 0;
  bool same_digest = false;  // thread q: q's digest line came with its ready word and is this rank's
  RankMask<W> seen = RankMask<W>::all();  // degraded mode: the sources whose ready word came
  const uint4* digests = W == 1 ? dispatch_digests(p, my_row) : nullptr;
  const ReadyWords probes{at<uint64_t>(my_row, p.aux.dispatch_ready), round, digests, p.spec_digest, &same_digest};
  if (!block_wait<W>(probes, ep, round, p.ctl, layout::PHASE_DISPATCH, /*poller=*/true,
                     block_counters + layout::SLOT_STATUS_CLAIM, block_counters + layout::SLOT_DISPATCH_GIVE_UP, &count,
                     view, &seen)) {
    return;
  }
  // Thread q now holds what peer q sent here; the protocol's per-source fields get it.
  __shared__ int s_rts[kRanks];
  __shared__ int s_field[kRanks], s_own[kRanks], s_theirs[kRanks];
  if (q < ep) {
    if (seen.has(q)) {
      int r;
      if (compact) {
        const uint32_t high = static_cast<uint32_t>(count), m1 = static_cast<uint32_t>(mnt) + 1;
        r = static_cast<int>(high / m1);
        count = static_cast<int>(high % m1);
      } else {
        r = ld_volatile(at<int>(my_row, p.aux.recv_rts) + q);  // written before q's ready word
      }
      at<int>(my_row, p.aux.recv_counters)[q] = count;
      at<int>(my_row, p.aux.dispatch_completion_flags)[q] = round;
      s_rts[q] = r;
      if (r != p.rt) atomicMin(&s_peer, q);
      if (!same_digest && !diag(p, kDiagNoSpecCheck)) {
        // q's payload descriptor (written before its ready word) against this rank's (where
        // its digest line did not show the same descriptor: an older client, a digest line
        // still on its way, another descriptor, or a job without digests)
        const uint4* d = reinterpret_cast<const uint4*>(my_row + p.aux.recv_specs + 4 * layout::SPEC_WORDS * (int64_t)q);
        int theirs[layout::SPEC_WORDS];
#pragma unroll
        for (int w = 0; w < layout::SPEC_WORDS / 4; ++w) {
          const uint4 v = __ldcg(d + w);
          theirs[4 * w] = static_cast<int>(v.x);
          theirs[4 * w + 1] = static_cast<int>(v.y);
          theirs[4 * w + 2] = static_cast<int>(v.z);
          theirs[4 * w + 3] = static_cast<int>(v.w);
        }
        int first = -1, own = 0, other = 0;
#pragma unroll
        for (int w = layout::SPEC_WORDS - 1; w >= 0; --w) {
          if (theirs[w] != p.spec[w]) {
            first = w;
            own = p.spec[w];
            other = theirs[w];
          }
        }
        if (first >= 0) {  // rare: where it differs, for the input record
          s_field[q] = spec_field(first, &own, &other);
          s_own[q] = own;
          s_theirs[q] = other;
          atomicMin(&s_spec_peer, q);
        }
      }
    } else {
      at<int>(my_row, p.aux.recv_counters)[q] = 0;  // degraded mode: nothing came from q
    }
  }
  __syncthreads();
  // What was wrong with the input, without stopping the round: a peer that passed another
  // rt wins over a bad expert id; the combine of a round with such a peer moves no data.
  if (threadIdx.x == 0) {
    if (s_peer < kRanks) {
      block_counters[layout::SLOT_RT_MISMATCH] = round;
      write_input(p.ctl, layout::INPUT_RT_MISMATCH, s_peer, s_rts[s_peer], round);
    } else if (s_spec_peer < kRanks) {
      const int b = s_spec_peer;
      block_counters[layout::SLOT_RT_MISMATCH] = round;  // the combine of the round moves nothing
      write_input(p.ctl, layout::INPUT_SPEC_MISMATCH, b | (s_field[b] << 8), s_theirs[b], round, s_own[b]);
    } else if (bad_inv != 0) {
      const unsigned long long key = ~bad_inv;
      write_input(p.ctl, layout::INPUT_BAD_EXPERT, static_cast<int>(key >> 32),
                  static_cast<int>(static_cast<uint32_t>(key)), round);
    }
  }
  if constexpr (!kPlain) {
    if (p.eplb_out != nullptr && eplb_experts > 0) {
      // The gathered statistics (the barrier above ordered every source's acquire before these loads).
      const int n = ep * eplb_experts;
      const int32_t* region = at<int32_t>(my_row, p.eplb_offset);
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int src = i / eplb_experts;
        p.eplb_out[i] = seen.has(src) ? ld_volatile(region + i) : 0;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Degraded mode: the round's prologue (one block, one thread per rank it serves, before dispatch)
// ---------------------------------------------------------------------------
template <int W>
constexpr int prologue_threads() { return 64 * W; }  // one thread per rank (64 * W >= ep_size)

__device__ __forceinline__ volatile int* admit_round(const Control& c, int q) {
  return reinterpret_cast<volatile int*>(c.block + layout::CB_ADMIT_ROUND + 4 * (int64_t)q);
}

// Rank q's admit round where its control-block entry is ADMIT_ROW: SLOT_ADMIT_ROUND of its
// own row, which the ranks of every node reach (a replacement let into a job that spans
// nodes without a job-wide re-arm).
__device__ __forceinline__ int* row_admit(const DispatchParams& p, int q) {
  return at<int>(row_of(p.ws, q), p.aux.block_counters) + layout::SLOT_ADMIT_ROUND;
}

// Rank q's admit round: its control-block entry, or its row's word (ADMIT_ROW).
__device__ __forceinline__ int admit_of(const DispatchParams& p, int q) {
  const int a = *admit_round(p.ctl, q);
  return a == layout::ADMIT_ROW ? ld_acquire_sys(row_admit(p, q)) : a;
}

// The job's active mask (host memory), each word with acquire.
template <int W>
__device__ __forceinline__ RankMask<W> read_active(const Control& c) {
  RankMask<W> m;
#pragma unroll
  for (int i = 0; i < W; ++i) {
    m.w[i] = ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(c.block + layout::CB_ACTIVE_MASK) + i);
  }
  return m;
}

// The ranks of `round` (the effective mask): bit q set in CB_ACTIVE_MASK and
// 0 <= CB_ADMIT_ROUND[q] <= round. The mask is read first (once, by thread 0), then the
// admit rounds, one thread per rank; the daemon writes a replacement's admit round
// before its bit. *active gets the mask read. Every thread of the block must call it.
template <int W>
__device__ RankMask<W> effective_mask(const DispatchParams& p, int ep, int round, RankMask<W>* active) {
  const Control& c = p.ctl;
  __shared__ unsigned long long s_active[W], s_eff[W];
  if (threadIdx.x == 0) {
    const RankMask<W> a = read_active<W>(c);
#pragma unroll
    for (int i = 0; i < W; ++i) {
      s_active[i] = a.w[i];
      s_eff[i] = 0;
    }
  }
  __syncthreads();
  const int q = threadIdx.x;
  const RankMask<W> a = shared_mask<W>(s_active);
  if (q < ep && a.has(q)) {
    const int r = admit_of(p, q);
    if (r >= 0 && r <= round) shared_set<W>(s_eff, q);
  }
  __syncthreads();
  *active = a;
  return shared_mask<W>(s_eff);
}

// Before the round: a replacement's first dispatch asks to be let in and waits for the
// round the lowest active rank picks (E), then for every other rank of E to have
// finished the round before (FLAG_VAL >= E), and starts at E. Then the round's view
// M(R) is read once; a rank outside it writes STATUS_NOT_ACTIVE and does not run the
// round; the lowest rank of the view lets in, from R + 1, the replacements that asked.
// The view and its round go to SLOT_VIEW / SLOT_VIEW_ROUND (-1: the round does not run)
// for the dispatch and combine kernels. Every wait is bounded and ends on the abort word.
template <int W>
__global__ void __launch_bounds__(prologue_threads<W>()) prologue_kernel(const DispatchParams p) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  const Control& c = p.ctl;
  uint8_t* my_row = row_of(p.ws, me);
  int* flag_val = at<int>(my_row, p.aux.flag_val);
  int* block_counters = at<int>(my_row, p.aux.block_counters);
  __shared__ int s_round, s_admit, s_fail;
  __shared__ unsigned long long s_lagging[W];
  RankMask<W> active = RankMask<W>::none();
  if (threadIdx.x == 0) {
    s_round = ld_volatile(flag_val);
    s_admit = admit_of(p, me);
    s_fail = 0;
  }
  __syncthreads();
  if (s_admit < 0 || s_admit > s_round) {  // a replacement's first round (block-uniform)
    if (threadIdx.x == 0 && s_admit == layout::ADMIT_JOINED) {
      if (*admit_round(c, me) == layout::ADMIT_ROW) {
        st_release_sys(row_admit(p, me), layout::ADMIT_READY);
      } else {
        *admit_round(c, me) = layout::ADMIT_READY;
      }
      __threadfence_system();
    }
    const uint64_t t0 = global_timer_ns();
    for (uint32_t it = 0;; ++it) {
      __syncthreads();
      if (threadIdx.x == 0) {
        s_admit = admit_of(p, me);
#pragma unroll
        for (int i = 0; i < W; ++i) s_lagging[i] = 0;
      }
      __syncthreads();
      const int admit = s_admit;
      int peer;
      if (admit >= 0) {
        const RankMask<W> eff = effective_mask<W>(p, ep, admit, &active);
        const int q = threadIdx.x;
        // (a replacement let in at the same round took no part in the one before: not waited for)
        if (q < ep && q != me && eff.has(q) && admit_of(p, q) != admit &&
            ld_acquire_sys(at<int>(row_of(p.ws, q), p.aux.flag_val)) < admit) {
          shared_set<W>(s_lagging, q);
        }
        __syncthreads();
        const RankMask<W> lagging = shared_mask<W>(s_lagging);
        if (!lagging.any()) {
          if (threadIdx.x == 0) {
            *reinterpret_cast<volatile int*>(flag_val) = admit;
            s_round = admit;
          }
          break;
        }
        peer = lagging.lowest();
      } else {
        peer = -1;
        if (threadIdx.x == 0) {
          RankMask<W> m = read_active<W>(c);
          m.clear(me);
          peer = m.lowest();  // a guess at whom it waits for: some active rank
        }
      }
      if (threadIdx.x == 0) {
        const uint64_t waited = global_timer_ns() - t0;
        const bool aborted = ld_relaxed_sys_u32(reinterpret_cast<const uint32_t*>(c.block + layout::CB_ABORT)) != 0;
        if (aborted || waited >= c.timeout_ns) {
          if (atomicCAS(block_counters + layout::SLOT_STATUS_CLAIM, 0, 1) == 0) {
            write_status(c, aborted ? layout::STATUS_ABORTED : layout::STATUS_TIMEOUT, peer < 0 ? me : peer,
                         max(admit, s_round), layout::PHASE_DISPATCH, waited);
          }
          s_fail = 1;
        }
      }
      __syncthreads();
      if (s_fail) break;
      __nanosleep(1000);
    }
  }
  __syncthreads();
  if (s_fail) {
    if (threadIdx.x == 0) block_counters[layout::SLOT_VIEW_ROUND] = -1;
    return;
  }
  const int round = s_round;
  // Left behind: a rank q whose outputs the last combine (round R = round - 1) summed went
  // on without this rank (q's view of R + 1 lacks it, or q is past R + 1) while this rank
  // pulled: q may have restaged its region under the pull, so that round's output is void.
  // q publishes a changed view before its round (below), so a round of R + 1 read first
  // comes with that round's view word or a later one; a later one is never read while q's
  // view of R + 1 holds this rank (q cannot finish R + 1 before this rank's dispatch).
  if (ld_volatile(block_counters + layout::SLOT_COMBINE_SEEN_ROUND) == round - 1) {
    __shared__ int s_behind;
    if (threadIdx.x == 0) s_behind = ep;
    __syncthreads();
    const RankMask<W> pulled = RankMask<W>::load(block_counters + layout::SLOT_COMBINE_SEEN);
    const int q = threadIdx.x;
    if (q < ep && q != me && pulled.has(q)) {
      const int* qc = at<int>(row_of(p.ws, q), p.aux.block_counters);
      const int vr = ld_acquire_sys(qc + layout::SLOT_VIEW_ROUND);
      bool behind = vr > round;
      if (vr == round) {
        const uint64_t word = *(reinterpret_cast<const volatile unsigned long long*>(qc + layout::SLOT_VIEW) + (me >> 6));
        behind = !((word >> (me & 63)) & 1);
      }
      if (behind) atomicMin(&s_behind, q);
    }
    __syncthreads();
    if (s_behind < ep) {
      if (threadIdx.x == 0) {
        if (atomicCAS(block_counters + layout::SLOT_STATUS_CLAIM, 0, 1) == 0) {
          write_status(c, layout::STATUS_LEFT_BEHIND, s_behind, round - 1, layout::PHASE_COMBINE, 0);
        }
        block_counters[layout::SLOT_VIEW_ROUND] = -1;
      }
      return;
    }
  }
  const RankMask<W> eff = effective_mask<W>(p, ep, round, &active);
  if (threadIdx.x == 0) {
    if (!eff.has(me)) {
      if (atomicCAS(block_counters + layout::SLOT_STATUS_CLAIM, 0, 1) == 0) {
        write_status(c, layout::STATUS_NOT_ACTIVE, me, round, layout::PHASE_DISPATCH, 0);
      }
      block_counters[layout::SLOT_VIEW_ROUND] = -1;
      return;
    }
    if (eff.lowest() == me) {
      // Let in from R + 1 the replacements that asked. Nobody can have started R + 1: it
      // needs this rank's combine flag of R, written after these stores are visible.
      RankMask<W> m = active.without(eff);
      for (int q = m.lowest(); q >= 0; q = m.lowest()) {
        m.clear(q);
        if (q >= ep) continue;
        const int a = *admit_round(c, q);
        if (a == layout::ADMIT_READY) {
          *admit_round(c, q) = round + 1;
        } else if (a == layout::ADMIT_ROW && ld_acquire_sys(row_admit(p, q)) == layout::ADMIT_READY) {
          st_release_sys(row_admit(p, q), round + 1);  // in q's row, where every node's ranks read it
        }
      }
      __threadfence_system();
    }
    // A changed view, then the round, in that order for every GPU (a rank that pulled from
    // this one reads the round, then the view: above); an unchanged one needs no fence.
    const RankMask<W> was = RankMask<W>::load(block_counters + layout::SLOT_VIEW);
    if (was.without(eff).any() || eff.without(was).any()) {
      eff.store(block_counters + layout::SLOT_VIEW);
      __threadfence_system();
    }
    *reinterpret_cast<volatile int*>(block_counters + layout::SLOT_VIEW_ROUND) = round;
  }
}

}  // namespace

namespace {

// The kernel's Items, planned once per launch on the host (its entry then reads them instead
// of computing them: less code on every launch's path).
void plan_items(DispatchParams& p) {
  p.items_per_token = 0;
  p.item_vec16 = 0;
  for (int i = 0; i < kMaxPayloads; ++i) {
    p.item_chunks[i] = 0;
    if (i >= p.num_payloads) continue;
    const int64_t nb = p.payload_bytes[i];
    const bool vec16 = nb % 16 == 0 && reinterpret_cast<uintptr_t>(p.payload[i]) % 16 == 0 &&
                       (reinterpret_cast<uintptr_t>(p.ws.base) + p.payload_offset[i]) % 16 == 0 && p.ws.row_stride % 16 == 0;
    if (vec16) p.item_vec16 |= 1u << i;
    p.item_chunks[i] = vec16 ? static_cast<int>((nb / 16 + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll)) : 1;
    p.items_per_token += p.item_chunks[i];
  }
}

// Blocks of the cluster form for one token: at most kClusterMost, no more than the token has
// items to copy or the SMs the launch may use. (Clusters of 2, 4 and 8 gave the same T = 1
// dispatch on one H100, 0.3-0.35 us faster at hidden 7168; the smallest is the easiest to
// place.)
constexpr int kClusterMost = 2;
int cluster_blocks(const DispatchParams& q) {
  int n = kClusterMost < q.items_per_token ? kClusterMost : q.items_per_token;
  if (q.lim.sm_budget > 0 && q.lim.sm_budget < n) n = q.lim.sm_budget;
  return n;
}

template <int W, bool kPairs, bool kPlain = false>
cudaError_t launch_words(const DispatchParams& p, cudaStream_t stream) {
  static_assert(!kPlain || W == 1, "the plain dispatch serves one-word masks");
  int resident = 0;
  cudaError_t err =
      launch::resident_blocks(reinterpret_cast<const void*>(&dispatch_kernel<W, kPairs, kPlain>), kThreads, p.lim, &resident);
  if (err != cudaSuccess) return err;
  // Tokens per block step: as few as fill the SMs (small T spreads each token over a
  // whole block), at most one routing warp per token.
  DispatchParams q = p;
  const int64_t tile = launch::ceil_div(p.local_num_tokens, resident);
  q.tile_tokens = static_cast<int>(tile < 1 ? 1 : tile > kTileMax ? kTileMax : tile);
  q.spec_digest = spec_digest(p.spec);
  plan_items(q);
  const int grid = launch::clamp_grid(launch::ceil_div(p.local_num_tokens, q.tile_tokens), resident);
  if (p.ctl.degrade) {
    prologue_kernel<W><<<1, prologue_threads<W>(), 0, stream>>>(q);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if constexpr (kPlain && !kPairs) {
    if (p.local_num_tokens == 1) {  // one token: copied from a cluster of blocks where one fits
      const int blocks = cluster_blocks(q);
      bool fits = false;
      if (blocks > 1) {
        err = launch::cluster_fits(reinterpret_cast<const void*>(&dispatch_kernel<W, kPairs, true, true, true>),
                                   kThreads, blocks, &fits);
        if (err != cudaSuccess) return err;
      }
      if (fits) {
        return launch::overlapped(dispatch_kernel<W, kPairs, true, true, true>, dim3(static_cast<unsigned>(blocks)),
                                  kThreads, 0, stream, q, /*early=*/true, blocks);
      }
    }
  }
  if constexpr (kPlain) {
    if (q.tile_tokens < kWarps) {  // small T: the form whose copy passes share one run of code
      // (its own occupancy bounds its grid: it need not have the general form's registers)
      int small_resident = 0;
      err = launch::resident_blocks(reinterpret_cast<const void*>(&dispatch_kernel<W, kPairs, true, true>), kThreads,
                                    p.lim, &small_resident);
      if (err != cudaSuccess) return err;
      return launch::overlapped(dispatch_kernel<W, kPairs, true, true>, launch::clamp_grid(grid, small_resident),
                                kThreads, stream, q);
    }
  }
  return launch::overlapped(dispatch_kernel<W, kPairs, kPlain>, grid, kThreads, stream, q);
}

// One-word masks up to 64 ranks: a job of that size runs the code of a plain u64, and a
// round of it that is neither degraded nor gathers EPLB statistics the plain instantiation.
template <bool kPairs>
cudaError_t launch_for_size(const DispatchParams& p, cudaStream_t stream) {
  if (p.ws.ep_size > 64) return launch_words<kMaskWords, kPairs>(p, stream);
  if (!p.ctl.degrade && p.eplb_experts == 0) return launch_words<1, kPairs, true>(p, stream);
  return launch_words<1, kPairs>(p, stream);
}

}  // namespace

// The binding checked the arguments (csrc/bindings.cpp, behind the Python front end); the
// checks here are debug asserts (A2AD_DEBUG_CHECKS), except what keeps a launch from
// indexing the parameter arrays out of bounds.
cudaError_t launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  A2AD_DEBUG_ASSERT(launch::valid_workspace(p.ws) && launch::valid_aux(p.aux) && launch::valid_control(p.ctl));
  A2AD_DEBUG_ASSERT(p.top_k >= 1 && p.top_k <= kMaxTopK && p.top_k <= p.aux.topk_stride);
  A2AD_DEBUG_ASSERT(p.num_experts >= p.ws.ep_size);
  A2AD_DEBUG_ASSERT(p.local_num_tokens >= 0 && p.local_num_tokens <= p.rt && p.rt <= p.aux.max_num_tokens);
  A2AD_DEBUG_ASSERT(p.local_num_tokens == 0 || p.experts != nullptr || p.pair_ids64 != nullptr);
  A2AD_DEBUG_ASSERT(p.diag == 0 || kTimingBuild);
  A2AD_DEBUG_ASSERT(p.eplb_experts >= 0 && (p.eplb_experts == 0 || p.eplb_local != nullptr));
  if (p.num_payloads < 0 || p.num_payloads > kMaxPayloads || p.ws.ep_size < 1 || p.ws.ep_size > kMaxEpSize) {
    return cudaErrorInvalidValue;  // the parameter arrays and the mask words
  }
  const bool pairs = p.pair_group > 0;
  // (pairs: the ids, the rows and the metadata, 8 bytes; a top_k = 1 job, no EPLB)
  if (pairs && (p.num_payloads != 2 || p.payload_bytes[1] != 8 || p.top_k != 1 || p.eplb_experts != 0 ||
                (p.local_num_tokens > 0 && p.payload[0] == nullptr))) {
    return cudaErrorInvalidValue;
  }
#ifdef A2AD_DEBUG_CHECKS
  for (int i = 0; i < p.num_payloads; ++i) {
    A2AD_DEBUG_ASSERT(p.payload_bytes[i] > 0 &&
                      (p.local_num_tokens == 0 || p.payload[i] != nullptr || (pairs && i == p.num_payloads - 1)));
  }
#endif
  return pairs ? launch_for_size<true>(p, stream) : launch_for_size<false>(p, stream);
}

cudaError_t load_dispatch_kernels() {
  const void* fns[] = {
      reinterpret_cast<const void*>(&dispatch_kernel<1, false>),
      reinterpret_cast<const void*>(&dispatch_kernel<kMaskWords, false>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<kMaskWords, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, false, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, true, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, false, true, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, true, true, true>),
      reinterpret_cast<const void*>(&dispatch_kernel<1, false, true, true, true>),
      reinterpret_cast<const void*>(&prologue_kernel<1>),
      reinterpret_cast<const void*>(&prologue_kernel<kMaskWords>),
  };
  cudaFuncAttributes a;
  for (const void* fn : fns) {
    const cudaError_t err = cudaFuncGetAttributes(&a, fn);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace a2ad
