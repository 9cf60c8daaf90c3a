// The local steps of a2ad.deep_ep's low-latency path on the CUDA backend around a2ad's own
// dispatch kernel (a2ad/deep_ep.py: each (token, k) pair is one token of a top_k = 1 job; a
// bf16 dispatch is the dispatch kernel's pairs instantiation and its combine the combine
// kernel's, csrc/dispatch.cu and csrc/combine.cu).
// Neither touches a peer's memory or waits for anything but the kernel before it on the
// stream. Each does in one launch what the same module does with torch ops on the host
// backend, with the same results (the GPU tests compare the two):
//
//   ll_pack     an FP8 dispatch's pairs: the route (the expert, or this rank's first expert
//               for a pair with none), the metadata (token, expert or -1), and each pair's
//               row: the token's e4m3 row with one float32 scale per 128 channels
//               (scale = max(amax, 1e-4) / 448, optionally rounded up to a power of two).
//   ll_arrange  the pairs this rank received, expert-major: every block counts the received
//               pairs per (local expert, source) into shared memory, numbers its own slots in
//               slot order within each (expert, source), and copies each pair's row (and
//               scales, as float32 or UE8M0 bytes in DeepEP's layout) to
//               expert * (ep * num_max) + begin(expert, source) + number; block 0 writes
//               recv_count, layout_range and the statistics. This is a stable sort by
//               (expert, source) of the received slots, as the host path's; and each
//               slot's row in the output (`dest`), through which combine reads.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "launch.cuh"
#include "primitives.cuh"

namespace a2ad {
namespace {

using namespace dev;

constexpr int kLlThreads = 128;                 // pack: 8 elements per thread
constexpr int kLlChunk = kLlThreads * 8;        // elements of a row per block of pack
constexpr int kArrangeThreads = 256;
constexpr int kArrangeWarps = kArrangeThreads / 32;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;

__device__ __forceinline__ float bf16_bits_to_float(uint32_t b) { return __uint_as_float(b << 16); }


__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_bits_to_float(w[i] & 0xffffu);
    f[2 * i + 1] = bf16_bits_to_float(w[i] >> 16);
  }
}

__device__ __forceinline__ int64_t expert_id(const LlRouting& r, int64_t i) {
  return r.idx64 != nullptr ? r.idx64[i] : static_cast<int64_t>(r.idx32[i]);
}

// -------------------------------------------------------------------------------------------
// ll_pack: grid (T, ceil(H / kLlChunk)); thread i of block (t, c) holds elements
// c * kLlChunk + 8 i .. + 8 of token t.
// -------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kLlThreads) ll_pack_kernel(LlPackParams p) {
  wait_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  const int K = p.routing.K;
  if (blockIdx.y == 0 && static_cast<int>(threadIdx.x) < K) {
    const int64_t i = t * K + threadIdx.x;
    const int64_t e = expert_id(p.routing, i);
    const int id = e > INT32_MAX ? INT32_MAX : static_cast<int>(e);
    const bool valid = e >= 0;
    p.route[i] = valid ? id : p.rank * p.lx;
    p.meta[2 * i] = static_cast<int>(t);
    p.meta[2 * i + 1] = valid ? id : -1;
  }
  const int h0 = blockIdx.y * kLlChunk + threadIdx.x * 8;
  const bool in = h0 < p.H;  // H % 128 == 0 (the binding checks)
  uint4 v = make_uint4(0, 0, 0, 0);
  if (in) v = *reinterpret_cast<const uint4*>(p.x + t * p.H + h0);
  // A 128-channel block is 16 consecutive threads (H % 128 == 0, so a block never
  // straddles two chunks); every thread of the warp takes part in the shuffles.
  float f[8];
  unpack_bf16x8(v, f);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = 8; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  if (!in) return;
  float scale = __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max);
  if (p.round_scale) {  // the next power of two, exactly (scale = m * 2^e, m in [0.5, 1))
    int e = 0;
    const float m = frexpf(scale, &e);
    scale = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  }
  const float inv = __frcp_rn(scale);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float q = fminf(fmaxf(__fmul_rn(f[i], inv), -kFp8Max), kFp8Max);
    const uint32_t b = static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
    if (i < 4) lo |= b << (8 * i);
    else hi |= b << (8 * (i - 4));
  }
  const int ns = p.H / 128;
  const bool scale_lane = (threadIdx.x & 15) == 0;
  for (int k = 0; k < K; ++k) {
    const int64_t pair = t * K + k;
    *reinterpret_cast<uint2*>(p.rows + pair * p.H + h0) = make_uint2(lo, hi);
    if (scale_lane) p.scales[pair * ns + h0 / 128] = scale;
  }
}

