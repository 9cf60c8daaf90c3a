// Combine: every rank stages the expert outputs its peers pull, tells them, and pulls
// and reduces the rows of its own tokens from every target. The scheme is described in
// csrc/README.md ("Combine", "Overlapped combine").
#include "primitives.cuh"
#include "launch.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace a2ad {
namespace {

using namespace dev;

constexpr int kThreads = 256;
static_assert(kThreads >= kMaxEpSize, "block_wait and the per-peer steps take a thread per rank");
// Pull: 16-byte vectors per lane per item and the sends whose loads are in flight
// together (vector path), and scalar elements per lane and sends (the unaligned path).
constexpr int kPullVecs = 4;
constexpr int kPullSendsVec = 2;
constexpr int kPullScalars = 4;
constexpr int kPullSendsScalar = 4;
// Low-latency pairs, few items (see kAllSendsMaxItems): a send per pair (top_k of them, not
// one per rank), so one vector per lane and every send's load in flight at once.
constexpr int kPullVecsAll = 1;
constexpr int kPullSendsAll = 8;
// A low-latency pairs combine whose pull has fewer items than this (at kPullVecs per lane)
// pulls with every send in flight: one latency per item instead of one per two pairs. A
// build that pulled every such combine this way, on one H100 (2 ranks on it, hidden 7168,
// top_k 8): 1.5-1.6 us faster at T = 1 and 8 (7 and 56 items), 1.6 us slower at T = 32
// (224 items) and 6.4 us at T = 128.
constexpr int64_t kAllSendsMaxItems = 128;
// Overlapped combine: the launcher uses it when a rank stages at least kOverlapMinBytes
// of rows at least kOverlapMinRowBytes wide (below that a staging spread over the whole
// grid is cheaper than slice by slice: the per-slice release costs more than it hides);
// 1 / kOverlapStageShare of the grid stages, kStageUnroll 16-byte accesses in flight per
// stager thread. Measured (T=4096, hidden 7168): a half of the grid staging 196.1 us,
// a third 196.5, a quarter 198.4, a sixth 226.0.
constexpr int64_t kOverlapMinBytes = int64_t{16} << 20;
constexpr int64_t kOverlapMinRowBytes = 8192;
constexpr int kOverlapStageShare = 2;
constexpr int kStageUnroll = 8;
// A staging of at most this many bytes copies every slot (rt rows per source) instead of
// the received rows: it then need not read RECV_COUNTERS first (a cold load on the
// critical path of a small round); the extra rows are never pulled.
constexpr int64_t kStageAllSlotsBytes = int64_t{1} << 20;
// Above it, the 16-byte vectors each staging thread loads before the received count is in
// (stage_rows): 8 cover a thread's share at hidden 7168, T = 128 (1.84 MB to stage, about 5
// vectors a thread on a third of an H100's SMs) in one round trip, where 4 left a second one
// (the bf16 combine 17.87 -> 16.72 us on one H100; docs/PERF.md).
constexpr int kStageFirst = 8;
// Lines (see uses_lines): 8-byte units of the payload in flight per staging thread, and
// 16-byte vectors per lane per item of the pull (half the plain pull's: two lines each, and
// the kernel stays within 128 registers, two blocks per SM).
constexpr int kLineUnroll = 4;
constexpr int kPullVecsLines = 2;
// The combine kernel's instantiations by path (its kPath).
constexpr int kPathGeneral = 0, kPathPlain = 1, kPathLines = 2;

// Probe of the combine ready word target q wrote into this rank's row: its low half is
// the round, its high half q's combine descriptor (the probe's value).
struct CombineFlags {
  const uint64_t* words;
  int round;
  __device__ ReadyProbe operator()(int q) const { return ReadyProbe{words + q, round}; }
};

// The void combine descriptor (layout.COMBINE_SPEC_VOID: hidden 0, which no real combine
// publishes): a degrade combine's flag to a source of its round that its dispatch let go of.
// That source counts nothing from this rank and marks its tokens that went here.
constexpr uint32_t kCombineSpecVoid = 0;

// A degrade combine's probe (planerules.past_round_is_seen): a word of a later round counts
// as seen. A target that let this rank go in its next dispatch wrote that round's word, with
// the void descriptor, over the word of this round that this rank had not read yet; it
// finished this round and restaged its region, so nothing of it is counted: the probe's
// value is the void descriptor whatever the word holds.
struct ReadyOrAheadProbe {
  const uint64_t* word;
  int want;
  __device__ __forceinline__ bool ready(int* value) const {
    const uint64_t w = ld_acquire_sys_u64(word);
    const int got = static_cast<int>(static_cast<uint32_t>(w));
    if (got < want) return false;
    *value = got == want ? static_cast<int>(w >> 32) : static_cast<int>(kCombineSpecVoid);
    return true;
  }
};

struct CombineFlagsDegraded {
  const uint64_t* words;
  int round;
  __device__ ReadyOrAheadProbe operator()(int q) const { return ReadyOrAheadProbe{words + q, round}; }
};

__device__ __forceinline__ uint64_t combine_word(const CombineParams& p, int round) {
  return (static_cast<uint64_t>(p.spec) << 32) | static_cast<uint32_t>(round);
}

// Where rank me publishes its combine ready word for target q: q's COMBINE_READY[me].
__device__ __forceinline__ uint64_t* combine_ready_at(const CombineParams& p, int q, int me) {
  return at<uint64_t>(row_of(p.ws, q), p.aux.combine_ready + 8 * (int64_t)me);
}

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

// The two 16-bit types share everything but how an element converts to and from float
// (Bits: lo/hi, the low/high element of a 32-bit word; one, a lone element; bits, the
// rounded element of a float).
template <typename Bits>
struct Elem16 {
  static constexpr int kPerVec = 8;
  __device__ static __forceinline__ void unpack(const uint4& v, float* a) {
    a[0] = Bits::lo(v.x);
    a[1] = Bits::hi(v.x);
    a[2] = Bits::lo(v.y);
    a[3] = Bits::hi(v.y);
    a[4] = Bits::lo(v.z);
    a[5] = Bits::hi(v.z);
    a[6] = Bits::lo(v.w);
    a[7] = Bits::hi(v.w);
  }
  __device__ static __forceinline__ void add(const uint4& v, float* a) {
    a[0] += Bits::lo(v.x);
    a[1] += Bits::hi(v.x);
    a[2] += Bits::lo(v.y);
    a[3] += Bits::hi(v.y);
    a[4] += Bits::lo(v.z);
    a[5] += Bits::hi(v.z);
    a[6] += Bits::lo(v.w);
    a[7] += Bits::hi(v.w);
  }
  // a[i] += w * element i, rounded after the product and after the sum (as a separate
  // multiply and add would be)
  __device__ static __forceinline__ void add_weighted(const uint4& v, float w, float* a) {
    float f[8];
    unpack(v, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = __fadd_rn(a[i], __fmul_rn(f[i], w));
  }
  __device__ static __forceinline__ uint32_t pack2(float lo, float hi) {
    return static_cast<uint32_t>(Bits::bits(lo)) | (static_cast<uint32_t>(Bits::bits(hi)) << 16);
  }
  __device__ static __forceinline__ uint4 pack(const float* a) {
    return make_uint4(pack2(a[0], a[1]), pack2(a[2], a[3]), pack2(a[4], a[5]), pack2(a[6], a[7]));
  }
  __device__ static __forceinline__ float load_one(const void* p) {
    return Bits::one(__ldcg(static_cast<const unsigned short*>(p)));
  }
  __device__ static __forceinline__ void store_one(void* p, float f) { *static_cast<unsigned short*>(p) = Bits::bits(f); }
};

struct Bf16Bits {
  __device__ static __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  __device__ static __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  __device__ static __forceinline__ float one(unsigned short u) { return __uint_as_float(static_cast<uint32_t>(u) << 16); }
  __device__ static __forceinline__ unsigned short bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};

struct HalfBits {
  __device__ static __forceinline__ float one(unsigned short u) { return __half2float(__ushort_as_half(u)); }
  __device__ static __forceinline__ float lo(uint32_t w) { return one(static_cast<unsigned short>(w & 0xffffu)); }
  __device__ static __forceinline__ float hi(uint32_t w) { return one(static_cast<unsigned short>(w >> 16)); }
  __device__ static __forceinline__ unsigned short bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

template <>
struct Elem<__nv_bfloat16> : Elem16<Bf16Bits> {};

template <>
struct Elem<__half> : Elem16<HalfBits> {};

struct PullGeometry {
  int64_t units;        // 16-byte vectors (kVec) or elements per token
  int64_t per_chunk;    // units one warp handles per item
  int64_t chunks;       // items per token
};

// The start of a warp's pull of one item: its accumulators zeroed, and in[u] whether the
// lane's u-th unit (first + u * 32 + lane) lies inside the token's g.units.
template <int kAcc, int kUnits>
__device__ __forceinline__ void pull_begin(float (&acc)[kAcc], bool (&in)[kUnits], int64_t first, int lane,
                                           int64_t units) {
#pragma unroll
  for (int a = 0; a < kAcc; ++a) acc[a] = 0.f;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) in[u] = first + u * 32 + lane < units;
}

// kAllSends: every send of an item in flight at once, a vector per lane (vector path only).
// kLines: the lines pull's (see kPullVecsLines).
template <typename T, bool kVec, bool kAllSends = false, bool kLines = false>
__host__ __device__ inline PullGeometry pull_geometry(int64_t hidden) {
  PullGeometry g;
  g.units = kVec ? hidden / Elem<T>::kPerVec : hidden;
  g.per_chunk = kVec ? 32 * (kAllSends ? kPullVecsAll : kLines ? kPullVecsLines : kPullVecs) : 32 * kPullScalars;
  g.chunks = (g.units + g.per_chunk - 1) / g.per_chunk;
  return g;
}

// ---------------------------------------------------------------------------
// FP8 combine: e4m3 rows, one E8M0 scale byte per FP8_BLOCK elements
// ---------------------------------------------------------------------------
// The block's exponent k: the smallest with amax * 2^-k <= 448 (e4m3's largest), from
// amax's bits (448 = 1.75 * 2^8), at least -126. The host plane computes the same bits.
__device__ __forceinline__ int fp8_block_exponent(float amax) {
  const uint32_t b = __float_as_uint(amax);
  const int k = static_cast<int>((b >> 23) & 0xff) - 135 + ((b & 0x7fffff) > 0x600000 ? 1 : 0);
  return k < -126 ? -126 : k;
}

__device__ __forceinline__ float pow2(int k) { return __uint_as_float(static_cast<uint32_t>(127 + k) << 23); }

__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xffffu) | (hi << 16);
}

__device__ __forceinline__ void fp8x2_add(uint32_t w16, float scale, float* a) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w16), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  a[0] += f.x * scale;
  a[1] += f.y * scale;
}

