// Sanitize (the received expert ids of slots nobody filled become invalid_id) and
// initialize (a row's aux region zeroed, FLAG_VAL set; tests only: the daemon
// initializes rows itself).
#include "primitives.cuh"
#include "launch.cuh"

namespace a2ad {
namespace {

using namespace dev;

constexpr int kThreads = 256;
constexpr int kMaxGrid = 1024;

// Elementwise over [ep_size, rt, top_k]: ids of slots j >= RECV_COUNTERS[s] become invalid_id.
__global__ void __launch_bounds__(kThreads) sanitize_kernel(const SanitizeParams p) {
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

__global__ void __launch_bounds__(kThreads) initialize_kernel(const InitializeParams p) {
  const int64_t words = p.aux_bytes / 4;
  int32_t* w = reinterpret_cast<int32_t*>(p.row);
  const int64_t flag_word = p.flag_val / 4;
#pragma unroll 1
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < words; i += (int64_t)gridDim.x * blockDim.x) {
    w[i] = i == flag_word ? p.initial_round : 0;
  }
}

}  // namespace

// The binding checked the arguments; the checks here are debug asserts (A2AD_DEBUG_CHECKS),
// except the kernels' 32-bit indices and the row's alignment, which keep them in bounds.
cudaError_t launch_sanitize(const SanitizeParams& p, cudaStream_t stream) {
  A2AD_DEBUG_ASSERT(launch::valid_workspace(p.ws) && p.ids != nullptr && p.rt >= 1 && p.top_k >= 1);
  const int64_t n = (int64_t)p.ws.ep_size * p.rt * p.top_k;
  if (n >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  sanitize_kernel<<<launch::clamp_grid(launch::ceil_div(n, kThreads), kMaxGrid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_initialize(const InitializeParams& p, cudaStream_t stream) {
  A2AD_DEBUG_ASSERT(p.row != nullptr && p.aux_bytes >= 4 && p.aux_bytes % 4 == 0);
  A2AD_DEBUG_ASSERT(p.flag_val >= 0 && p.flag_val % 4 == 0 && p.flag_val < p.aux_bytes);
  if (reinterpret_cast<uintptr_t>(p.row) % 4 != 0) return cudaErrorInvalidValue;  // int32 stores
  initialize_kernel<<<launch::clamp_grid(launch::ceil_div(p.aux_bytes / 4, kThreads), kMaxGrid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t load_sanitize_kernels() {
  cudaFuncAttributes a;
  cudaError_t err = cudaFuncGetAttributes(&a, sanitize_kernel);
  return err != cudaSuccess ? err : cudaFuncGetAttributes(&a, initialize_kernel);
}

}  // namespace a2ad