// -------------------------------------------------------------------------------------------
// ll_arrange: grid ceil(ep * rt / slots_per_block); block b numbers and copies the global
// slots [b * spb, (b + 1) * spb), slot g = s * rt + j being slot j of source s.
// Shared memory: begin[E] (counts, then the exclusive prefix over the sources), pre[E]
// (pairs of each (expert, source) in the slots before the block's), then the block's
// slot keys and numbers; E = lx * ep, key = le * ep + s.
// -------------------------------------------------------------------------------------------
__device__ __forceinline__ int received(const LlArrangeParams& p, int s) {
  return received_rows(p.counts[s], p.rt);
}

// The key of slot j of source s (-1: not received, or not for one of this rank's experts).
__device__ __forceinline__ int slot_key(const LlArrangeParams& p, int s, int j, int n) {
  if (j >= n) return -1;
  const int e = p.meta[s * p.meta_src_stride + 2 * static_cast<int64_t>(j) + 1];
  const int le = e - p.rank * p.lx;
  return e >= 0 && le >= 0 && le < p.lx ? le * p.ep + s : -1;
}

__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  const int nvec = bytes / 16;  // bytes % 16 == 0 (the binding checks)
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  int v = lane;
  // four 16-byte loads in flight per lane, then the rest one at a time (neither loop
  // unrolled further: unrolled, the tail spilled)
#pragma unroll 1
  for (; v + 96 < nvec; v += 128) {
    const uint4 a = s[v], b = s[v + 32], c = s[v + 64], e = s[v + 96];
    d[v] = a;
    d[v + 32] = b;
    d[v + 64] = c;
    d[v + 96] = e;
  }
#pragma unroll 1
  for (; v < nvec; v += 32) d[v] = s[v];
}

