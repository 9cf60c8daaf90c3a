// Block quantization of a combine output [T, H] (bf16, fp16 or fp32) to MXFP8, MXFP4 or NVFP4,
// the scale factors written in the linear, 128x4 or 8x4 layout.
//
// The numerics are those of client/quant_reference.py, bit for bit (see its docstring):
// MX scales by the OCP rule 2^(floor(log2(amax)) - emax_elem), clamped to UE8M0's
// [-127, 127]; NVFP4 by the exact fp32 operation sequence
//   sf = ue4m3(amax * (s * fp32(1/6))),  q = e2m1(v * min(1 / (float(sf) * (1 / s)), FLT_MAX)),
// every step one IEEE operation rounded to nearest even (the _rn intrinsics keep the compiler
// from contracting them into FMAs); elements rounded to nearest even and saturated; a block
// holding NaN or Inf gets the NaN scale (0xFF, or 0x7F for UE4M3) and zero element bytes.
//
// One thread per (row, scale column) of the padded scale array: inside [T, H / block] it
// quantizes that block; in the padding it writes a zero scale.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace a2ad {
namespace {

constexpr int kQuantThreads = 256;

enum QuantFormat : int { kMXFP8 = 0, kMXFP4 = 1, kNVFP4 = 2 };
enum SfLayoutCode : int { kSwizzle128x4 = 0, kSwizzle8x4 = 1, kLinear = 2 };
enum InDtype : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// The per-block arithmetic is also compiled for the host (tests/test_quant.py builds it with a
// host driver and checks it against the reference without a GPU): these few wrappers are the
// only code that differs between the two.
#define A2AD_QDEV __host__ __device__ __forceinline__

A2AD_QDEV uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

A2AD_QDEV float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// One fp32 multiply / reciprocal, rounded to nearest even, never contracted into an FMA.
A2AD_QDEV float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}

A2AD_QDEV float rcp_rn(float a) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(a);
#else
  volatile float r = 1.0f / a;
  return r;
#endif
}

A2AD_QDEV int clz32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __clz(static_cast<int>(v));
#else
  return v ? __builtin_clz(v) : 32;
#endif
}

A2AD_QDEV bool is_finite(float v) { return (f2u(v) & 0x7F800000u) != 0x7F800000u; }

// floor(log2(a)) of a finite a > 0 (normal or subnormal fp32).
A2AD_QDEV int floor_log2(float a) {
  const uint32_t bits = f2u(a);
  const int e = static_cast<int>((bits >> 23) & 0xFF);
  if (e != 0) return e - 127;
  return (31 - clz32(bits)) - 149;
}

// 2^n as fp32 for n in [-127, 127], from the bits.
A2AD_QDEV float pow2(int n) {
  const int biased = n + 127;
  return u2f(biased > 0 ? static_cast<uint32_t>(biased) << 23 : (1u << 22));
}

// E4M3 code of y: round to nearest even, saturating at 448.
A2AD_QDEV uint8_t e4m3_code(float y) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
}