// The FP8 combine's quantization of one unit of 8 bf16 elements (v): the two e4m3 x4 words of
// its elements divided by 2^k, k (*k) its 32-element block's exponent. A block is 4 lanes'
// units (lanes 4j..4j+3, which agree on k); every lane calls.
__device__ __forceinline__ uint2 quantize_unit(const uint4& v, int* k) {
  float f[8];
  Elem16<Bf16Bits>::unpack(v, f);
  const float m01 = fmaxf(fabsf(f[0]), fabsf(f[1])), m23 = fmaxf(fabsf(f[2]), fabsf(f[3]));
  const float m45 = fmaxf(fabsf(f[4]), fabsf(f[5])), m67 = fmaxf(fabsf(f[6]), fabsf(f[7]));
  float amax = fmaxf(0.f, fmaxf(fmaxf(m01, m23), fmaxf(m45, m67)));  // (a NaN counts as 0)
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
  *k = fp8_block_exponent(amax);
  const float inv = pow2(-*k);
  return make_uint2(fp8x4(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv),
                    fp8x4(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv));
}

// Rows [0, rows) of source s quantized from the bf16 payload into this rank's FP8 region.
// A unit is 8 elements (one 16-byte load, an 8-byte store); 4 lanes hold a scale block. A
// warp item is a chunk of one row, 32 * kQ units (1024 elements, kQ units per lane in flight),
// whose 32 scale bytes are gathered by shuffles into 8 lanes and stored as 4-byte words: one
// store writes a whole 32-byte sector when rows are a multiple of 32 bytes long (the row's
// padding after its last scale zeroed), where one scale byte per lane of 4 made each sector
// four partial stores. On one H100 that took 0.25-0.6 us off the FP8 combine at T = 1-128
// and 3-7 us at T=4096 (docs/PERF.md, "FP8 staging": likely a partial-sector store to a
// line not in L2 waiting for its fill).
__device__ __forceinline__ void stage_rows_fp8(const CombineParams& p, const int* recv, uint32_t warp_id,
                                               uint32_t nwarps, int lane) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* region = row_of(p.ws, me) + p.combine_offset;
  constexpr int kQ = 4;  // units per lane in flight
  constexpr uint32_t kChunkUnits = 32 * kQ;
  const uint32_t U = static_cast<uint32_t>(p.hidden / 8);
  const uint32_t per_row = (U + kChunkUnits - 1) / kChunkUnits;
  const int64_t row8 = fp8_row_bytes(p.hidden);
  const int64_t row16 = p.hidden * 2;
  const uint32_t scale_room = static_cast<uint32_t>(row8 - p.hidden);  // the scales and the padding
  const bool all_slots = (int64_t)(ep - 1) * p.rt * row16 <= kStageAllSlotsBytes;
  // Lane j < 8 stores scale bytes 4j..4j+3 of the chunk; byte b is the scale of the chunk's
  // unit round b / 8, held by lane 4 * (b % 8).
  const int word_lane0 = 16 * (lane & 1), word_shift = 8 * ((lane >> 1) & 3);
  for (int s = 0; s < ep; ++s) {
    if (s == me) continue;
    const int got = all_slots ? p.rt : ld_volatile(recv + s);
    const uint8_t* src = p.payload + (int64_t)s * p.rt * row16;
    uint8_t* dst = region + (int64_t)s * p.rt * row8;
    // rotate the warps per source so that small copies spread over the grid
    const uint32_t w = (warp_id + static_cast<uint32_t>(s) * (nwarps / static_cast<uint32_t>(ep))) % nwarps;
    // An item: a chunk of row j, its units from e0.
    auto chunk_of = [&](uint32_t item, uint32_t* j, uint32_t* e0) {
      *j = item / per_row;
      *e0 = (item - *j * per_row) * kChunkUnits;
    };
    // The units of the chunk of row j from e0 into v, zeros past the row.
    auto load = [&](uint32_t j, uint32_t e0, uint4* v) {
      const uint4* src_row = reinterpret_cast<const uint4*>(src + (int64_t)j * row16);
#pragma unroll
      for (int u = 0; u < kQ; ++u) {
        const uint32_t e8 = e0 + u * 32 + lane;
        v[u] = e8 < U ? src_row[e8] : make_uint4(0, 0, 0, 0);
      }
    };
    // The warp's first item is loaded before the received count is in (a cold load where
    // not every slot is staged; as in stage_rows, every slot lies in the payload, and an item
    // past the received rows is dropped).
    uint4 v[kQ] = {};
    if (w < static_cast<uint32_t>(p.rt) * per_row) {
      uint32_t j, e0;
      chunk_of(w, &j, &e0);
      load(j, e0, v);
    }
    const int rows = received_rows(got, p.rt);
    const uint32_t n = static_cast<uint32_t>(rows) * per_row;
#pragma unroll 1
    for (uint32_t item = w; item < n; item += nwarps) {
      uint32_t j, e0;
      chunk_of(item, &j, &e0);
      uint8_t* dst_row = dst + (int64_t)j * row8;
      if (item != w) load(j, e0, v);
      uint32_t kbytes = 0;  // this lane's scale byte of each unit round u (byte u; 0 past the row)
#pragma unroll
      for (int u = 0; u < kQ; ++u) {
        const uint32_t e8 = e0 + u * 32 + lane;
        int k;
        const uint2 q = quantize_unit(v[u], &k);
        if (e8 < U) {  // (U is a multiple of 4: a scale block's 4 lanes agree)
          reinterpret_cast<uint2*>(dst_row)[e8] = q;
          kbytes |= static_cast<uint32_t>(k + 127) << (8 * u);
        }
      }
      uint32_t word = 0;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        word |= ((__shfl_sync(kFullMask, kbytes, word_lane0 + 4 * t) >> word_shift) & 0xffu) << (8 * t);
      }
      const uint32_t at_byte = e0 / 4 + 4 * static_cast<uint32_t>(lane);
      if (lane < 8 && at_byte + 4 <= scale_room) *reinterpret_cast<uint32_t*>(dst_row + p.hidden + at_byte) = word;
    }
  }
}

// pull_item for the FP8 combine: the sends of token t, chunk c (units of 8 elements);
// a send to this rank is read from the bf16 payload, the others from the target's FP8 rows.
__device__ void pull_item_fp8(const CombineParams& p, int t, uint32_t c, const PullGeometry& g, int lane, int target,
                              int slot) {
  const int me = p.ws.ep_rank;
  unsigned sends = __ballot_sync(kFullMask, target >= 0);
  const int64_t row16 = p.hidden * 2;
  const int64_t row8 = fp8_row_bytes(p.hidden);
  const int64_t first = c * static_cast<uint32_t>(g.per_chunk);
  const uint8_t* region = p.ws.base + p.combine_offset + (int64_t)me * p.rt * row8;
  const uint8_t* self_region = p.payload + (int64_t)me * p.rt * row16;
  constexpr int kUnits = kPullVecs;
  constexpr int kSends = kPullSendsVec;
  float acc[kUnits * 8];
  bool in[kUnits];
  pull_begin(acc, in, first, lane, g.units);
  uint4 vbuf[kSends][kUnits];
  uint32_t sbuf[kSends][kUnits];
  while (sends != 0) {
    const uint8_t* src[kSends];
    bool has[kSends], self[kSends];
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      has[b] = sends != 0;
      const int k = has[b] ? __ffs(sends) - 1 : 0;
      if (has[b]) sends &= sends - 1;
      const int tq = __shfl_sync(kFullMask, target, k), sq = __shfl_sync(kFullMask, slot, k);
      self[b] = tq == me;
      src[b] = self[b] ? self_region + (int64_t)sq * row16 : region + (int64_t)tq * p.ws.row_stride + (int64_t)sq * row8;
    }
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        const int64_t unit = first + u * 32 + lane;
        vbuf[b][u] = make_uint4(0, 0, 0, 0);
        sbuf[b][u] = 0;
        if (has[b] && in[u]) {
          if (self[b]) {
            vbuf[b][u] = __ldcg(reinterpret_cast<const uint4*>(src[b]) + unit);
          } else {
            const uint2 w = __ldcg(reinterpret_cast<const uint2*>(src[b]) + unit);
            vbuf[b][u].x = w.x;
            vbuf[b][u].y = w.y;
            sbuf[b][u] = __ldcg(src[b] + p.hidden + unit / 4);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      if (!has[b]) continue;
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        if (self[b]) {
          Elem16<Bf16Bits>::add(vbuf[b][u], acc + u * 8);
        } else {
          const float scale = pow2(static_cast<int>(sbuf[b][u]) - 127);
          fp8x2_add(vbuf[b][u].x & 0xffffu, scale, acc + u * 8);
          fp8x2_add(vbuf[b][u].x >> 16, scale, acc + u * 8 + 2);
          fp8x2_add(vbuf[b][u].y & 0xffffu, scale, acc + u * 8 + 4);
          fp8x2_add(vbuf[b][u].y >> 16, scale, acc + u * 8 + 6);
        }
      }
    }
  }
  uint4* out_row = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.out) + (int64_t)t * row16) + first;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if (in[u]) out_row[u * 32 + lane] = Elem16<Bf16Bits>::pack(acc + u * 8);
  }
}

// This rank's own sends are read from the payload (never staged: only this rank pulls
// them), unless the payload already is the combine region.
__host__ __device__ inline bool self_from_payload(const CombineParams& p) { return !p.payload_in_workspace; }

// The rows of this rank's own send of token t, chunk c, asked of L2 (the warp's first item,
// before the wait for the peers): the pull reads them right after the wait, from the payload,
// cold after an L2 flush. (Rows are 16-byte units: the vector paths.)
__device__ __forceinline__ void prefetch_self_chunk(const CombineParams& p, int64_t row_bytes, uint32_t c,
                                                    const PullGeometry& g, int lane, int target, int slot) {
  const unsigned self = __ballot_sync(kFullMask, target == p.ws.ep_rank && slot >= 0);
  if (self == 0) return;
  const int sq = __shfl_sync(kFullMask, slot, __ffs(self) - 1);
  const int64_t first = (int64_t)c * g.per_chunk;
  const int64_t left = g.units - first, n = left < g.per_chunk ? left : g.per_chunk;
  if (n <= 0) return;
  prefetch_l2(p.payload + ((int64_t)p.ws.ep_rank * p.rt + sq) * row_bytes + first * 16, static_cast<int>(n * 16), lane,
              32);
}

// Lane k (< top_k) of the warp gets send k of token t: target rank and slot
// there, -1/-1 for a repeat or an invalid entry.
// `routed` (optional) gets the target of every (t, k) that is not a repeat, a send or
// one that degraded mode dropped at dispatch (no slot), else -1.
__device__ __forceinline__ void token_sends(const CombineParams& p, int t, int lane, int* target, int* slot,
                                            int* routed = nullptr) {
  uint8_t* my_row = row_of(p.ws, p.ws.ep_rank);
  int tq = -1, sq = -1;
  if (lane < p.top_k) {
    tq = ld_volatile(at<int>(my_row, p.aux.topk_target_ranks) + (int64_t)t * p.aux.topk_stride + lane);
    sq = ld_volatile(at<int>(my_row, p.aux.topk_send_indices) + (int64_t)t * p.aux.topk_stride + lane);
  }
  const bool in_range = tq >= 0 && tq < p.ws.ep_size;
  const bool valid = in_range && sq >= 0 && sq < p.rt;
  *target = valid ? tq : -1;
  *slot = valid ? sq : -1;
  if (routed != nullptr) *routed = in_range ? tq : -1;
}