__global__ void __launch_bounds__(kArrangeThreads) ll_arrange_kernel(LlArrangeParams p) {
  extern __shared__ int smem[];
  const int E = p.lx * p.ep;
  int* begin = smem;
  int* pre = smem + E;
  int* skey = pre + E;
  int* snum = skey + p.slots_per_block;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  wait_prior_grid();
  allow_dependents();
  for (int i = tid; i < E; i += kArrangeThreads) {
    begin[i] = 0;
    pre[i] = 0;
  }
  __syncthreads();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * p.slots_per_block;
  // (1) every received pair of this rank's experts, counted per (expert, source); those in
  // slots before the block's also in pre
  for (int s = 0; s < p.ep; ++s) {
    const int n = received(p, s);
    for (int j = tid; j < n; j += kArrangeThreads) {
      const int key = slot_key(p, s, j, n);
      if (key < 0) continue;
      atomicAdd(&begin[key], 1);
      if (static_cast<int64_t>(s) * p.rt + j < first) atomicAdd(&pre[key], 1);
    }
  }
  __syncthreads();
  if (warp == 0) {
    // (2) the block's slots numbered in slot order within each (expert, source)
    for (int base = 0; base < p.slots_per_block; base += 32) {
      const int64_t g = first + base + lane;
      int key = -1;
      if (g < static_cast<int64_t>(p.ep) * p.rt) {
        const int s = static_cast<int>(g / p.rt), j = static_cast<int>(g % p.rt);
        key = slot_key(p, s, j, received(p, s));
      }
      const unsigned peers = __match_any_sync(kFullMask, key);
      const int before = __popc(peers & ((1u << lane) - 1u));
      const int num = key >= 0 ? pre[key] + before : -1;
      __syncwarp();
      if (key >= 0 && before == 0) pre[key] += __popc(peers);
      __syncwarp();
      skey[base + lane] = key;
      snum[base + lane] = num;
    }
  } else {
    // (3) meanwhile the other warps turn the counts into each (expert, source)'s first row;
    // block 0 also writes recv_count, layout_range and the statistics
    for (int le = tid - 32; le < p.lx; le += kArrangeThreads - 32) {
      int run = 0;
      for (int s = 0; s < p.ep; ++s) {
        const int c = begin[le * p.ep + s];
        begin[le * p.ep + s] = run;
        if (blockIdx.x == 0) p.layout_range[le * p.ep + s] = (static_cast<int64_t>(run) << 32) | c;
        run += c;
      }
      if (blockIdx.x == 0) {
        const int total = run < p.r_total ? run : p.r_total;
        p.recv_count[le] = total;
        if (p.stats != nullptr) p.stats[le] += total;
      }
    }
  }
  __syncthreads();
  // (4) each slot's row: dest (every slot of the block), src_info, the row and its scales
  const int64_t slots = static_cast<int64_t>(p.ep) * p.rt;
  for (int i = tid; i < p.slots_per_block; i += kArrangeThreads) {
    const int64_t g = first + i;
    if (g >= slots) break;
    const int key = skey[i];
    int64_t row = 0;
    if (key >= 0) {
      const int within = begin[key] + snum[i];
      if (within < p.r_total) {
        const int le = key / p.ep, s = key - le * p.ep;
        const int j = static_cast<int>(g - static_cast<int64_t>(s) * p.rt);
        row = static_cast<int64_t>(le) * p.r_total + within;
        p.src_info[row] = p.meta[s * p.meta_src_stride + 2 * static_cast<int64_t>(j)];
      }
    }
    p.dest[g] = row;
  }
  for (int i = warp; i < p.slots_per_block; i += kArrangeWarps) {
    const int64_t g = first + i;
    if (g >= slots) break;
    const int key = skey[i];
    if (key < 0) continue;
    const int within = begin[key] + snum[i];
    if (within >= p.r_total) continue;
    const int le = key / p.ep, s = key - le * p.ep;
    const int64_t j = g - static_cast<int64_t>(s) * p.rt;
    const int64_t row = static_cast<int64_t>(le) * p.r_total + within;
    copy_row(p.out_rows + row * p.row_bytes, p.rows + s * p.rows_src_stride + j * p.row_bytes, p.row_bytes, lane);
    if (p.scales == nullptr) continue;
    const float* sc = p.scales + s * p.scales_src_stride + j * p.ns;
    for (int c = lane; c < p.ns; c += 32) {
      const float v = sc[c];
      if (p.ue8m0) {  // int32 [lx, ns / 4, r_total]: the exponent byte of scale c in byte c % 4
        const int64_t word = (static_cast<int64_t>(le) * (p.ns / 4) + c / 4) * p.r_total + within;
        p.out_ue8m0[word * 4 + (c & 3)] = static_cast<uint8_t>((__float_as_uint(v) >> 23) & 0xffu);
      } else {  // float32 [lx, ns, r_total]
        p.out_scales[(static_cast<int64_t>(le) * p.ns + c) * p.r_total + within] = v;
      }
    }
  }
}

}  // namespace

int ll_arrange_smem_bytes(int lx, int ep, int slots_per_block) {
  return static_cast<int>(sizeof(int)) * (2 * lx * ep + 2 * slots_per_block);
}

cudaError_t launch_ll_pack(const LlPackParams& p, cudaStream_t stream) {
  A2AD_DEBUG_ASSERT(p.routing.T >= 0 && p.routing.K >= 1 && p.routing.K <= 32);
  A2AD_DEBUG_ASSERT(p.H % 128 == 0 && p.scales != nullptr);
  if (p.routing.T == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.routing.T), static_cast<unsigned>(launch::ceil_div(p.H, kLlChunk)));
  return launch::overlapped(ll_pack_kernel, grid, kLlThreads, 0, stream, p);
}

cudaError_t launch_ll_arrange(const LlArrangeParams& p, cudaStream_t stream, bool early) {
  A2AD_DEBUG_ASSERT(p.ep >= 1 && p.rt >= 1 && p.lx >= 1 && p.slots_per_block >= 32 && p.slots_per_block % 32 == 0);
  A2AD_DEBUG_ASSERT(p.row_bytes % 16 == 0 && (!p.ue8m0 || p.ns % 4 == 0));
  const int64_t slots = static_cast<int64_t>(p.ep) * p.rt;
  const dim3 grid(static_cast<unsigned>(launch::ceil_div(slots, p.slots_per_block)));
  const size_t smem = static_cast<size_t>(ll_arrange_smem_bytes(p.lx, p.ep, p.slots_per_block));
  return launch::overlapped(ll_arrange_kernel, grid, kArrangeThreads, smem, stream, p, early);
}

cudaError_t load_ll_kernels() {
  cudaFuncAttributes a;
  cudaError_t err = cudaFuncGetAttributes(&a, ll_pack_kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&a, ll_arrange_kernel);
  return err;
}

}  // namespace a2ad
