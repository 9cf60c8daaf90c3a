// Host-side launch helpers the kernel files share: occupancy and SM counts (cached),
// and the parameter checks of the debug build. Implemented in launch.cu.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "moe_a2a.cuh"

// Launcher checks of what the binding already checked (csrc/bindings.cpp, itself behind the
// Python front end, which names the argument): compiled in only with A2AD_DEBUG_CHECKS (the
// JIT build sets it under A2AD_DEBUG=1), where a failed one prints the condition and the
// launch returns cudaErrorInvalidValue.
#ifdef A2AD_DEBUG_CHECKS
#define A2AD_DEBUG_ASSERT(cond)                                                                   \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      fprintf(stderr, "a2ad: %s:%d: launch check failed: %s\n", __FILE__, __LINE__, #cond);       \
      return cudaErrorInvalidValue;                                                               \
    }                                                                                             \
  } while (0)
#else
#define A2AD_DEBUG_ASSERT(cond) \
  do {                          \
  } while (0)
#endif

namespace a2ad {
namespace launch {

// Blocks of `fn` (with `threads` threads) that fit at once on the SMs this launch may use.
cudaError_t resident_blocks(const void* fn, int threads, const LaunchLimits& lim, int* out);

// Whether `fn` can run as one cluster of `blocks` blocks of `threads` threads on this device:
// its code is sm_90 or later and at least one such cluster fits (cached per kernel and size).
cudaError_t cluster_fits(const void* fn, int threads, int blocks, bool* out);

bool valid_workspace(const Workspace& ws);
bool valid_aux(const AuxOffsets& a);
bool valid_control(const Control& c);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The launch attribute that runs a grid's blocks in clusters of `blocks` along x.
inline cudaLaunchAttribute cluster_attribute(int blocks) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = static_cast<unsigned>(blocks);
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = 1;
  return a;
}

// Launch `kernel` with programmatic stream serialization allowed: it may be scheduled
// while the previous kernel on the stream finishes (hiding the launch), and waits for
// that kernel's completion itself (wait_prior_grid). Graph capture keeps the edge.
// `early` false: an ordinary launch (scheduled once that kernel completed). It is for a
// kernel behind one that waits for its peers, where those peers run on this GPU too:
// launched early, its blocks would sit on SMs waiting, and might take the room the peers'
// kernels need to finish what the kernel before it waits for.
// `cluster` > 1: the grid's blocks run in clusters of that many (grid.x a multiple of it).
template <typename Params>
cudaError_t overlapped(void (*kernel)(Params), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                       const Params& params, bool early = true, int cluster = 1) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2] = {};
  unsigned n = 0;
  if (early) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster > 1) attrs[n++] = cluster_attribute(cluster);
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, params);
}

template <typename Params>
cudaError_t overlapped(void (*kernel)(Params), int grid, int threads, cudaStream_t stream, const Params& params) {
  return overlapped(kernel, dim3(static_cast<unsigned>(grid)), threads, 0, stream, params);
}

inline int clamp_grid(int64_t want, int64_t most) {
  if (want < 1) want = 1;
  return static_cast<int>(want < most ? want : most);
}

}  // namespace launch
}  // namespace a2ad