// Low-latency pairs: lane k (< group) gets the send of pair u * group + k (the job's top_k
// is 1) and its weight; a pair without an expert (id < 0) sends nothing and is not routed.
__device__ __forceinline__ void pair_sends(const CombineParams& p, int u, int lane, int* target, int* slot,
                                           int* routed, float* weight) {
  uint8_t* my_row = row_of(p.ws, p.ws.ep_rank);
  int tq = -1, sq = -1;
  float w = 0.f;
  if (lane < p.group) {
    const int64_t i = (int64_t)u * p.group + lane;
    const int64_t id = p.group_ids64 != nullptr ? p.group_ids64[i] : static_cast<int64_t>(p.group_ids32[i]);
    if (id >= 0) {
      tq = ld_volatile(at<int>(my_row, p.aux.topk_target_ranks) + i * p.aux.topk_stride);
      sq = ld_volatile(at<int>(my_row, p.aux.topk_send_indices) + i * p.aux.topk_stride);
      w = p.group_weights[i];
    }
  }
  const bool in_range = tq >= 0 && tq < p.ws.ep_size;
  const bool valid = in_range && sq >= 0 && sq < p.rt;
  *target = valid ? tq : -1;
  *slot = valid ? sq : -1;
  *routed = in_range ? tq : -1;
  *weight = w;
}

// Degraded mode: only targets in `seen` count; the token's indicator (written once, by
// the warp of its first chunk) says whether some (t, k) had its target outside it.
template <int W>
__device__ __forceinline__ void count_seen(const CombineParams& p, int t, uint32_t c, int routed,
                                           const RankMask<W>& seen, int* target, int lane) {
  const bool lost = routed >= 0 && !seen.has(routed);
  const bool any_lost = __any_sync(kFullMask, lost);
  if (*target >= 0 && !seen.has(*target)) *target = -1;
  if (c == 0 && lane == 0) p.degraded[t] = any_lost ? 1 : 0;
}

// Degraded mode, a pulling block that is not the poller: wait until the poller posted
// the ranks whose combine flags it saw (what every block counts), or gave up.
template <int W>
__device__ bool wait_seen(const CombineParams& p, int* block_counters, int round, int* give_up, int* claim,
                          RankMask<W>* seen) {
  __shared__ int s_ok;
  __shared__ unsigned long long s_seen[W];
  if (threadIdx.x == 0) {
    const int* posted = block_counters + layout::SLOT_COMBINE_SEEN_ROUND;
    // (twice the timeout: a backstop, the poller gives up first)
    s_ok = local_wait([&] { return ld_acquire_gpu(posted) == round ? 1 : 0; }, p.ctl, p.ws.ep_rank, round,
                      layout::PHASE_COMBINE, 2 * p.ctl.timeout_ns, 0, true, claim, give_up);
    if (s_ok) RankMask<W>::load(block_counters + layout::SLOT_COMBINE_SEEN).store(s_seen);
  }
  __syncthreads();
  *seen = shared_mask<W>(s_seen);
  return s_ok != 0;
}

// out[t, chunk c] = sum over the token's sends of the target's combine row, in
// float32. One warp per (token, chunk) item; the loads of several sends are issued
// together.
// Low-latency pairs (kLl): each send's row is weighted (lane k's `weight`), and this rank's
// own rows are read from the payload through stage_index. kAllSends: see pull_geometry.
template <typename T, bool kVec, bool kLl = false, bool kAllSends = false>
__device__ void pull_item(const CombineParams& p, int t, uint32_t c, const PullGeometry& g, int lane, int target,
                          int slot, float weight = 1.f) {
  const int me = p.ws.ep_rank;
  unsigned sends = __ballot_sync(kFullMask, target >= 0);
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t unit_bytes = kVec ? 16 : (int64_t)sizeof(T);
  const int64_t first = c * static_cast<uint32_t>(g.per_chunk);  // first unit of this chunk (fits 32 bits)
  const uint8_t* region = p.ws.base + p.combine_offset + (int64_t)me * p.rt * row_bytes + first * unit_bytes;
  const uint8_t* self_region = self_from_payload(p) ? p.payload + (int64_t)me * p.rt * row_bytes + first * unit_bytes
                                                 : region + (int64_t)me * p.ws.row_stride;

  static_assert(kVec || !kAllSends, "kAllSends: the vector path only");
  constexpr int kUnits = kVec ? (kAllSends ? kPullVecsAll : kPullVecs) : kPullScalars;
  constexpr int kSends = kVec ? (kAllSends ? kPullSendsAll : kPullSendsVec) : kPullSendsScalar;
  constexpr int kPer = kVec ? Elem<T>::kPerVec : 1;
  float acc[kUnits * kPer];
  bool in[kUnits];
  pull_begin(acc, in, first, lane, g.units);
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
    float wgt[kSends];
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      has[b] = sends != 0;  // warp-uniform
      const int k = has[b] ? __ffs(sends) - 1 : 0;
      if (has[b]) sends &= sends - 1;
      const int tq = __shfl_sync(kFullMask, target, k), sq = __shfl_sync(kFullMask, slot, k);
      wgt[b] = __shfl_sync(kFullMask, weight, k);
      if constexpr (kLl) {
        if (tq == me) {
          int64_t row = p.stage_index[(int64_t)me * p.rt + sq];
          row = row < 0 ? 0 : row >= p.payload_rows ? p.payload_rows - 1 : row;
          src[b] = p.payload + row * row_bytes + first * unit_bytes;
        } else {
          src[b] = region + (int64_t)tq * p.ws.row_stride + (int64_t)sq * row_bytes;
        }
      } else {
        src[b] = (tq == me ? self_region : region + (int64_t)tq * p.ws.row_stride) + (int64_t)sq * row_bytes;
      }
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
          for (int u = 0; u < kUnits; ++u) {  // !in[u]: never stored
            if constexpr (kLl) {
              Elem<T>::add_weighted(vbuf[b][u], wgt[b], acc + u * kPer);
            } else {
              Elem<T>::add(vbuf[b][u], acc + u * kPer);
            }
          }
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

// Overlapped combine, puller side: wait until the row `slot` that target `q`
// stages for this rank is ready: its slice flag or its whole-region flag equals
// `round`. Not the poller (the launch's last block is): stop when the poller
// posted this round to *give_up, give up on our own only after twice the
// timeout (then post it and write the status record, as the poller would).
// Returns 1 when ready, 0 when it gave up, 2 when q's combine descriptor is not this
// rank's (nothing may be read from q).
__device__ int wait_slice(const CombineParams& p, uint8_t* my_row, int q, int slot, int round, int* give_up,
                          int* claim) {
  const uint64_t* slice = at<uint64_t>(my_row, p.aux.combine_slice_flags) +
                          (int64_t)q * p.aux.combine_slices + slot / layout::COMBINE_SLICE_ROWS;
  const uint64_t* whole = at<uint64_t>(my_row, p.aux.combine_ready) + q;
  const uint64_t want = combine_word(p, round);
  const auto ready = [&] {
    const uint64_t a = ld_acquire_sys_u64(slice), b = ld_acquire_sys_u64(whole);
    if (a == want || b == want) return 1;
    const uint32_t r = static_cast<uint32_t>(round);
    return static_cast<uint32_t>(a) == r || static_cast<uint32_t>(b) == r ? 2 : 0;
  };
  return local_wait(ready, p.ctl, q, round, layout::PHASE_COMBINE, 2 * p.ctl.timeout_ns, 0, true, claim, give_up);
}

// Overlapped combine, stager side (blocks [0, nstage)): rows received from each
// source s != me, COMBINE_SLICE_ROWS at a time and slice-major (slice j of every
// source before slice j + 1), copied into the own combine region; after each
// slice the block tells source s (st.release.sys on s's slice flag, after the
// barrier: the release covers the whole block's copy, as in arrive_last).
__device__ void stage_slices(const CombineParams& p, const int* recv, int round, int nstage) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  const int64_t row_bytes = p.hidden * (int64_t)(p.dtype == DType::kFloat32 ? 4 : 2);
  const int S = layout::COMBINE_SLICE_ROWS;
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
      st_release_sys_u64(at<uint64_t>(row_of(p.ws, s), p.aux.combine_slice_flags) + (int64_t)me * p.aux.combine_slices + j,
                         combine_word(p, round));
    }
  }
}

// Whether a plain staging copies every slot (rt rows per source) instead of the rows
// RECV_COUNTERS says were received (then it does not read them).
__host__ __device__ inline bool stages_all_slots(const CombineParams& p, int64_t row_bytes) {
  return (int64_t)(p.ws.ep_size - 1) * p.rt * row_bytes <= kStageAllSlotsBytes;
}

// Plain staging (not overlapped, the payload not in the workspace): the rows of the
// sources s != me that were received (every slot, see stages_all_slots) copied into the
// own combine region, threads tid of nthreads (32 bits: the launcher keeps grids small).
template <bool kVec>
__device__ __forceinline__ void stage_rows(const CombineParams& p, const int* recv, int64_t row_bytes, uint32_t tid,
                                           uint32_t nthreads) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* region = row_of(p.ws, me) + p.combine_offset;
  const bool all_slots = stages_all_slots(p, row_bytes);
  if (kVec && all_slots) {
    // The regions of the sources s != me (each `seg` 16-byte vectors, at the same offset
    // in the payload and the combine region) copied as one range, so that each thread
    // issues the loads of all its vectors, whatever the source, before its first store:
    // a small staging from cold memory costs one load latency, not one per source.
    const int64_t seg = (int64_t)p.rt * row_bytes / 16;
    copy_vectors<uint4, kCopyUnroll, true>(region, p.payload, (int64_t)(ep - 1) * seg, tid, nthreads,
                                           SkipRange{(int64_t)me * seg, seg});
    return;
  }
  const uint32_t stride = nthreads / static_cast<uint32_t>(ep);
  for (int s = 0; s < ep; ++s) {
    if (s == me) continue;
    const int64_t off = (int64_t)s * p.rt * row_bytes;
    // rotate the threads per source so that small copies spread over the grid
    const uint32_t my = (tid + static_cast<uint32_t>(s) * stride) % nthreads;
    if constexpr (kVec) {
      // Not every slot (that copy returned above): the received count is a cold load (asked
      // of L2 at entry, still on its way). Each thread issues the loads of its first
      // kStageFirst vectors of the source's slots before it has the count, and stores those
      // within the received rows once it has it: the count's latency overlaps the payload's
      // instead of coming before it. (Every slot lies in the payload, which the all-slots
      // copy reads whole; what lies past the received rows is read and dropped.)
      const int64_t slots = (int64_t)p.rt * row_bytes / 16;
      const uint4* src = reinterpret_cast<const uint4*>(p.payload + off);
      uint4* dst = reinterpret_cast<uint4*>(region + off);
      const int got = ld_volatile(recv + s);
      uint4 r[kStageFirst];
#pragma unroll
      for (int u = 0; u < kStageFirst; ++u) {
        const int64_t i = my + (int64_t)u * nthreads;
        r[u] = i < slots ? src[i] : make_uint4(0, 0, 0, 0);
      }
      const int rows = received_rows(got, p.rt);
      const int64_t n = rows * row_bytes / 16;
#pragma unroll
      for (int u = 0; u < kStageFirst; ++u) {
        const int64_t i = my + (int64_t)u * nthreads;
        if (i < n) dst[i] = r[u];
      }
      const int64_t done = (int64_t)kStageFirst * nthreads;
      if (n > done) {
        copy_vectors<uint4, kCopyUnroll, true>(region + off + 16 * done, p.payload + off + 16 * done, n - done, my,
                                               nthreads);
      }
    } else {
      const int rows = received_rows(all_slots ? p.rt : ld_volatile(recv + s), p.rt);
      copy_bytes<kCopyUnroll, true>(region + off, p.payload + off, rows * row_bytes, my, nthreads);
    }
  }
}