A2AD_QDEV float e4m3_value(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// E2M1 code of y (finite or infinite): round to nearest even, saturating at 6.
A2AD_QDEV uint32_t e2m1_code(float y) {
  const float a = fabsf(y);
  uint32_t c = 0;
  c += a > 0.25f;   // 0 | 0.5: a tie stays at the even code 0
  c += a >= 0.75f;  // 0.5 | 1: a tie goes up to the even code 2
  c += a > 1.25f;   // 1 | 1.5
  c += a >= 1.75f;  // 1.5 | 2
  c += a > 2.5f;    // 2 | 3
  c += a >= 3.5f;   // 3 | 4
  c += a > 5.0f;    // 4 | 6
  return c | ((f2u(y) >> 31) << 3);
}

A2AD_QDEV int64_t scale_offset(int64_t r, int64_t c, int64_t cols, int64_t col_tiles, int layout) {
  if (layout == kLinear) return r * cols + c;
  if (layout == kSwizzle128x4) {
    const int64_t rr = r % 128;
    return ((r / 128) * col_tiles + c / 4) * 512 + (rr % 32) * 16 + (rr / 32) * 4 + c % 4;
  }
  return ((r / 8) * col_tiles + c / 4) * 32 + (r % 8) * 4 + c % 4;
}

struct QuantParams {
  const void* x;
  uint8_t* out;
  uint8_t* scales;
  const float* scale_ptr;  // NVFP4 global scale on the device, or null: use scale
  float scale;
  int64_t T, H, cols, prows, pcols;
  int dtype, fmt, layout, block;
  bool x_aligned, out_aligned;  // 16-byte aligned base pointers: blocks move as 16-byte vectors
};

// Element i of a block held as 32-bit words (elements in memory order, little-endian).
template <int DTYPE>
A2AD_QDEV float elem_of(const uint32_t* w, int i) {
  if constexpr (DTYPE == kFp32) {
    return u2f(w[i]);
  } else {
    const uint32_t h = (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
    if constexpr (DTYPE == kBf16) {
      return u2f(h << 16);
    } else {
      __half_raw r;
      r.x = static_cast<unsigned short>(h);
      return __half2float(__half(r));
    }
  }
}

// WORDS 32-bit words to dst: as 16-byte (or, for two words, 8-byte) vectors when aligned.
template <int WORDS>
A2AD_QDEV void store_words(uint8_t* dst, const uint32_t* o, bool aligned) {
  if (aligned && WORDS % 4 == 0) {
#pragma unroll
    for (int k = 0; k < WORDS / 4; ++k) {
      reinterpret_cast<uint4*>(dst)[k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
    }
  } else if (aligned && WORDS == 2) {
    reinterpret_cast<uint2*>(dst)[0] = make_uint2(o[0], o[1]);
  } else {
#pragma unroll
    for (int k = 0; k < WORDS; ++k) std::memcpy(dst + 4 * k, &o[k], 4);
  }
}

template <int BLOCK, int DTYPE>
A2AD_QDEV void quantize_block(const QuantParams& p, int64_t r, int64_t c, int64_t sf_at) {
  constexpr int kEsz = DTYPE == kFp32 ? 4 : 2;
  constexpr int kWords = BLOCK * kEsz / 4;  // a multiple of 4
  const int64_t base = r * p.H + c * BLOCK;
  const unsigned char* src = static_cast<const unsigned char*>(p.x) + base * kEsz;
  uint32_t w[kWords];
  if (p.x_aligned) {
#pragma unroll
    for (int k = 0; k < kWords / 4; ++k) {
      const uint4 q = reinterpret_cast<const uint4*>(src)[k];
      w[4 * k] = q.x;
      w[4 * k + 1] = q.y;
      w[4 * k + 2] = q.z;
      w[4 * k + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kWords; ++k) std::memcpy(&w[k], src + 4 * k, 4);
  }
  float v[BLOCK];
  bool finite = true;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < BLOCK; ++i) {
    v[i] = elem_of<DTYPE>(w, i);
    finite = finite && is_finite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  uint32_t codes[BLOCK];
  uint8_t sf;
  if (!finite) {
    sf = p.fmt == kNVFP4 ? 0x7F : 0xFF;
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) codes[i] = 0;
  } else if (p.fmt != kNVFP4) {
    const int emax_elem = p.fmt == kMXFP8 ? 8 : 2;
    int e = -127;
    if (amax > 0.0f) e = max(-127, min(127, floor_log2(amax) - emax_elem));
    sf = static_cast<uint8_t>(e + 127);
    const float inv = pow2(-e);
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) {
      const float y = mul_rn(v[i], inv);
      codes[i] = p.fmt == kMXFP8 ? e4m3_code(fminf(fmaxf(y, -448.0f), 448.0f)) : e2m1_code(y);
    }
  } else {
    const float s = p.scale_ptr ? *p.scale_ptr : p.scale;
    const float sfv = mul_rn(amax, mul_rn(s, 1.0f / 6.0f));
    sf = e4m3_code(fminf(sfv, 448.0f));
    float outs = 0.0f;
    if (amax != 0.0f) outs = fminf(rcp_rn(mul_rn(e4m3_value(sf), rcp_rn(s))), 3.402823466e38f);
#pragma unroll
    for (int i = 0; i < BLOCK; ++i) codes[i] = e2m1_code(mul_rn(v[i], outs));
  }
  // The block's output bytes as 32-bit words: BLOCK bytes of E4M3 codes, or BLOCK / 2 bytes of
  // E2M1 pairs (element 2j in the low nibble of byte j).
  if (p.fmt == kMXFP8) {
    uint32_t o[BLOCK / 4];
#pragma unroll
    for (int k = 0; k < BLOCK / 4; ++k) {
      o[k] = codes[4 * k] | (codes[4 * k + 1] << 8) | (codes[4 * k + 2] << 16) | (codes[4 * k + 3] << 24);
    }
    store_words<BLOCK / 4>(p.out + base, o, p.out_aligned);
  } else {
    uint32_t o[BLOCK / 8];
#pragma unroll
    for (int k = 0; k < BLOCK / 8; ++k) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) word |= codes[8 * k + j] << (4 * j);
      o[k] = word;
    }
    store_words<BLOCK / 8>(p.out + base / 2, o, p.out_aligned);
  }
  p.scales[sf_at] = sf;
}

