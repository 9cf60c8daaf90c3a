// Host-side launch helpers (launch.cuh): per-device SM counts and per-kernel
// occupancy, each queried once and cached; parameter checks shared by the launchers.
#include "launch.cuh"

#include <mutex>
#include <utility>
#include <vector>

namespace a2ad {
namespace {

std::mutex g_mutex;
std::vector<std::pair<int, int>> g_sms;                           // (device, SMs)
std::vector<std::pair<std::pair<int, const void*>, int>> g_occupancy;  // ((device, kernel), blocks per SM)
std::vector<std::pair<std::pair<int, const void*>, std::pair<int, bool>>> g_clusters;  // ((device, kernel), (blocks, fits))

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

}  // namespace

cudaError_t sm_count(int device, int* out) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& d : g_sms) {
      if (d.first == device) {
        *out = d.second;
        return cudaSuccess;
      }
    }
  }
  int n = 0;
  cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_sms.push_back({device, n});
  *out = n;
  return cudaSuccess;
}

namespace launch {

cudaError_t resident_blocks(const void* fn, int threads, const LaunchLimits& lim, int* out) {
  int device = 0, sms = 0, occ = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = sm_count(device, &sms);
  if (err != cudaSuccess) return err;
  err = occupancy(device, fn, threads, &occ);
  if (err != cudaSuccess) return err;
  if (occ < 1) return cudaErrorLaunchOutOfResources;
  const int budget = lim.sm_budget > 0 && lim.sm_budget < sms ? lim.sm_budget : sms;
  *out = budget * occ;
  return cudaSuccess;
}

cudaError_t cluster_fits(const void* fn, int threads, int blocks, bool* out) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& e : g_clusters) {
      if (e.first.first == device && e.first.second == fn && e.second.first == blocks) {
        *out = e.second.second;
        return cudaSuccess;
      }
    }
  }
  bool fits = false;
  cudaFuncAttributes a;
  err = cudaFuncGetAttributes(&a, fn);
  if (err != cudaSuccess) return err;
  int major = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (a.binaryVersion >= 90 && major >= 9) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cudaLaunchAttribute attr = cluster_attribute(blocks);
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg);
    if (err != cudaSuccess) {
      cudaGetLastError();  // (no cluster launch here: the caller launches without one)
      clusters = 0;
    }
    fits = clusters >= 1;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_clusters.push_back({{device, fn}, {blocks, fits}});
  *out = fits;
  return cudaSuccess;
}

bool valid_workspace(const Workspace& ws) {
  return ws.base != nullptr && ws.ep_size >= 1 && ws.ep_size <= kMaxEpSize && ws.ep_rank >= 0 &&
         ws.ep_rank < ws.ep_size && ws.row_stride > 0;
}

bool valid_aux(const AuxOffsets& a) {
  return a.topk_stride >= 1 && a.max_num_tokens >= 1 && a.dispatch_ready % 8 == 0 && a.combine_slices >= 1;
}

bool valid_control(const Control& c) {
  return c.block != nullptr && c.ep_rank >= 0 && c.ep_rank < kMaxEpSize;
}

}  // namespace launch
}  // namespace a2ad