// Low-latency pairs: the received slots of the sources s != me, each slot's row read from
// the payload at stage_index, copied into the own combine region; a warp per row.
__device__ __forceinline__ void stage_rows_indexed(const CombineParams& p, const int* recv, int64_t row_bytes,
                                                   uint32_t warp_id, uint32_t nwarps, int lane) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* region = row_of(p.ws, me) + p.combine_offset;
  const int64_t nvec = row_bytes / 16;
  for (int s = 0; s < ep; ++s) {
    if (s == me) continue;
    const int rows = received_rows(ld_volatile(recv + s), p.rt);
    // rotate the warps per source so that small copies spread over the grid
    const uint32_t w = (warp_id + static_cast<uint32_t>(s) * (nwarps / static_cast<uint32_t>(ep))) % nwarps;
#pragma unroll 1
    for (uint32_t j = w; j < static_cast<uint32_t>(rows); j += nwarps) {
      const int64_t slot = (int64_t)s * p.rt + j;
      int64_t row = p.stage_index[slot];
      row = row < 0 ? 0 : row >= p.payload_rows ? p.payload_rows - 1 : row;
      const uint4* src = reinterpret_cast<const uint4*>(p.payload + row * row_bytes);
      uint4* dst = reinterpret_cast<uint4*>(region + slot * row_bytes);
      int64_t v = lane;
#pragma unroll 1
      for (; v + 96 < nvec; v += 128) {  // four 16-byte loads in flight per lane
        const uint4 a = __ldcs(src + v), b = __ldcs(src + v + 32), c = __ldcs(src + v + 64), d = __ldcs(src + v + 96);
        dst[v] = a;
        dst[v + 32] = b;
        dst[v + 64] = c;
        dst[v + 96] = d;
      }
#pragma unroll 1
      for (; v < nvec; v += 32) dst[v] = __ldcs(src + v);
    }
  }
}

// ---------------------------------------------------------------------------
// Lines: a small combine's readiness carried in its staged rows
// ---------------------------------------------------------------------------
// A combine whose staging copies every slot (see stages_all_slots) of 16-byte-multiple rows,
// in a job of at most 64 ranks whose rows have a lines tail (layout.ROW_TAIL_BYTES past the
// row; the daemon's CUDA rows have one), without degraded mode, not low-latency pairs, stages
// its rows as lines (in the tail, after the heads): each 8 bytes of a row become one 16-byte line of
// two words (round << 32 | 4 data bytes), so that a puller spins on the lines it reads until
// they hold the round. No release follows the staging and no ready word is awaited before
// the pull: the combine of a few tokens is 1-2 us shorter (docs/PERF.md, "Combine lines").
// Every rank decides alike (from the job, rt, the row's width and the mode, which every rank
// passes alike or the combine descriptors differ), whatever its payload's place and alignment.
//   - Target q's lines for source s (s != q) are its rows [s, 0..rt) in order, at source index
//     s - (s > q) of q's lines.
//   - The launch's first block is its poller; the others (the workers) stage and pull. At
//     entry the poller writes q's head (round << 32 | q's combine descriptor, twice) into
//     head q of each rank's tail (its own too), and then COMBINE_READY there: a source reads
//     q's lines only once the head holds the round and its own descriptor (a target of
//     another descriptor writes lines elsewhere). It then waits for every head (or a ready
//     word without one: that target staged no lines), for the protocol's words and reports,
//     while the workers stage and pull; no worker waits for it, and none waits for another
//     (a worker counts itself in, without a round trip, once its threads read the round: the
//     poller moves FLAG_VAL on after that). Where only one block fits, it does both, the
//     opening first.
//   - FP8 (low_precision): the lines carry the FP8 rows, as stage_rows_fp8 quantizes them
//     (the same bits): each 8 elements of a row one line of their 8 e4m3 bytes (4 a word),
//     and past every source's lines one scale word per 32-element block, (round << 32) | its
//     E8M0 byte. Half the bf16 lines' bytes and a sixteenth more; the puller dequantizes as
//     pull_item_fp8 does. At most COMBINE_LINES_FP8_BYTES of them (above it, on a third of an
//     H200's SMs, they were slower than the plain FP8 combine; docs/PERF.md, "FP8 lines").
// The lines of a round: (ep - 1) * rt rows of bf16 (or FP8) units.
__host__ __device__ inline int64_t lines_units(const CombineParams& p, int64_t row_bytes) {
  return (int64_t)(p.ws.ep_size - 1) * p.rt * (p.low_precision ? p.hidden / 8 : row_bytes / 8);
}

// Their bytes: a 16-byte line per unit, and the FP8 lines' scale words (one per 4 lines).
__host__ __device__ inline int64_t lines_bytes(const CombineParams& p, int64_t row_bytes) {
  const int64_t n = lines_units(p, row_bytes);
  return 16 * n + (p.low_precision ? 2 * n : 0);
}

__host__ __device__ inline bool uses_lines(const CombineParams& p, int64_t row_bytes) {
  const int ep = p.ws.ep_size;
  return p.aux.lines_tail != 0 && ep > 1 && ep <= 64 && !p.ctl.degrade && p.group == 0 && row_bytes % 16 == 0 &&
         p.ws.row_stride % 16 == 0 &&
         lines_bytes(p, row_bytes) <= (p.low_precision ? layout::COMBINE_LINES_FP8_BYTES : layout::COMBINE_LINES_BYTES);
}

// A row's lines tail (past the row, zeroed by the daemon with the aux region): the heads, one
// 16-byte line per target, then the lines.
__device__ __forceinline__ uint4* line_heads(const CombineParams& p, uint8_t* row) {
  return at<uint4>(row, p.aux.lines_tail);
}

__device__ __forceinline__ uint8_t* lines_of(const CombineParams& p, uint8_t* row) {
  return row + p.aux.lines_tail + layout::LINE_HEADS_BYTES;
}

__device__ __forceinline__ bool line_has(const ulonglong2& l, uint32_t round) {
  return static_cast<uint32_t>(l.x >> 32) == round && static_cast<uint32_t>(l.y >> 32) == round;
}

// 8 or 16 bytes from a payload of any element alignment (2 bytes at least).
__device__ __forceinline__ uint2 load8_any(const uint8_t* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint2*>(p);
  const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
  return make_uint2(static_cast<uint32_t>(h[0]) | static_cast<uint32_t>(h[1]) << 16,
                    static_cast<uint32_t>(h[2]) | static_cast<uint32_t>(h[3]) << 16);
}

__device__ __forceinline__ uint4 load16_any(const uint8_t* p, bool aligned) {
  if (aligned) return __ldcg(reinterpret_cast<const uint4*>(p));
  const uint2 a = load8_any(p, false), b = load8_any(p + 8, false);
  return make_uint4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ void store16_any(uint8_t* p, const uint4& v, bool aligned) {
  if (aligned) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  unsigned short* h = reinterpret_cast<unsigned short*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[2 * i] = static_cast<unsigned short>(w[i] & 0xffffu);
    h[2 * i + 1] = static_cast<unsigned short>(w[i] >> 16);
  }
}

// The poller's opening of a lines combine (thread q of its block): its head into q's row, for
// every q of the view (its own too: the poller waits for every rank of the view, this one
// included), then its ready word there, released after the head (a peer that acquires the
// ready word with the round and finds no head knows that this rank staged no lines).
__device__ __forceinline__ void open_lines(const CombineParams& p, int round, const RankMask<1>& view) {
  const int q = threadIdx.x, me = p.ws.ep_rank;
  if (q < p.ws.ep_size && view.has(q)) {
    const uint64_t head = line_word(p.spec, static_cast<uint32_t>(round));
    st_line(line_heads(p, row_of(p.ws, q)) + me, head, head);
    st_release_sys_u64(combine_ready_at(p, q, me), combine_word(p, round));
  }
}

// Step 1 of a lines combine: every slot of every source s != me as lines, from the payload,
// kLineUnroll units per thread in flight; threads tid of nthreads (FP8: stage_lines_fp8).
__device__ __forceinline__ void stage_lines(const CombineParams& p, int64_t row_bytes, int round, uint32_t tid,
                                            uint32_t nthreads) {
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  const uint32_t r = static_cast<uint32_t>(round);
  const uint8_t* src = p.payload;  // (the combine region itself when the payload is there)
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 8 == 0;
  uint4* lines = reinterpret_cast<uint4*>(lines_of(p, my_row));
  const int64_t seg = (int64_t)p.rt * row_bytes / 8;  // units (lines) per source
  const int64_t n = (int64_t)(ep - 1) * seg, skip = (int64_t)me * seg;
#pragma unroll 1
  for (int64_t i0 = tid; i0 < n; i0 += (int64_t)nthreads * kLineUnroll) {
    uint2 v[kLineUnroll];
#pragma unroll
    for (int u = 0; u < kLineUnroll; ++u) {
      const int64_t i = i0 + (int64_t)u * nthreads;
      if (i < n) v[u] = load8_any(src + 8 * (i < skip ? i : i + seg), aligned);
    }
#pragma unroll
    for (int u = 0; u < kLineUnroll; ++u) {
      const int64_t i = i0 + (int64_t)u * nthreads;
      if (i < n) st_line(lines + i, line_word(v[u].x, r), line_word(v[u].y, r));
    }
  }
}