template <int BLOCK>
A2AD_QDEV void quantize_block_any(const QuantParams& p, int64_t r, int64_t c, int64_t sf_at) {
  if (p.dtype == kBf16) {
    quantize_block<BLOCK, kBf16>(p, r, c, sf_at);
  } else if (p.dtype == kFp16) {
    quantize_block<BLOCK, kFp16>(p, r, c, sf_at);
  } else {
    quantize_block<BLOCK, kFp32>(p, r, c, sf_at);
  }
}

// Entry i of the padded scale array (row-major over [prows, pcols]): quantize its block, or
// zero a padding entry.
A2AD_QDEV void quantize_entry(const QuantParams& p, int64_t i) {
  const int64_t r = i / p.pcols, c = i - r * p.pcols;
  const int64_t at = scale_offset(r, c, p.cols, p.pcols / 4, p.layout);
  if (r >= p.T || c >= p.cols) {
    p.scales[at] = 0;
  } else if (p.block == 16) {
    quantize_block_any<16>(p, r, c, at);
  } else {
    quantize_block_any<32>(p, r, c, at);
  }
}

__global__ void __launch_bounds__(kQuantThreads) quantize_kernel(const QuantParams p) {
  const int64_t n = p.prows * p.pcols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    quantize_entry(p, i);
  }
}

// The padded extent of the scale array and the pointers' alignment (set x and out first);
// false for arguments the kernel does not take.
inline bool plan_quantize(QuantParams& p) {
  p.block = p.fmt == kNVFP4 ? 16 : 32;
  if (p.H % p.block != 0 || p.T < 0 || p.fmt < 0 || p.fmt > 2 || p.layout < 0 || p.layout > 2) return false;
  p.cols = p.H / p.block;
  const int64_t rm = p.layout == kSwizzle128x4 ? 128 : (p.layout == kSwizzle8x4 ? 8 : 1);
  const int64_t cm = p.layout == kLinear ? 1 : 4;
  p.prows = (p.T + rm - 1) / rm * rm;
  p.pcols = (p.cols + cm - 1) / cm * cm;
  p.x_aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  p.out_aligned = reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  return true;
}

}  // namespace

// Quantize x [T, H] (dtype: 0 bf16, 1 fp16, 2 fp32; contiguous) to fmt (0 MXFP8, 1 MXFP4,
// 2 NVFP4) into out (T*H bytes for MXFP8, T*H/2 for FP4) and scales (the padded extent of
// layout: 0 128x4, 1 8x4, 2 linear). The caller checks the arguments.
cudaError_t launch_quantize(const void* x, int dtype, int64_t T, int64_t H, uint8_t* out, uint8_t* scales, int fmt,
                            int layout, float scale, const float* scale_ptr, cudaStream_t stream) {
  QuantParams p{};
  p.x = x;
  p.out = out;
  p.scales = scales;
  p.scale_ptr = scale_ptr;
  p.scale = scale;
  p.T = T;
  p.H = H;
  p.dtype = dtype;
  p.fmt = fmt;
  p.layout = layout;
  if (!plan_quantize(p)) return cudaErrorInvalidValue;
  const int64_t n = p.prows * p.pcols;
  if (n == 0) return cudaSuccess;
  int64_t grid = (n + kQuantThreads - 1) / kQuantThreads;
  if (grid > 65535) grid = 65535;
  quantize_kernel<<<static_cast<unsigned>(grid), kQuantThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace a2ad