// Step 1 of an FP8 lines combine: as stage_lines, a unit 8 bf16 elements of the payload (16
// bytes; the binding checks its alignment), quantized as stage_rows_fp8 does: its 8 e4m3
// bytes one line, and the block's first lane stores the block's scale word. A warp's lanes
// are consecutive units, a block 4 of them (quantize_unit's shuffles take every lane: the
// loop's bounds are the warp's, and the round's units a multiple of 4 since hidden is of 32).
__device__ __forceinline__ void stage_lines_fp8(const CombineParams& p, int round, uint32_t tid, uint32_t nthreads) {
  const int me = p.ws.ep_rank;
  const uint32_t r = static_cast<uint32_t>(round);
  const uint4* src = reinterpret_cast<const uint4*>(p.payload);
  uint4* lines = reinterpret_cast<uint4*>(lines_of(p, row_of(p.ws, me)));
  const int64_t seg = (int64_t)p.rt * (p.hidden / 8);  // units (lines) per source
  const int64_t n = (int64_t)(p.ws.ep_size - 1) * seg, skip = (int64_t)me * seg;
  uint64_t* scales = reinterpret_cast<uint64_t*>(lines + n);
  const uint32_t lane = tid % 32;
#pragma unroll 1
  for (int64_t w0 = tid - lane; w0 < n; w0 += (int64_t)nthreads * kLineUnroll) {
    uint4 v[kLineUnroll];
#pragma unroll
    for (int u = 0; u < kLineUnroll; ++u) {
      const int64_t i = w0 + lane + (int64_t)u * nthreads;
      v[u] = i < n ? src[i < skip ? i : i + seg] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kLineUnroll; ++u) {
      const int64_t i = w0 + lane + (int64_t)u * nthreads;
      int k;
      const uint2 q = quantize_unit(v[u], &k);
      if (i < n) {
        st_line(lines + i, line_word(q.x, r), line_word(q.y, r));
        if (lane % 4 == 0) st_relaxed_sys_u64(scales + i / 4, line_word(static_cast<uint32_t>(k + 127), r));
      }
    }
  }
}

// The poller's probe of target q (its block waits for every peer of the view): q's head
// in this rank's line heads with the round (value: q's descriptor), or q's ready word
// with the round and no head (q staged no lines: value kCombineSpecVoid, so that nothing is
// read from it and a report names what its ready word holds).
struct LinesProbe {
  const uint4* head;
  const uint64_t* word;
  int want;
  __device__ __forceinline__ bool ready(int* value) const {
    const uint32_t r = static_cast<uint32_t>(want);
    ulonglong2 h = ld_line(head);
    if (!line_has(h, r)) {
      if (static_cast<uint32_t>(ld_acquire_sys_u64(word)) != r) return false;
      h = ld_line(head);  // (q writes its head before it publishes)
      if (!line_has(h, r)) {
        *value = static_cast<int>(kCombineSpecVoid);
        return true;
      }
    }
    *value = static_cast<int>(static_cast<uint32_t>(h.x));
    return true;
  }
};

struct LinesFlags {
  const uint4* heads;
  const uint64_t* words;
  int round;
  __device__ LinesProbe operator()(int q) const { return LinesProbe{heads + q, words + q, round}; }
};

// The poller's closing of a lines combine, once each of the launch's `workers` other blocks
// counted itself in (every thread of it read the round): SEND_COUNTERS zeroed (the next
// dispatch counts from zero), the counter reset for the next launch and FLAG_VAL = R + 1.
// The wait is on this launch's own blocks, which never wait for it: bounded all the same (at
// the timeout it writes the status record naming this rank and leaves FLAG_VAL as it is).
__device__ __forceinline__ void close_lines(const CombineParams& p, uint8_t* my_row, int round, uint32_t workers,
                                            int* claim, int* give_up) {
  if (threadIdx.x < p.ws.ep_size) at<int>(my_row, p.aux.send_counters)[threadIdx.x] = 0;
  if (threadIdx.x != 0) return;
  int* counter = at<int>(my_row, p.aux.block_counters) + layout::SLOT_COMBINE_ARRIVAL;
  if (!local_wait([&] { return ld_acquire_gpu(counter) >= static_cast<int>(workers) ? 1 : 0; }, p.ctl,
                  p.ws.ep_rank, round, layout::PHASE_COMBINE, p.ctl.timeout_ns, kSpinPolls, false, claim, give_up)) {
    return;
  }
  *reinterpret_cast<volatile int*>(counter) = 0;  // (every worker added: nothing adds after this)
  *at<int>(my_row, p.aux.flag_val) = round + 1;
}

// acc[0..8) += an FP8 line (8 e4m3 bytes in its words' low halves) with its block's scale
// word, dequantized as pull_item_fp8 does.
__device__ __forceinline__ void add_fp8_line(const ulonglong2& line, uint64_t scale_word, float* acc) {
  const float scale = pow2(static_cast<int>(scale_word & 0xffu) - 127);
  const uint32_t a = static_cast<uint32_t>(line.x), b = static_cast<uint32_t>(line.y);
  fp8x2_add(a & 0xffffu, scale, acc);
  fp8x2_add(a >> 16, scale, acc + 2);
  fp8x2_add(b & 0xffffu, scale, acc + 4);
  fp8x2_add(b >> 16, scale, acc + 6);
}

// A peer's unit v of a lines pull into *l0 and *l1: its two lines (src: the send's first), or
// (kFp8) its FP8 line and its block's scale word (both words of *l1; scl: the send's first).
template <bool kFp8>
__device__ __forceinline__ void ld_peer_unit(const uint8_t* src, const uint8_t* scl, int v, ulonglong2* l0,
                                             ulonglong2* l1) {
  if constexpr (kFp8) {
    *l0 = ld_line(src + 16 * v);
    const uint64_t w = ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(scl + 8 * (v / 4)));
    *l1 = make_ulonglong2(w, w);
  } else {
    *l0 = ld_line(src + 32 * v);
    *l1 = ld_line(src + 32 * v + 16);
  }
}

// pull_item of a lines combine: this rank's own sends read from its payload, every other
// from the target's lines, each spun on until its head and its lines hold the round. A target
// whose head holds another descriptor, or whose ready word came without a head, is not read
// (the poller reports it). Returns false when the wait was given up (*give_up holds the round,
// the job was aborted, or the timeout passed: then this warp posted *give_up and wrote the
// status record, naming its target, unless another thread had).
// kFp8: a peer's unit is one FP8 line and its block's scale word (see uses_lines), held in
// l0 and l1 (both words of l1 the scale word, so that line_has reads its round).
template <typename T, bool kFp8>
__device__ bool pull_item_lines(const CombineParams& p, int t, uint32_t c, const PullGeometry& g, int lane, int target,
                                int slot, int round, int* give_up, int* claim) {
  static_assert(!kFp8 || sizeof(T) == 2, "FP8 lines: bf16 rows");
  const int me = p.ws.ep_rank;
  unsigned sends = __ballot_sync(kFullMask, target >= 0);
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t units8 = row_bytes / 8;
  const int64_t scales_at = 16 * lines_units(p, row_bytes);  // (FP8: the scale words, past the lines)
  const int64_t first = c * static_cast<uint32_t>(g.per_chunk);  // first 16-byte unit of this chunk
  uint8_t* my_row = row_of(p.ws, me);
  const uint8_t* self_rows = p.payload + (int64_t)me * p.rt * row_bytes + first * 16;
  const bool self_aligned = reinterpret_cast<uintptr_t>(self_rows) % 16 == 0;
  const uint4* heads = line_heads(p, my_row);
  const uint64_t* words = at<const uint64_t>(my_row, p.aux.combine_ready);
  const uint32_t* abort_word = reinterpret_cast<const uint32_t*>(p.ctl.block + layout::CB_ABORT);
  const uint32_t r = static_cast<uint32_t>(round);
  const uint64_t limit = p.ctl.timeout_ns;
  constexpr int kUnits = kPullVecsLines;
  constexpr int kSends = kPullSendsVec;
  constexpr int kPer = Elem<T>::kPerVec;
  float acc[kUnits * kPer];
  bool in[kUnits];
  pull_begin(acc, in, first, lane, g.units);
  while (sends != 0) {
    const uint8_t* src[kSends];
    const uint8_t* scl[kSends];
    int tq[kSends];
    bool has[kSends], self[kSends];
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      has[b] = sends != 0;  // warp-uniform
      const int k = has[b] ? __ffs(sends) - 1 : 0;
      if (has[b]) sends &= sends - 1;
      tq[b] = __shfl_sync(kFullMask, target, k);
      const int sq = __shfl_sync(kFullMask, slot, k);
      self[b] = tq[b] == me;
      const int64_t source = me - (me > tq[b] ? 1 : 0);  // this rank's index among tq's sources
      const uint8_t* peer_lines = lines_of(p, row_of(p.ws, tq[b]));
      if constexpr (kFp8) {  // unit v: its line at src + 16 * v, its block's scale word at scl + 8 * (v / 4)
        const int64_t unit0 = (source * p.rt + sq) * g.units + first;  // (first: a multiple of 4)
        src[b] = self[b] ? self_rows + (int64_t)sq * row_bytes : peer_lines + 16 * unit0;
        scl[b] = peer_lines + scales_at + 8 * (unit0 / 4);
      } else {  // unit v: its two lines at src + 32 * v
        src[b] = self[b] ? self_rows + (int64_t)sq * row_bytes : peer_lines + 16 * ((source * p.rt + sq) * units8 + 2 * first);
        scl[b] = nullptr;
      }
    }
    // Every load of the batch before the first use: the heads, the lines, the own rows (16
    // bytes in l0 as two words).
    ulonglong2 head[kSends], l0[kSends][kUnits], l1[kSends][kUnits];
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      head[b] = make_ulonglong2(0, 0);
      if (has[b] && !self[b]) head[b] = ld_line(heads + tq[b]);
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        l0[b][u] = l1[b][u] = make_ulonglong2(0, 0);
        if (has[b] && in[u]) {
          const int v = u * 32 + lane;
          if (self[b]) {
            const uint4 o = load16_any(src[b] + 16 * v, self_aligned);
            l0[b][u] = make_ulonglong2(o.x | static_cast<uint64_t>(o.y) << 32, o.z | static_cast<uint64_t>(o.w) << 32);
          } else {
            ld_peer_unit<kFp8>(src[b], scl[b], v, &l0[b][u], &l1[b][u]);
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      if (!has[b] || self[b]) continue;  // warp-uniform
      // 1: this target's lines hold the round; 2: nothing to read from it; 0: given up
      int state = 0;
      uint64_t t0 = 0;
#pragma unroll 1
      for (uint32_t it = 0;; ++it) {
        if (line_has(head[b], r)) {
          if (static_cast<uint32_t>(head[b].x) != p.spec) {
            state = 2;
            break;
          }
          bool all = true;
#pragma unroll
          for (int u = 0; u < kUnits; ++u) all = all && (!in[u] || (line_has(l0[b][u], r) && line_has(l1[b][u], r)));
          if (all) {
            state = 1;
            break;
          }
        }
        if (it == 0) t0 = global_timer_ns();
        if (it % kGiveUpPollEvery == kGiveUpPollEvery - 1 && ld_volatile(give_up) == round) break;
        bool aborted = false;
        if (it % kAbortPollEvery == kAbortPollEvery - 1) {
          // a ready word without a head: the target staged no lines this round
          if (!line_has(head[b], r) && static_cast<uint32_t>(ld_acquire_sys_u64(words + tq[b])) == r &&
              !line_has(ld_line(heads + tq[b]), r)) {
            state = 2;
            break;
          }
          aborted = ld_relaxed_sys_u32(abort_word) != 0;
        }
        const uint64_t waited = global_timer_ns() - t0;
        if (aborted || waited >= limit) {
          give_up_wait(p.ctl, aborted ? kWaitAborted : kWaitTimeout, tq[b], round, layout::PHASE_COMBINE, waited,
                       claim, give_up);
          break;
        }
        if (it >= kSpinPolls) __nanosleep(64);
        head[b] = ld_line(heads + tq[b]);
#pragma unroll
        for (int u = 0; u < kUnits; ++u) {
          if (in[u] && !(line_has(l0[b][u], r) && line_has(l1[b][u], r))) {
            ld_peer_unit<kFp8>(src[b], scl[b], u * 32 + lane, &l0[b][u], &l1[b][u]);
          }
        }
      }
      if (!__all_sync(kFullMask, state != 0)) return false;
      if (__any_sync(kFullMask, state == 2)) has[b] = false;  // (the head is the same for every lane)
    }
#pragma unroll
    for (int b = 0; b < kSends; ++b) {
      if (!has[b]) continue;
#pragma unroll
      for (int u = 0; u < kUnits; ++u) {
        const ulonglong2 a = l0[b][u];
        if constexpr (kFp8) {
          if (!self[b]) {
            add_fp8_line(a, l1[b][u].x, acc + u * kPer);  // (!in[u]: never stored)
            continue;
          }
        }
        const uint4 v = self[b] ? make_uint4(static_cast<uint32_t>(a.x), static_cast<uint32_t>(a.x >> 32),
                                             static_cast<uint32_t>(a.y), static_cast<uint32_t>(a.y >> 32))
                                : make_uint4(static_cast<uint32_t>(a.x), static_cast<uint32_t>(a.y),
                                             static_cast<uint32_t>(l1[b][u].x), static_cast<uint32_t>(l1[b][u].y));
        Elem<T>::add(v, acc + u * kPer);  // (!in[u]: never stored)
      }
    }
  }
  uint8_t* out_row = static_cast<uint8_t*>(p.out) + (int64_t)t * row_bytes + first * 16;
  const bool out_aligned = reinterpret_cast<uintptr_t>(out_row) % 16 == 0;
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if (in[u]) store16_any(out_row + 16 * (u * 32 + lane), Elem<T>::pack(acc + u * kPer), out_aligned);
  }
  return true;
}

// The poller after its wait: the protocol's COMBINE_COMPLETION_FLAGS get the round (this
// rank's own row), and a target whose combine descriptor differs is reported (the input
// record; nothing is read from it). Not when the round's dispatch already found its
// input wrong (`dispatch_mismatch`): that record is the round's report, and the client
// may already have raised and cleared it (a second record would be raised by the next,
// correct, round); nor over a record of the dispatch not yet raised.
// (peer_specs: the descriptors the poller saw, where not the ready words' (kCombineSpecVoid:
// the ready word's).)
template <int W>
__device__ __forceinline__ void combine_waited(const CombineParams& p, uint8_t* my_row, int round,
                                               const RankMask<W>& view, const RankMask<W>& seen,
                                               const RankMask<W>& bad, bool dispatch_mismatch,
                                               const int* peer_specs = nullptr) {
  const int q = threadIdx.x;
  if (q < p.ws.ep_size && view.has(q) && seen.has(q)) {
    at<int>(my_row, p.aux.combine_completion_flags)[q] = round;
  }
  const int64_t rec = layout::CB_INPUT + (int64_t)p.ctl.ep_rank * layout::INPUT_RECORD_SIZE + layout::INPUT_CODE;
  if (bad.any() && !dispatch_mismatch && threadIdx.x == 0 && *cb_field<uint32_t>(p.ctl, rec) == layout::INPUT_OK) {
    const int peer = bad.lowest();
    const uint64_t w = *reinterpret_cast<const volatile unsigned long long*>(
        at<uint64_t>(my_row, p.aux.combine_ready) + peer);
    const int theirs = peer_specs != nullptr && peer_specs[peer] != static_cast<int>(kCombineSpecVoid)
                           ? peer_specs[peer]
                           : static_cast<int>(w >> 32);
    write_input(p.ctl, layout::INPUT_COMBINE_MISMATCH, peer | (layout::SPEC_FIELD_COMBINE << 8), theirs, round,
                static_cast<int>(p.spec));
  }
}

// Grid: at most as many blocks as can be co-resident within lim.sm_budget SMs
// (the launcher sizes it), because blocks wait for the flag that the last
// block of the same grid writes. Phases: stage -> arrive (last block: flags,
// reset SEND_COUNTERS, FLAG_VAL = R + 1) -> wait for every peer -> pull.
// (Lines, kPathLines: block 0 is the poller and the others stage and pull; see
// uses_lines.)
// Overlapped (the launcher's choice: enough rows to stage, payload not in the
// workspace, ep > 1): only the first overlap_stage_blocks blocks stage,
// slice by slice; every block pulls as soon as it arrived, items taken from a
// counter in the order (tokens with no remote send) then (target q, slot s,
// chunk): the order in which q stages, so pullers rarely wait; each item waits
// for its rows' slices. Only the last block waits for the whole-region flags.
// W: the words of a rank mask (1 when ep_size <= 64). kLl: low-latency pairs (CombineParams
// says what; never overlapped): the payload staged through stage_index, and out row u the
// weighted sum of group u's pairs. kAllSends: see pull_geometry.
// kPath: kPathGeneral serves every round; kPathPlain only a round neither degraded nor
// overlapped (the code of those two is left out: a smaller kernel, whose code a round after
// an L2 flush fetches cold); kPathLines a round that stages lines (see uses_lines; it asks
// for two blocks per SM: 128 registers at most, which its pull fits without spilling).
template <typename T, bool kVec, bool kFp8, int W, bool kLl = false, bool kAllSends = false, int kPath = kPathGeneral>
__global__ void __launch_bounds__(kThreads, kPath == kPathLines ? 2 : 0) combine_kernel(const CombineParams p) {
  constexpr int kRanks = 64 * W;  // the most ranks this instantiation serves
  constexpr bool kLines = kPath == kPathLines;
  const bool degrade = kPath == kPathGeneral && p.ctl.degrade;
  wait_prior_grid();
  const int me = p.ws.ep_rank, ep = p.ws.ep_size;
  uint8_t* my_row = row_of(p.ws, me);
  int* block_counters = at<int>(my_row, p.aux.block_counters);
  const int round = ld_volatile(at<int>(my_row, p.aux.flag_val));
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int* recv = at<int>(my_row, p.aux.recv_counters);
  // Degraded mode: the round's view (its prologue's); a round that did not run here is
  // not combined either (the host raises what the prologue recorded).
  RankMask<W> view = RankMask<W>::all();
  if (degrade) {
    if (ld_volatile(block_counters + layout::SLOT_VIEW_ROUND) != round) return;
    view = RankMask<W>::load(block_counters + layout::SLOT_VIEW);
  }
  view = with_caller_mask<W>(view, p.caller_mask, ep, degrade);
  // The dispatch of this round saw a peer pass another rt: the regions do not line up, so
  // nothing is pulled and the output is zeros; the flags still go round so that every rank
  // completes the round (every rank saw the mismatch).
  // (Read now, compared after the arrival: the staging's loads need not wait for it.)
  const int mismatch_round = ld_volatile(block_counters + layout::SLOT_RT_MISMATCH);
  const bool overlap = kPath == kPathGeneral && p.overlap_stage_blocks > 0;  // the launcher decides (enough rows to stage)
  const int nstage = p.overlap_stage_blocks;
  // The arrival counter and, when the staging reads them, the received counts: fetched
  // into L2 now, while the staging reads the payload (they would be cold misses where
  // they are used).
  if (threadIdx.x < 32) {
    prefetch_l2(block_counters, 4 * layout::BLOCK_COUNTER_SLOTS, threadIdx.x, 32);
    if ((kFp8 || !p.payload_in_workspace) && !kLines && (kLl || overlap || !stages_all_slots(p, row_bytes))) {
      prefetch_l2(recv, 4 * ep, threadIdx.x, 32);
    }
  }
  // Lines: block 0 is the launch's poller (it opens the round, waits for the heads and closes
  // the round: the first block placed, so that the peers see the heads early), and stages and
  // pulls nothing unless it is the only block; the others, the workers, stage and pull, as
  // worker blockIdx.x - 1 of `workers`.
  const bool alone = gridDim.x == 1;
  const bool poller_block = kLines && blockIdx.x == 0;
  const uint32_t workers = kLines && !alone ? gridDim.x - 1 : gridDim.x;
  const bool worker = !kLines || alone || blockIdx.x > 0;
  const uint32_t wid = kLines && !alone ? (worker ? blockIdx.x - 1 : 0) : blockIdx.x;
  // Overlapped: this rank's send counts, as positions (read before arriving: the last block zeroes them).
  __shared__ int s_pos[kRanks + 1];
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
  //    (Staging happens only when the payload is not the region, so this rank's own rows
  //    are never staged: only this rank pulls them, from the payload.)
  if constexpr (kLines) {
    static_assert(W == 1, "lines: at most 64 ranks");
    if (poller_block) open_lines(p, round, view);
    if constexpr (kFp8) {
      if (worker) stage_lines_fp8(p, round, wid * blockDim.x + threadIdx.x, workers * blockDim.x);
    } else {
      if (worker) stage_lines(p, row_bytes, round, wid * blockDim.x + threadIdx.x, workers * blockDim.x);
    }
  } else if constexpr (kFp8) {
    stage_rows_fp8(p, recv, blockIdx.x * (kThreads / 32) + threadIdx.x / 32, gridDim.x * (kThreads / 32),
                   threadIdx.x % 32);
  } else if constexpr (kLl) {
    stage_rows_indexed(p, recv, row_bytes, blockIdx.x * (kThreads / 32) + threadIdx.x / 32, gridDim.x * (kThreads / 32),
                       threadIdx.x % 32);
  } else if (overlap) {
    if (static_cast<int>(blockIdx.x) < nstage) stage_slices(p, recv, round, nstage);
  } else if (!p.payload_in_workspace) {
    stage_rows<kVec>(p, recv, row_bytes, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  }

  // 2. Release; the last block tells every peer that its outputs are ready.
  //    Lines: nothing is released and no block waits here. A worker counts itself in once
  //    every thread of it read the round (each stored lines tagged with it), so that the
  //    poller moves FLAG_VAL on only after that; one lane of its last warp adds, without a
  //    round trip, while the other warps go on to their pulls.
  if constexpr (kLines) {
    if (!poller_block) {
      __syncthreads();
      if (threadIdx.x == kThreads - 32) red_add_release_gpu(block_counters + layout::SLOT_COMBINE_ARRIVAL, 1);
    }
  }
  const bool last = kLines ? poller_block : arrive_last(block_counters + layout::SLOT_COMBINE_ARRIVAL, Writes::kLocal);
  allow_dependents();  // every block is resident: the next kernel may be scheduled
  if (!kLines && last) {
    const int q = threadIdx.x;
    if (q < ep) {
      // Degraded mode: the outputs only to the sources whose tokens the dispatch received (it
      // records them in DISPATCH_COMPLETION_FLAGS); one it let go of (it left the mask
      // meanwhile) may still be alive (its node was counted lost), and what was staged for it
      // was computed from whatever its slots held: it gets the void descriptor, so that its
      // combine counts nothing from this rank and ends without waiting for its timeout.
      if (view.has(q)) {
        const bool got = !degrade || ld_volatile(at<int>(my_row, p.aux.dispatch_completion_flags) + q) == round;
        const uint64_t word = got ? combine_word(p, round)
                                  : (static_cast<uint64_t>(kCombineSpecVoid) << 32) | static_cast<uint32_t>(round);
        st_release_sys_u64(combine_ready_at(p, q, me), word);
      }
      // The next dispatch counts from zero (it cannot zero them itself before its atomics).
      at<int>(my_row, p.aux.send_counters)[q] = 0;
    }
    if (threadIdx.x == 0) *at<int>(my_row, p.aux.flag_val) = round + 1;  // every block read R before arriving
  }

  const bool mismatch = mismatch_round == round;
  // the rows of out (low-latency pairs: one per group of pairs)
  const int out_rows = kLl ? p.local_num_tokens / p.group : p.local_num_tokens;
  if (mismatch) {
    uint8_t* out = static_cast<uint8_t*>(p.out);
    const int64_t n = (int64_t)out_rows * row_bytes;
    // (rare: both loops unroll 1, so that the common path jumps over little code)
#pragma unroll 1
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
      out[i] = 0;
    }
    if (p.degraded != nullptr) {
#pragma unroll 1
      for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < out_rows;
           i += (int64_t)gridDim.x * blockDim.x) {
        p.degraded[i] = 0;
      }
    }
  }

  // 3. Wait for every peer. Blocks with nothing to pull leave now; the last
  //    block always waits, so the launch never completes before every peer's
  //    outputs are ready (the next dispatch relies on that). With overlap only
  //    the last block waits here; the others wait per item (wait_slice).
  const PullGeometry g = pull_geometry<T, kVec, kAllSends, kLines>(p.hidden);
  const uint32_t chunks = static_cast<uint32_t>(g.chunks);  // the launcher checks T * chunks < 2^31
  const uint32_t items = mismatch ? 0u : static_cast<uint32_t>(out_rows) * chunks;
  constexpr uint32_t warps = kThreads / 32;
  const uint32_t first_item = wid * warps;
  int* claim = block_counters + layout::SLOT_STATUS_CLAIM;
  int* give_up = block_counters + layout::SLOT_COMBINE_GIVE_UP;
  if (!overlap && !last && first_item >= items) return;
  // The sends of this warp's first token are local (this rank's own dispatch wrote them):
  // read them before the wait, not after it.
  const int lane = threadIdx.x % 32;
  const uint32_t my_first = worker ? first_item + threadIdx.x / 32 : items;  // (the poller block pulls nothing)
  int first_t = -1, first_target = -1, first_slot = -1, first_routed = -1;
  float first_weight = 1.f;
  if (!overlap && my_first < items) {
    first_t = static_cast<int>(my_first / chunks);
    if constexpr (kLl) {
      pair_sends(p, first_t, lane, &first_target, &first_slot, &first_routed, &first_weight);
    } else {
      token_sends(p, first_t, lane, &first_target, &first_slot, &first_routed);
      if constexpr (kVec && kPath != kPathGeneral) {
        if (self_from_payload(p)) {
          prefetch_self_chunk(p, row_bytes, my_first % chunks, g, lane, first_target, first_slot);
        }
      }
    }
  }
  int unused = 0;
  RankMask<W> seen = RankMask<W>::all(), bad = RankMask<W>::none();
  const CombineFlags flags{at<uint64_t>(my_row, p.aux.combine_ready), round};
  if constexpr (kLines) {
    // (nobody waits before the pull: the pullers spin on their lines; the poller waits after)
  } else if (!degrade) {
    if ((last || !overlap) && !block_wait<W>(flags, ep, round, p.ctl, layout::PHASE_COMBINE, /*poller=*/last, claim,
                                          give_up, &unused, view, &seen, &bad, static_cast<int>(p.spec))) {
      return;
    }
    if (last) combine_waited(p, my_row, round, view, seen, bad, mismatch);
  } else if (last) {
    // Degraded mode (never overlapped): the poller alone waits, letting go of a peer whose
    // bit is cleared, and posts whose flags it saw; every block counts exactly those (a
    // target whose combine descriptor differs is not counted).
    const CombineFlagsDegraded flags_or_later{flags.words, round};
    if (!block_wait<W>(flags_or_later, ep, round, p.ctl, layout::PHASE_COMBINE, /*poller=*/true, claim, give_up, &unused,
                    view, &seen, &bad, static_cast<int>(p.spec))) {
      return;
    }
    // A target that let this rank go in its dispatch flagged the void descriptor: not a
    // mismatch to report, and nothing of it is counted (thread q holds q's descriptor).
    __shared__ unsigned long long s_void[W];
    if (threadIdx.x < W) s_void[threadIdx.x] = 0;
    __syncthreads();
    if (threadIdx.x < ep && seen.has(threadIdx.x) && bad.has(threadIdx.x) &&
        static_cast<uint32_t>(unused) == kCombineSpecVoid) {
      shared_set<W>(s_void, threadIdx.x);
    }
    __syncthreads();
    const RankMask<W> voided = shared_mask<W>(s_void);
    bad = bad.without(voided);
    combine_waited(p, my_row, round, view, seen, bad, mismatch);
    seen = seen.without(bad).without(voided);
    if (threadIdx.x == 0) {
      seen.store(block_counters + layout::SLOT_COMBINE_SEEN);
      st_release_gpu(block_counters + layout::SLOT_COMBINE_SEEN_ROUND, round);
      if (p.seen_out != nullptr) seen.store(p.seen_out);
      if (p.seen_dev != nullptr) seen.store(p.seen_dev);
    }
  } else if (!wait_seen<W>(p, block_counters, round, give_up, claim, &seen)) {
    return;
  }

  // 4. Pull and reduce.
  if (!overlap) {
    const uint32_t nw = workers * warps;
    bool failed = false;  // (lines: this warp's wait was given up)
#pragma unroll 1
    for (uint32_t item = my_first; item < items; item += nw) {
      const int t = static_cast<int>(item / chunks);
      const uint32_t c = item % chunks;
      int target = first_target, slot = first_slot, routed = first_routed;
      float weight = first_weight;
      if (t != first_t) {
        if constexpr (kLl) {
          pair_sends(p, t, lane, &target, &slot, &routed, &weight);
        } else {
          token_sends(p, t, lane, &target, &slot, &routed);
        }
      }
      if (degrade) count_seen<W>(p, t, c, routed, seen, &target, lane);
      if (bad.any() && target >= 0 && bad.has(target)) target = -1;  // never read from a target that disagreed
      if constexpr (kLines) {
        if (!pull_item_lines<T, kFp8>(p, t, c, g, lane, target, slot, round, give_up, claim)) {
          failed = true;
          break;
        }
      } else if constexpr (kFp8) {
        pull_item_fp8(p, t, c, g, lane, target, slot);
      } else {
        pull_item<T, kVec, kLl, kAllSends>(p, t, c, g, lane, target, slot, weight);
      }
    }
    if constexpr (kLines) {
      // The poller (after its own pulls where it is the only block): every head (or a ready
      // word without one), for the reports and the completion words; the launch ends only
      // once every peer's came. Then it closes the round.
      if (last) {
        if (!__syncthreads_or(failed)) {
          __shared__ int s_spec[64];
          int value = 0;
          const LinesFlags heads{line_heads(p, my_row), flags.words, round};
          if (block_wait<W>(heads, ep, round, p.ctl, layout::PHASE_COMBINE, /*poller=*/true, claim, give_up, &value,
                            view, &seen, &bad, static_cast<int>(p.spec))) {
            if (threadIdx.x < ep) s_spec[threadIdx.x] = value;
            __syncthreads();
            combine_waited(p, my_row, round, view, seen, bad, mismatch, s_spec);
          }
        }
        close_lines(p, my_row, round, gridDim.x - 1, claim, give_up);
      }
    }
    return;
  }
  if constexpr (kLl) return;  // (never overlapped)
  const uint32_t ntok = static_cast<uint32_t>(p.local_num_tokens);
  const uint32_t total = mismatch ? 0u : ntok + static_cast<uint32_t>(s_pos[ep]) * chunks;  // launcher: < 2^31
  const int* slot_tokens = at<int>(my_row, p.aux.slot_tokens);
#pragma unroll 1
  for (;;) {
    uint32_t item = 0;
    if (lane == 0) item = static_cast<uint32_t>(atomicAdd(block_counters + layout::SLOT_PULL_WORK, 1));
    item = __shfl_sync(kFullMask, item, 0);
    if (item >= total) break;
    int t, target, slot;
    if (item < ntok) {  // a token with no remote send: all of it, here (nobody waits for it)
      t = static_cast<int>(item);
      token_sends(p, t, lane, &target, &slot);
      if (__any_sync(kFullMask, target >= 0 && target != me)) continue;
      if constexpr (!kFp8) {
        for (uint32_t c = 0; c < chunks; ++c) pull_item<T, kVec>(p, t, c, g, lane, target, slot);
      }
      continue;
    }
    const uint32_t pos = (item - ntok) / chunks, c = (item - ntok) % chunks;
    int q = 0;  // the target whose slot range holds pos: the last q with s_pos[q] <= pos
    for (int b = kRanks; b > 0; b >>= 1) {
      if (q + b < ep && static_cast<uint32_t>(s_pos[q + b]) <= pos) q += b;
    }
    t = slot_tokens[(int64_t)q * p.aux.max_num_tokens + (pos - s_pos[q])];
    if (t < 0 || t >= p.local_num_tokens) continue;  // never written this round: cannot happen
    token_sends(p, t, lane, &target, &slot);
    // The token's item belongs to its lowest remote target; the others skip it.
    const int primary = __reduce_min_sync(kFullMask, target >= 0 && target != me ? target : kRanks);
    if (primary != q) continue;
    int ok = 1;
    if (target >= 0 && target != me) ok = wait_slice(p, my_row, target, slot, round, give_up, claim);
    if (!__all_sync(kFullMask, ok != 0)) return;  // __all_sync also orders the acquires before every lane's loads
    if (ok == 2) target = -1;  // the target's combine descriptor differs: nothing is read from it
    if constexpr (!kFp8) pull_item<T, kVec>(p, t, c, g, lane, target, slot);
  }
}

template <typename T, bool kVec, bool kFp8, int W, bool kLl = false, bool kAllSends = false>
cudaError_t launch_typed(const CombineParams& p, cudaStream_t stream) {
  const void* fn = reinterpret_cast<const void*>(&combine_kernel<T, kVec, kFp8, W, kLl, kAllSends>);
  int resident = 0;
  cudaError_t err = launch::resident_blocks(fn, kThreads, p.lim, &resident);
  if (err != cudaSuccess) return err;
  const PullGeometry g = pull_geometry<T, kVec, kAllSends>(p.hidden);
  // (32-bit item indices; the front end bounds T and hidden far below this)
  if ((int64_t)p.local_num_tokens * (g.chunks + 1) >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t out_rows = kLl ? p.local_num_tokens / p.group : p.local_num_tokens;
  const int64_t pull_blocks = launch::ceil_div(out_rows * g.chunks, kThreads / 32);
  const int64_t staged_sources = kFp8 || self_from_payload(p) ? p.ws.ep_size - 1 : p.ws.ep_size;
  const int64_t stage_bytes = p.payload_in_workspace && !kFp8 ? 0 : staged_sources * p.rt * row_bytes;  // at most rt rows each
  // (low-latency pairs: a warp per slot at most)
  const int64_t stage_blocks = kLl ? launch::ceil_div(staged_sources * p.rt, kThreads / 32)
                                   : launch::ceil_div(stage_bytes, kThreads * 16 * kCopyUnroll);
  const int grid = launch::clamp_grid(pull_blocks > stage_blocks ? pull_blocks : stage_blocks, resident);
  CombineParams q = p;
  q.overlap_stage_blocks = 0;
  // (not in degraded mode: there every block counts the targets the poller saw, so no
  // block may pull a target's slices before its whole-region flag)
  if (!kFp8 && !kLl && !p.ctl.degrade && !p.payload_in_workspace && p.ws.ep_size > 1 &&
      stage_bytes >= kOverlapMinBytes && row_bytes >= kOverlapMinRowBytes) {
    q.overlap_stage_blocks = grid / kOverlapStageShare < 1 ? 1 : grid / kOverlapStageShare;
  }
  if constexpr (W == 1) {
    if (!p.ctl.degrade && q.overlap_stage_blocks == 0) {
      return launch::overlapped(combine_kernel<T, kVec, kFp8, W, kLl, kAllSends, kPathPlain>, grid, kThreads, stream, q);
    }
  }
  return launch::overlapped(combine_kernel<T, kVec, kFp8, W, kLl, kAllSends>, grid, kThreads, stream, q);
}

// A lines combine (uses_lines): 16-byte units whatever the payload's and out's alignment.
template <typename T, bool kFp8 = false>
cudaError_t launch_lines(const CombineParams& p, cudaStream_t stream) {
  const void* fn = reinterpret_cast<const void*>(&combine_kernel<T, true, kFp8, 1, false, false, kPathLines>);
  int resident = 0;
  cudaError_t err = launch::resident_blocks(fn, kThreads, p.lim, &resident);
  if (err != cudaSuccess) return err;
  const PullGeometry g = pull_geometry<T, true, false, true>(p.hidden);
  if ((int64_t)p.local_num_tokens * (g.chunks + 1) >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t row_bytes = p.hidden * (int64_t)sizeof(T);
  const int64_t pull_blocks = launch::ceil_div((int64_t)p.local_num_tokens * g.chunks, kThreads / 32);
  const int64_t stage_blocks = launch::ceil_div(lines_units(p, row_bytes), (int64_t)kThreads * kLineUnroll);
  CombineParams q = p;
  q.overlap_stage_blocks = 0;
  // the poller's block, then the workers (the poller alone where only one block fits: it then
  // stages and pulls too)
  const int grid = resident < 2 ? 1 : launch::clamp_grid(pull_blocks > stage_blocks ? pull_blocks : stage_blocks,
                                                          resident - 1) + 1;
  return launch::overlapped(combine_kernel<T, true, kFp8, 1, false, false, kPathLines>, grid, kThreads, stream, q);
}

// The instantiation of the dtype and the alignment (the binding checked the low precision
// combine's needs; a debug build asserts them again).
template <int W>
cudaError_t launch_words(const CombineParams& p, cudaStream_t stream) {
  const int elem = p.dtype == DType::kFloat32 ? 4 : 2;
  const int64_t row_bytes = p.hidden * elem;
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.ws.base + p.combine_offset) % 16 == 0 && p.ws.row_stride % 16 == 0 &&
                   (!self_from_payload(p) || reinterpret_cast<uintptr_t>(p.payload) % 16 == 0);
  if (p.group > 0) {  // low-latency pairs: bf16 16-byte rows only (the binding checks)
    if (p.low_precision || p.dtype != DType::kBFloat16 || !vec || p.payload_in_workspace ||
        p.stage_index == nullptr || p.local_num_tokens % p.group != 0 ||
        (p.local_num_tokens > 0 && p.group_weights == nullptr) ||
        reinterpret_cast<uintptr_t>(p.payload) % 16 != 0) {
      return cudaErrorInvalidValue;
    }
    const int64_t items = (int64_t)(p.local_num_tokens / p.group) * pull_geometry<__nv_bfloat16, true>(p.hidden).chunks;
    return items < kAllSendsMaxItems ? launch_typed<__nv_bfloat16, true, false, W, true, true>(p, stream)
                                     : launch_typed<__nv_bfloat16, true, false, W, true>(p, stream);
  }
  if constexpr (W == 1) {
    if (uses_lines(p, row_bytes)) {
      if (p.low_precision) return launch_lines<__nv_bfloat16, true>(p, stream);  // (bf16: the binding checks)
      switch (p.dtype) {
        case DType::kFloat32:
          return launch_lines<float>(p, stream);
        case DType::kFloat16:
          return launch_lines<__half>(p, stream);
        case DType::kBFloat16:
          return launch_lines<__nv_bfloat16>(p, stream);
      }
      return cudaErrorInvalidValue;
    }
  }
  if (p.low_precision) {
    // bf16 rows, whole scale blocks, 16-byte vectors everywhere
    A2AD_DEBUG_ASSERT(p.dtype == DType::kBFloat16 && p.hidden % layout::FP8_BLOCK == 0);
    A2AD_DEBUG_ASSERT(reinterpret_cast<uintptr_t>(p.payload) % 16 == 0);
    if (!vec) return cudaErrorInvalidValue;  // the FP8 kernel has no unaligned path
    return launch_typed<__nv_bfloat16, true, true, W>(p, stream);
  }
  switch (p.dtype) {
    case DType::kFloat32:
      return vec ? launch_typed<float, true, false, W>(p, stream) : launch_typed<float, false, false, W>(p, stream);
    case DType::kFloat16:
      return vec ? launch_typed<__half, true, false, W>(p, stream) : launch_typed<__half, false, false, W>(p, stream);
    case DType::kBFloat16:
      return vec ? launch_typed<__nv_bfloat16, true, false, W>(p, stream)
                 : launch_typed<__nv_bfloat16, false, false, W>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

// The binding checked the arguments (csrc/bindings.cpp, behind the Python front end); the
// checks here are debug asserts (A2AD_DEBUG_CHECKS), except the rank count the mask words
// depend on.
cudaError_t launch_combine(const CombineParams& p, cudaStream_t stream) {
  A2AD_DEBUG_ASSERT(launch::valid_workspace(p.ws) && launch::valid_aux(p.aux) && launch::valid_control(p.ctl));
  A2AD_DEBUG_ASSERT(p.top_k >= 1 && p.top_k <= kMaxTopK && p.top_k <= p.aux.topk_stride);
  A2AD_DEBUG_ASSERT(p.hidden >= 1 && p.rt >= 1 && p.rt <= p.aux.max_num_tokens);
  A2AD_DEBUG_ASSERT(p.local_num_tokens >= 0 && p.local_num_tokens <= p.rt);
  A2AD_DEBUG_ASSERT(p.local_num_tokens == 0 || p.out != nullptr);
  A2AD_DEBUG_ASSERT(p.payload_in_workspace || p.payload != nullptr);
  A2AD_DEBUG_ASSERT(!p.ctl.degrade || p.local_num_tokens == 0 || p.degraded != nullptr);
  if (p.ws.ep_size < 1 || p.ws.ep_size > kMaxEpSize) return cudaErrorInvalidValue;
  // One-word masks up to 64 ranks: a job of that size runs the code of a plain u64.
  return p.ws.ep_size <= 64 ? launch_words<1>(p, stream) : launch_words<kMaskWords>(p, stream);
}

cudaError_t load_combine_kernels() {
  // every instantiation launch_combine may pick
#define A2AD_COMBINE_KERNELS(W, P)                                                                      \
  reinterpret_cast<const void*>(&combine_kernel<float, true, false, W, false, false, P>),               \
      reinterpret_cast<const void*>(&combine_kernel<float, false, false, W, false, false, P>),          \
      reinterpret_cast<const void*>(&combine_kernel<__half, true, false, W, false, false, P>),          \
      reinterpret_cast<const void*>(&combine_kernel<__half, false, false, W, false, false, P>),         \
      reinterpret_cast<const void*>(&combine_kernel<__nv_bfloat16, true, false, W, false, false, P>),   \
      reinterpret_cast<const void*>(&combine_kernel<__nv_bfloat16, false, false, W, false, false, P>),  \
      reinterpret_cast<const void*>(&combine_kernel<__nv_bfloat16, true, true, W, false, false, P>),    \
      reinterpret_cast<const void*>(&combine_kernel<__nv_bfloat16, true, false, W, true, false, P>),    \
      reinterpret_cast<const void*>(&combine_kernel<__nv_bfloat16, true, false, W, true, true, P>)
  const void* fns[] = {A2AD_COMBINE_KERNELS(1, kPathGeneral), A2AD_COMBINE_KERNELS(kMaskWords, kPathGeneral),
                       A2AD_COMBINE_KERNELS(1, kPathPlain),
                       reinterpret_cast<const void*>(&combine_kernel<float, true, false, 1, false, false, kPathLines>),
                       reinterpret_cast<const void*>(&combine_kernel<__half, true, false, 1, false, false, kPathLines>),
                       reinterpret_cast<const void*>(
                           &combine_kernel<__nv_bfloat16, true, false, 1, false, false, kPathLines>),
                       reinterpret_cast<const void*>(
                           &combine_kernel<__nv_bfloat16, true, true, 1, false, false, kPathLines>)};
#undef A2AD_COMBINE_KERNELS
  cudaFuncAttributes a;
  for (const void* fn : fns) {
    const cudaError_t err = cudaFuncGetAttributes(&a, fn);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace a2ad
