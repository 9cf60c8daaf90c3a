// Torch binding of the a2ad kernels: the only file that includes torch.
//
// Registers the ops of namespace `a2ad` (torch.ops.a2ad.*). The kernels get raw pointers
// and the offsets that a2ad/layout.py computed.
//
// Checks. The Python front end (client/frontend.py) is the validation boundary: it checks
// every argument a caller passes and raises InputError naming it. What this file checks in
// every build is what keeps a call that bypasses the front end (torch.ops.a2ad.* or the
// module's functions called directly) from reading or writing outside its tensors, the
// workspace rows or the parameter arrays: devices, dtypes that fix element sizes, shapes and
// contiguity of the tensors the kernels index, rt <= max_num_tokens and T <= rt (the routing
// arrays and slot tables are sized for max_num_tokens), every region inside a row, the word
// counts of the masks; each is a few integer compares per call. Conditions that only make a
// result wrong, not unsafe, and that the front end already raises (a payload with no bytes
// per token, hidden 0, an id that does not fit int32, payload_in_workspace with another
// tensor) are debug checks (A2AD_DEBUG_CHECK: compiled in with A2AD_DEBUG_CHECKS, which the
// JIT build sets under A2AD_DEBUG=1); the launchers' own checks are debug asserts likewise.
//
// Everything that is fixed for a rank of a job (the workspace, the aux offsets, the
// control block, timeouts, the SM budget) is checked once by `make_plan`, which
// keeps it here and returns a handle (an int, so that the ops trace under torch.compile
// like any op with int arguments); every data-plane call then passes tensors, the handle
// and the few per-call numbers. `free_plan` drops it.
//
// The data-plane functions are also the extension module's own functions (pybind11,
// `dispatch`, `combine`, `sanitize`): the same code without the dispatcher's argument
// boxing, which costs an eager call a few microseconds more than the launch itself. The
// client's eager path calls those; the ops remain for torch.compile and anyone else.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/python.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "moe_a2a.cuh"

namespace a2ad {
// csrc/quantize.cu
cudaError_t launch_quantize(const void* x, int dtype, int64_t T, int64_t H, uint8_t* out, uint8_t* scales, int fmt,
                            int layout, float scale, const float* scale_ptr, cudaStream_t stream);
}  // namespace a2ad

namespace {

using at::IntArrayRef;
using at::Tensor;
using at::TensorList;

// Input checks. Messages are built with std::string and std::to_string, never iostreams,
// and thrown as std::runtime_error (Python sees RuntimeError). TORCH_CHECK formats through
// std::ostringstream; with an extension built by the system g++ 13 against torch 2.11 wheels
// that formatting of a number crashed the process (seen on the H200 image, also with a
// three-line load_inline extension), so an input check must not depend on it.
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) {
  s += c10::DeviceTypeName(v.type(), /*lower_case=*/true);
  if (v.has_index()) s += ":" + std::to_string(v.index());
}

template <typename... A>
[[noreturn]] void fail(const A&... parts) {
  std::string msg;
  (append(msg, parts), ...);
  throw std::runtime_error(msg);
}

#define A2AD_CHECK(cond, ...)      \
  do {                             \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

#ifdef A2AD_DEBUG_CHECKS
#define A2AD_DEBUG_CHECK(cond, ...) A2AD_CHECK(cond, __VA_ARGS__)
#else
#define A2AD_DEBUG_CHECK(cond, ...) \
  do {                              \
  } while (0)
#endif

#define A2AD_CHECK_CUDA(expr, what)                                                              \
  do {                                                                                           \
    cudaError_t err_ = (expr);                                                                   \
    A2AD_CHECK(err_ == cudaSuccess, "a2ad: ", what, " failed: ", cudaGetErrorString(err_));     \
  } while (0)

void check_workspace(const Tensor& ws, int64_t ep_rank, int64_t ep_size) {
  A2AD_CHECK(ws.is_cuda(), "a2ad: workspace must be a CUDA tensor, got device ", ws.device());
  A2AD_CHECK(ws.scalar_type() == at::kByte, "a2ad: workspace must be uint8, got ", ws.scalar_type());
  A2AD_CHECK(ws.dim() == 2, "a2ad: workspace must be [ep_size, size_per_rank], got ", ws.dim(), " dims");
  A2AD_CHECK(ws.stride(1) == 1 && ws.stride(0) >= ws.size(1),
              "a2ad: workspace rows must be dense and disjoint (stride(1) == 1, stride(0) >= size(1)), got strides ",
              ws.strides());
  A2AD_CHECK(ep_size >= 1 && ep_size <= a2ad::kMaxEpSize, "a2ad: ep_size must be in [1, ", a2ad::kMaxEpSize,
              "], got ", ep_size);
  A2AD_CHECK(ws.size(0) == ep_size, "a2ad: workspace has ", ws.size(0), " rows, ep_size is ", ep_size);
  A2AD_CHECK(ep_rank >= 0 && ep_rank < ep_size, "a2ad: ep_rank must be in [0, ", ep_size, "), got ", ep_rank);
}

void check_same_device(const Tensor& t, const Tensor& ws, const char* name) {
  A2AD_CHECK(t.is_cuda() && t.device() == ws.device(), "a2ad: ", name, " must be on the workspace's device ",
              ws.device(), ", got ", t.device());
}

a2ad::Workspace make_workspace(const Tensor& ws, int64_t ep_rank, int64_t ep_size) {
  a2ad::Workspace w;
  w.base = static_cast<uint8_t*>(ws.data_ptr());
  w.row_stride = ws.stride(0);
  w.ep_rank = static_cast<int>(ep_rank);
  w.ep_size = static_cast<int>(ep_size);
  return w;
}

// aux: layout::AUX_PLAN_FIELD_COUNT values, in the order of a2ad/layout.py's AUX_PLAN_FIELDS
// (the index of each is layout::AUX_<NAME>): the offsets and sizes of layout::AuxOffsets and
// the constants block_counter_slots, combine_slice_rows, row_tail_bytes and combine_lines_bytes, which are checked against
// layout.h so that a build from other sources than the Python package's is refused rather
// than run with another layout.
a2ad::AuxOffsets make_aux(IntArrayRef aux, const Tensor& ws, int64_t ep_size) {
  namespace L = a2ad::layout;
  A2AD_CHECK(aux.size() == static_cast<size_t>(L::AUX_PLAN_FIELD_COUNT), "a2ad: aux must hold ",
             L::AUX_PLAN_FIELD_COUNT, " values (layout.aux_plan), got ", aux.size());
  const int64_t row = ws.size(1);
  auto name = [](int i) { return L::AUX_PLAN_FIELD_NAMES[i]; };
  // 4-aligned int32 fields at the start of the row (counters of ep_size entries, the routing arrays)
  for (int i : {L::AUX_FLAG_VAL, L::AUX_LOCAL_TOKEN_COUNTER, L::AUX_SEND_COUNTERS, L::AUX_RECV_COUNTERS,
                L::AUX_DISPATCH_COMPLETION_FLAGS, L::AUX_COMBINE_COMPLETION_FLAGS, L::AUX_TOPK_TARGET_RANKS,
                L::AUX_TOPK_SEND_INDICES, L::AUX_BLOCK_COUNTERS}) {
    A2AD_CHECK(aux[i] >= 0 && aux[i] % 4 == 0 && aux[i] + 4 <= row, "a2ad: aux ", name(i), " (", aux[i],
               ") is not an aligned offset inside a row of ", row, " bytes");
  }
  for (int i : {L::AUX_SEND_COUNTERS, L::AUX_RECV_COUNTERS, L::AUX_DISPATCH_COMPLETION_FLAGS,
                L::AUX_COMBINE_COMPLETION_FLAGS}) {
    A2AD_CHECK(aux[i] + 4 * ep_size <= row, "a2ad: aux ", name(i), " of ", ep_size, " counters overruns the row");
  }
  const int64_t stride = aux[L::AUX_TOPK_STRIDE], slots = aux[L::AUX_BLOCK_COUNTER_SLOTS];
  const int64_t mnt = aux[L::AUX_MAX_NUM_TOKENS], nslices = aux[L::AUX_COMBINE_SLICES];
  const int64_t slice_rows = aux[L::AUX_COMBINE_SLICE_ROWS];
  A2AD_CHECK(stride >= 1 && stride <= 1024, "a2ad: aux topk_stride must be in [1, 1024], got ", stride);
  A2AD_CHECK(slots == L::BLOCK_COUNTER_SLOTS, "a2ad: aux block_counter_slots is ", slots,
             " but the kernels were built for ", L::BLOCK_COUNTER_SLOTS, " (stale build?)");
  A2AD_CHECK(aux[L::AUX_BLOCK_COUNTERS] + 4 * slots <= row, "a2ad: aux block counters overrun the row");
  A2AD_CHECK(mnt >= 1 && mnt <= INT32_MAX, "a2ad: aux max_num_tokens must be >= 1, got ", mnt);
  A2AD_CHECK(slice_rows == L::COMBINE_SLICE_ROWS, "a2ad: aux combine_slice_rows is ", slice_rows,
             " but the kernels were built for ", L::COMBINE_SLICE_ROWS, " (stale build?)");
  A2AD_CHECK(nslices >= (mnt + slice_rows - 1) / slice_rows && nslices <= INT32_MAX, "a2ad: aux combine_slices (",
             nslices, ") is too few for max_num_tokens ", mnt);
  for (int i : {L::AUX_SLOT_TOKENS, L::AUX_COMBINE_SLICE_FLAGS}) {
    A2AD_CHECK(aux[i] >= 0 && aux[i] % 4 == 0, "a2ad: aux ", name(i), " (", aux[i], ") is not 4-aligned");
  }
  A2AD_CHECK(aux[L::AUX_SLOT_TOKENS] + 4 * ep_size * mnt <= row, "a2ad: aux slot_tokens overruns the row");
  const int64_t sf = aux[L::AUX_COMBINE_SLICE_FLAGS];
  A2AD_CHECK(sf % 8 == 0 && sf + 8 * ep_size * nslices <= row,
             "a2ad: aux combine_slice_flags are not 8-aligned or overrun the row");
  const int64_t specs = aux[L::AUX_RECV_SPECS];
  A2AD_CHECK(specs >= 0 && specs % 16 == 0 && specs + 4 * L::SPEC_WORDS * ep_size <= row, "a2ad: aux recv_specs (",
             specs, ") is not a 16-aligned field inside the row");
  const int64_t cready = aux[L::AUX_COMBINE_READY];
  A2AD_CHECK(cready >= 0 && cready % 8 == 0 && cready + 8 * ep_size <= row, "a2ad: aux combine_ready (", cready,
             ") is not an 8-aligned field inside the row");
  const int64_t rts = aux[L::AUX_RECV_RTS];
  A2AD_CHECK(rts >= 0 && rts % 4 == 0 && rts + 4 * ep_size <= row, "a2ad: aux recv_rts (", rts,
             ") is not an aligned field inside the row");
  const int64_t dready = aux[L::AUX_DISPATCH_READY];
  A2AD_CHECK(dready >= 0 && dready % 8 == 0 && dready + 8 * ep_size <= row, "a2ad: aux dispatch_ready (", dready,
             ") is not an 8-aligned field inside the row");
  A2AD_CHECK(aux[L::AUX_ROW_TAIL_BYTES] == L::ROW_TAIL_BYTES && aux[L::AUX_COMBINE_LINES_BYTES] == L::COMBINE_LINES_BYTES,
             "a2ad: aux row_tail_bytes / combine_lines_bytes are ", aux[L::AUX_ROW_TAIL_BYTES], " / ",
             aux[L::AUX_COMBINE_LINES_BYTES], " but the kernels were built for ", L::ROW_TAIL_BYTES, " / ",
             L::COMBINE_LINES_BYTES, " (stale build?)");
  // The lines tail lies past the row (the payloads never reach it) and inside its stride.
  const int64_t tail = aux[L::AUX_LINES_TAIL];
  A2AD_CHECK(tail == 0 || (tail % L::LINE_HEADS_BYTES == 0 && tail >= row && tail + L::ROW_TAIL_BYTES <= ws.stride(0)),
             "a2ad: aux lines_tail (", tail, ") must be 0 or a ", L::LINE_HEADS_BYTES, "-aligned offset of ",
             L::ROW_TAIL_BYTES, " bytes between the row's end (", row, ") and its stride (", ws.stride(0), ")");
  return L::aux_offsets_from(aux);
}

void check_topk_rows(const a2ad::AuxOffsets& a, const Tensor& ws, int64_t tokens) {
  const int64_t need = 4 * tokens * a.topk_stride;
  A2AD_CHECK(a.topk_target_ranks + need <= ws.size(1) && a.topk_send_indices + need <= ws.size(1),
              "a2ad: the routing arrays for ", tokens, " tokens overrun the row");
}

a2ad::Control make_control(int64_t control, int64_t ep_rank, int64_t timeout_ns) {
  A2AD_CHECK(control != 0, "a2ad: control (the control block's device pointer) must be set");
  A2AD_CHECK(timeout_ns > 0, "a2ad: timeout_ns must be > 0, got ", timeout_ns);
  a2ad::Control c;
  c.block = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(control));
  c.ep_rank = static_cast<int>(ep_rank);
  c.timeout_ns = static_cast<uint64_t>(timeout_ns);
  return c;
}

cudaStream_t current_stream(const Tensor& ws) { return c10::cuda::getCurrentCUDAStream(ws.device().index()).stream(); }

// --- the plan ----------------------------------------------------------------------

constexpr int64_t kPlanMagic = 0x61326164706c616eLL;  // "a2adplan"

struct Plan {
  int64_t magic;
  // the workspace the plan was made for: a call with another one is refused
  const void* ws_base;
  int64_t ws_row_stride;
  int64_t ws_rows;
  int64_t ws_row_bytes;
  int device;
  int ep_rank;
  int ep_size;
  int top_k;
  int num_experts;
  int sm_budget;
  int diag;
  uint64_t* seen_out;  // degraded mode: kMaskWords host-mapped u64 where combine leaves the ranks it counted
  uint64_t* seen_dev;  // ... and kMaskWords device u64 with the same (for the model, on the stream)
  a2ad::AuxOffsets aux;
  a2ad::Control ctl;
};

std::mutex g_plans_mutex;
std::unordered_map<int64_t, Plan> g_plans;
int64_t g_next_plan = 1;

int64_t make_plan(const Tensor& workspace, int64_t ep_rank, int64_t ep_size, int64_t top_k, int64_t num_experts,
                  IntArrayRef aux, int64_t control, int64_t timeout_ns, int64_t sm_budget, int64_t diag,
                  bool degrade, int64_t seen_out, int64_t seen_dev) {
  check_workspace(workspace, ep_rank, ep_size);
  A2AD_CHECK(top_k >= 1 && top_k <= a2ad::kMaxTopK, "a2ad: top_k must be in [1, ", a2ad::kMaxTopK, "], got ", top_k);
  A2AD_CHECK(num_experts >= ep_size && num_experts <= INT32_MAX, "a2ad: num_experts (", num_experts,
             ") must be in [ep_size=", ep_size, ", 2^31)");
  A2AD_CHECK(sm_budget >= 0 && sm_budget <= INT32_MAX, "a2ad: sm_budget must be >= 0, got ", sm_budget);
  A2AD_CHECK(diag >= 0 && diag <= INT32_MAX, "a2ad: diag must be >= 0, got ", diag);
  A2AD_CHECK(diag == 0 || a2ad::kTimingBuild, "a2ad: kernel diagnostics (diag=", diag,
             ") exist only in the timing build of the extension (A2AD_KERNEL_TIMING=1)");
  Plan p{};
  p.magic = kPlanMagic;
  p.ws_base = workspace.data_ptr();
  p.ws_row_stride = workspace.stride(0);
  p.ws_rows = workspace.size(0);
  p.ws_row_bytes = workspace.size(1);
  p.device = workspace.device().index();
  p.ep_rank = static_cast<int>(ep_rank);
  p.ep_size = static_cast<int>(ep_size);
  p.top_k = static_cast<int>(top_k);
  p.num_experts = static_cast<int>(num_experts);
  p.sm_budget = static_cast<int>(sm_budget);
  p.diag = static_cast<int>(diag);
  p.aux = make_aux(aux, workspace, ep_size);
  A2AD_CHECK(top_k <= p.aux.topk_stride, "a2ad: top_k (", top_k, ") exceeds the routing arrays' width ",
             p.aux.topk_stride);
  p.ctl = make_control(control, ep_rank, timeout_ns);
  p.ctl.degrade = degrade;
  A2AD_CHECK(!degrade || (seen_out != 0 && seen_out % 8 == 0),
             "a2ad: a degrade plan needs seen_out, an 8-aligned device pointer of host-mapped memory (",
             a2ad::kMaskWords, " u64 words)");
  p.seen_out = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(seen_out));
  A2AD_CHECK(seen_dev % 8 == 0, "a2ad: seen_dev must be an 8-aligned device pointer of ", a2ad::kMaskWords,
             " u64 words (or 0)");
  p.seen_dev = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(seen_dev));
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  const int64_t id = g_next_plan++;
  g_plans.emplace(id, p);
  return id;
}

void free_plan(int64_t plan) {
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  g_plans.erase(plan);
}

// The plan of a call (a copy: another thread may free it meanwhile), checked against the
// workspace it comes with.
Plan plan_of(int64_t plan, const Tensor& ws) {
  Plan p;
  {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    auto it = g_plans.find(plan);
    A2AD_CHECK(it != g_plans.end(), "a2ad: plan ", plan, " is not one make_plan returned (or it was freed)");
    p = it->second;
  }
  A2AD_CHECK(p.magic == kPlanMagic, "a2ad: plan is not one make_plan returned");
  A2AD_CHECK(ws.is_cuda() && ws.data_ptr() == p.ws_base && ws.stride(0) == p.ws_row_stride && ws.stride(1) == 1 &&
                 ws.size(0) == p.ws_rows && ws.size(1) == p.ws_row_bytes && ws.device().index() == p.device,
             "a2ad: the workspace is not the one this plan was made for");
  return p;
}

a2ad::Workspace plan_workspace(const Plan& p, const Tensor& ws) {
  a2ad::Workspace w;
  w.base = static_cast<uint8_t*>(ws.data_ptr());
  w.row_stride = p.ws_row_stride;
  w.ep_rank = p.ep_rank;
  w.ep_size = p.ep_size;
  return w;
}

// --- ops -------------------------------------------------------------------------

// The caller's active-rank mask: a contiguous int64 tensor of n words, 1 <= n <= MASK_WORDS
// (rank q: bit q & 63 of word q >> 6; words past n count as zero), on the workspace's device
// (read by the kernels, so graphs replay its current value) or on the CPU (its value now);
// `value` is ANDed into word 0 (ranks 0-63; -1: all bits).
void caller_mask_args(const std::optional<Tensor>& mask, int64_t value, const Tensor& ws, a2ad::CallerMask* out) {
  out->ptr = nullptr;
  out->words = 0;
  out->value[0] = static_cast<uint64_t>(value);
  for (int i = 1; i < a2ad::kMaskWords; ++i) out->value[i] = ~0ull;
  if (!mask.has_value()) return;
  const Tensor& m = *mask;
  A2AD_CHECK(m.scalar_type() == at::kLong && m.dim() == 1 && m.numel() >= 1 && m.numel() <= a2ad::kMaskWords &&
                 m.is_contiguous(),
             "a2ad: active_rank_mask must be a contiguous int64 tensor of 1 to ", a2ad::kMaskWords, " words, got ",
             m.scalar_type(), " ", m.sizes());
  const int n = static_cast<int>(m.numel());
  if (m.is_cuda()) {
    check_same_device(m, ws, "active_rank_mask");
    out->ptr = m.data_ptr<int64_t>();
    out->words = n;
  } else {
    const int64_t* w = m.data_ptr<int64_t>();
    for (int i = 0; i < a2ad::kMaskWords; ++i) out->value[i] &= i < n ? static_cast<uint64_t>(w[i]) : 0ull;
  }
}

// A dispatch launch's fields that come from the plan and the round (rt checked here).
a2ad::DispatchParams dispatch_params(const Plan& pl, const Tensor& workspace, int64_t rt) {
  A2AD_CHECK(rt >= 1 && rt <= pl.aux.max_num_tokens, "a2ad: runtime_max_tokens_per_rank must be in [1, ",
             pl.aux.max_num_tokens, "], got ", rt);
  a2ad::DispatchParams p{};
  p.ws = plan_workspace(pl, workspace);
  p.aux = pl.aux;
  p.ctl = pl.ctl;
  p.lim.sm_budget = pl.sm_budget;
  p.diag = pl.diag;
  p.num_experts = pl.num_experts;
  p.rt = static_cast<int>(rt);
  return p;
}

// Payload i of a dispatch: nb bytes per token, its region [ep_size, rt, nb] at `off` in every
// row (`what`[i] names it in the error).
void set_payload_region(const Plan& pl, const Tensor& workspace, int64_t rt, int i, int64_t off, int64_t nb,
                        const char* what, a2ad::DispatchParams* p) {
  A2AD_CHECK(off >= pl.aux.block_counters && off + pl.ep_size * rt * nb <= workspace.size(1), "a2ad: ", what, "[", i,
             "] region [", off, ", +", pl.ep_size * rt * nb, ") does not fit a row of ", workspace.size(1), " bytes");
  p->payload_bytes[i] = nb;
  p->payload_offset[i] = off;
}

// The payload descriptor given in full (layout.payload_spec).
void set_spec(IntArrayRef spec, a2ad::DispatchParams* p) {
  A2AD_CHECK(spec.size() == static_cast<size_t>(a2ad::layout::SPEC_WORDS), "a2ad: spec must hold ",
             a2ad::layout::SPEC_WORDS, " words, got ", spec.size());
  for (int w = 0; w < a2ad::layout::SPEC_WORDS; ++w) p->spec[w] = static_cast<int32_t>(spec[w]);
}

void dispatch_cuda(const Tensor& experts, TensorList payloads, Tensor& workspace, int64_t plan, int64_t rt,
                   IntArrayRef payload_offsets, IntArrayRef spec, const std::optional<Tensor>& eplb_local,
                   const std::optional<Tensor>& eplb_out, int64_t eplb_offset, const std::optional<Tensor>& caller_mask,
                   int64_t caller_mask_value) {
  const Plan pl = plan_of(plan, workspace);
  c10::cuda::CUDAGuard guard(workspace.device());
  check_same_device(experts, workspace, "token_selected_experts");
  A2AD_CHECK(experts.scalar_type() == at::kInt, "a2ad: token_selected_experts must be int32, got ",
              experts.scalar_type());
  A2AD_CHECK(experts.dim() == 2 && experts.size(1) == pl.top_k, "a2ad: token_selected_experts must be [num_tokens, top_k=",
             pl.top_k, "], got ", experts.sizes());
  A2AD_CHECK(experts.is_contiguous(), "a2ad: token_selected_experts must be contiguous");
  const int64_t tokens = experts.size(0);
  a2ad::DispatchParams p = dispatch_params(pl, workspace, rt);
  A2AD_CHECK(tokens <= rt, "a2ad: token_selected_experts has ", tokens,
              " tokens, more than runtime_max_tokens_per_rank=", rt);
  A2AD_CHECK(payloads.size() <= static_cast<size_t>(a2ad::kMaxPayloads), "a2ad: at most ", a2ad::kMaxPayloads,
              " payloads, got ", payloads.size());
  A2AD_CHECK(payload_offsets.size() == payloads.size(), "a2ad: ", payloads.size(), " payloads but ",
              payload_offsets.size(), " payload offsets");

  p.experts = experts.data_ptr<int32_t>();
  p.local_num_tokens = static_cast<int>(tokens);
  p.top_k = pl.top_k;
  p.num_payloads = static_cast<int>(payloads.size());
  for (size_t i = 0; i < payloads.size(); ++i) {
    const Tensor& t = payloads[i];
    check_same_device(t, workspace, "input_payloads[i]");
    A2AD_CHECK(t.dim() >= 1 && t.size(0) == tokens, "a2ad: input_payloads[", i, "] must be [", tokens, ", ...], got ",
               t.sizes());
    A2AD_CHECK(t.is_contiguous(), "a2ad: input_payloads[", i, "] must be contiguous");
    int64_t nb = t.element_size();  // bytes per token
    for (int64_t d = 1; d < t.dim(); ++d) nb *= t.size(d);
    A2AD_DEBUG_CHECK(nb > 0, "a2ad: input_payloads[", i, "] has 0 bytes per token");
    set_payload_region(pl, workspace, rt, static_cast<int>(i), payload_offsets[i], nb, "input_payloads", &p);
    p.payload[i] = static_cast<const uint8_t*>(t.data_ptr());
  }
  // The payload descriptor (layout.payload_spec); none given: count and widths only.
  if (spec.empty()) {
    p.spec[0] = p.num_payloads;
    for (int i = 0; i < p.num_payloads; ++i) p.spec[1 + i] = static_cast<int32_t>(p.payload_bytes[i]);
  } else {
    set_spec(spec, &p);
    A2AD_CHECK(p.spec[0] == p.num_payloads, "a2ad: spec counts ", p.spec[0], " payloads, got ", p.num_payloads);
  }
  const int64_t E = p.spec[8];
  A2AD_CHECK(E >= 0, "a2ad: eplb_stats_num_experts must be >= 0, got ", E);
  if (E > 0) {
    A2AD_CHECK(eplb_local.has_value(), "a2ad: eplb_local_stats is required: the job gathers EPLB statistics of ", E,
               " experts");
    const Tensor& l = *eplb_local;
    check_same_device(l, workspace, "eplb_local_stats");
    A2AD_CHECK(l.scalar_type() == at::kInt && l.numel() == E && l.is_contiguous(),
               "a2ad: eplb_local_stats must be a contiguous int32 [eplb_stats_num_experts=", E, "], got ",
               l.scalar_type(), " ", l.sizes());
    A2AD_CHECK(eplb_offset >= pl.aux.block_counters && eplb_offset % 4 == 0 &&
                   eplb_offset + 4 * pl.ep_size * E <= workspace.size(1),
               "a2ad: the EPLB region [", eplb_offset, ", +", 4 * pl.ep_size * E, ") does not fit a row");
    p.eplb_local = l.data_ptr<int32_t>();
    p.eplb_experts = static_cast<int>(E);
    p.eplb_offset = eplb_offset;
    if (eplb_out.has_value()) {
      const Tensor& o = *eplb_out;
      check_same_device(o, workspace, "eplb_gathered_stats");
      A2AD_CHECK(o.scalar_type() == at::kInt && o.dim() == 2 && o.size(0) == pl.ep_size && o.size(1) == E &&
                     o.is_contiguous(),
                 "a2ad: eplb_gathered_stats must be a contiguous int32 [ep_size=", pl.ep_size, ", ", E, "], got ",
                 o.scalar_type(), " ", o.sizes());
      p.eplb_out = o.data_ptr<int32_t>();
    }
  }
  caller_mask_args(caller_mask, caller_mask_value, workspace, &p.caller_mask);
  A2AD_CHECK_CUDA(a2ad::launch_dispatch(p, current_stream(workspace)), "dispatch launch");
}

void sanitize_cuda(Tensor& recv_ids, const Tensor& workspace, int64_t plan, int64_t rt, int64_t invalid_id) {
  const Plan pl = plan_of(plan, workspace);
  c10::cuda::CUDAGuard guard(workspace.device());
  check_same_device(recv_ids, workspace, "recv_ids");
  A2AD_CHECK(recv_ids.scalar_type() == at::kInt, "a2ad: recv_ids must be int32, got ", recv_ids.scalar_type());
  A2AD_CHECK(recv_ids.dim() == 3 && recv_ids.size(0) == pl.ep_size && recv_ids.size(1) == rt,
              "a2ad: recv_ids must be [ep_size=", pl.ep_size, ", runtime_max_tokens_per_rank=", rt, ", top_k], got ",
              recv_ids.sizes());
  A2AD_CHECK(recv_ids.size(2) >= 1, "a2ad: recv_ids has no expert columns");
  A2AD_DEBUG_CHECK(invalid_id >= INT32_MIN && invalid_id <= INT32_MAX,
                   "a2ad: invalid_token_expert_id does not fit int32");
  a2ad::SanitizeParams p{};
  p.ws = plan_workspace(pl, workspace);
  p.aux = pl.aux;
  p.ids = recv_ids.data_ptr<int32_t>();
  p.ids_stride_src = recv_ids.stride(0);
  p.ids_stride_slot = recv_ids.stride(1);
  p.ids_stride_k = recv_ids.stride(2);
  p.rt = static_cast<int>(rt);
  p.top_k = static_cast<int>(recv_ids.size(2));
  p.invalid_id = static_cast<int32_t>(invalid_id);
  A2AD_CHECK_CUDA(a2ad::launch_sanitize(p, current_stream(workspace)), "sanitize launch");
}

// What every combine launch fills the same way: the plan's workspace and limits, the round's
// rt, region and descriptor, the caller's mask, and in a degrade job the `tokens` entries of
// `degraded` (`what` names the op in its errors, `count` the tokens' name).
a2ad::CombineParams combine_params(const Plan& pl, const Tensor& workspace, int64_t rt, int64_t combine_offset,
                                   int64_t spec, const std::optional<Tensor>& caller_mask, int64_t caller_mask_value,
                                   const std::optional<Tensor>& degraded, int64_t tokens, const char* what,
                                   const char* count) {
  a2ad::CombineParams p{};
  p.ws = plan_workspace(pl, workspace);
  p.aux = pl.aux;
  p.ctl = pl.ctl;
  p.lim.sm_budget = pl.sm_budget;
  p.rt = static_cast<int>(rt);
  p.combine_offset = combine_offset;
  p.spec = static_cast<uint32_t>(spec);
  caller_mask_args(caller_mask, caller_mask_value, workspace, &p.caller_mask);
  if (pl.ctl.degrade) {
    A2AD_CHECK(degraded.has_value(), "a2ad: ", what, "a degrade job's combine needs the degraded tensor");
    const Tensor& d = *degraded;
    check_same_device(d, workspace, "degraded");
    A2AD_CHECK((d.scalar_type() == at::kBool || d.scalar_type() == at::kByte) && d.dim() == 1 && d.size(0) == tokens &&
                   d.is_contiguous(),
               "a2ad: ", what, "degraded must be a contiguous bool/uint8 [", count, "=", tokens, "], got ",
               d.scalar_type(), " ", d.sizes());
    p.degraded = static_cast<uint8_t*>(d.data_ptr());
    p.seen_out = pl.seen_out;
    p.seen_dev = pl.seen_dev;
  }
  return p;
}

Tensor combine_cuda(const Tensor& payload, Tensor& workspace, int64_t plan, int64_t local_num_tokens, int64_t rt,
                    int64_t combine_offset, bool payload_in_workspace, const std::optional<Tensor>& degraded,
                    const std::optional<Tensor>& output, bool low_precision, int64_t spec,
                    const std::optional<Tensor>& caller_mask, int64_t caller_mask_value) {
  const Plan pl = plan_of(plan, workspace);
  c10::cuda::CUDAGuard guard(workspace.device());
  check_same_device(payload, workspace, "payload");
  a2ad::DType dtype;
  switch (payload.scalar_type()) {
    case at::kFloat: dtype = a2ad::DType::kFloat32; break;
    case at::kHalf: dtype = a2ad::DType::kFloat16; break;
    case at::kBFloat16: dtype = a2ad::DType::kBFloat16; break;
    default: A2AD_CHECK(false, "a2ad: payload must be bfloat16, float16 or float32, got ", payload.scalar_type());
  }
  A2AD_CHECK(rt >= 1 && rt <= pl.aux.max_num_tokens, "a2ad: runtime_max_tokens_per_rank must be in [1, ",
             pl.aux.max_num_tokens, "], got ", rt);
  A2AD_CHECK(payload.dim() == 3 && payload.size(0) == pl.ep_size && payload.size(1) == rt,
              "a2ad: payload must be [ep_size=", pl.ep_size, ", runtime_max_tokens_per_rank=", rt, ", hidden], got ",
              payload.sizes());
  const int64_t hidden = payload.size(2);
  A2AD_DEBUG_CHECK(hidden >= 1, "a2ad: payload has hidden size 0");
  A2AD_CHECK(local_num_tokens >= 0 && local_num_tokens <= rt, "a2ad: local_num_tokens must be in [0, ", rt,
              "], got ", local_num_tokens);
  if (low_precision) {
    A2AD_CHECK(payload.scalar_type() == at::kBFloat16, "a2ad: low_precision combine needs a bfloat16 payload, got ",
               payload.scalar_type());
    A2AD_CHECK(hidden % a2ad::layout::FP8_BLOCK == 0, "a2ad: low_precision combine needs hidden % ",
               a2ad::layout::FP8_BLOCK, " == 0, got ", hidden);
    A2AD_CHECK(reinterpret_cast<uintptr_t>(payload.data_ptr()) % 16 == 0 && combine_offset % 16 == 0,
               "a2ad: low_precision combine needs a 16-byte aligned payload and region");
  }
  const int64_t fp8_row = a2ad::fp8_row_bytes(hidden);
  const int64_t region = pl.ep_size * rt * (low_precision ? fp8_row : hidden * payload.element_size());
  A2AD_CHECK(combine_offset >= pl.aux.block_counters && combine_offset + region <= workspace.size(1),
             "a2ad: combine region [", combine_offset, ", +", region, ") does not fit a row of ", workspace.size(1),
             " bytes");
  A2AD_CHECK(payload.is_contiguous(), "a2ad: payload must be contiguous [ep_size, rt, hidden]");
#ifdef A2AD_DEBUG_CHECKS
  // (another tensor is never read: the kernel reads the region, inside the workspace)
  if (payload_in_workspace && !low_precision) {  // (low precision: the region is the FP8 one; the client checks)
    const auto* expect = static_cast<const uint8_t*>(workspace.data_ptr()) + pl.ep_rank * workspace.stride(0) +
                         combine_offset;
    A2AD_DEBUG_CHECK(static_cast<const uint8_t*>(payload.data_ptr()) == expect,
                     "a2ad: payload_in_workspace=True but payload is not this rank's combine region "
                     "(use get_combine_payload_tensor_in_workspace)");
  }
#endif
  Tensor out;
  if (output.has_value()) {
    out = *output;
    check_same_device(out, workspace, "output");
    A2AD_CHECK(out.scalar_type() == payload.scalar_type() && out.dim() == 2 && out.size(0) == local_num_tokens &&
                   out.size(1) == hidden && out.is_contiguous(),
               "a2ad: output must be a contiguous ", payload.scalar_type(), " [", local_num_tokens, ", ", hidden,
               "], got ", out.scalar_type(), " ", out.sizes());
    A2AD_CHECK(!low_precision || reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
               "a2ad: low_precision combine needs a 16-byte aligned output");
  } else {
    out = at::empty({local_num_tokens, hidden}, payload.options().memory_format(at::MemoryFormat::Contiguous));
  }
  a2ad::CombineParams p = combine_params(pl, workspace, rt, combine_offset, spec, caller_mask, caller_mask_value,
                                         degraded, local_num_tokens, "", "local_num_tokens");
  p.payload = static_cast<const uint8_t*>(payload.data_ptr());
  p.payload_in_workspace = payload_in_workspace;
  p.out = out.data_ptr();
  p.dtype = dtype;
  p.hidden = hidden;
  p.local_num_tokens = static_cast<int>(local_num_tokens);
  p.top_k = pl.top_k;
  p.low_precision = low_precision;
  A2AD_CHECK_CUDA(a2ad::launch_combine(p, current_stream(workspace)), "combine launch");
  return out;
}

void initialize_cuda(Tensor& workspace, int64_t rank, int64_t aux_bytes, int64_t flag_offset, int64_t initial_round) {
  check_workspace(workspace, rank, workspace.size(0));
  c10::cuda::CUDAGuard guard(workspace.device());
  A2AD_CHECK(aux_bytes >= 4 && aux_bytes % 4 == 0 && aux_bytes <= workspace.size(1),
              "a2ad: aux_bytes must be a multiple of 4 within the row, got ", aux_bytes);
  A2AD_CHECK(flag_offset >= 0 && flag_offset % 4 == 0 && flag_offset < aux_bytes,
              "a2ad: flag_offset must be an aligned offset inside the aux region, got ", flag_offset);
  a2ad::InitializeParams p{};
  p.row = static_cast<uint8_t*>(workspace.data_ptr()) + rank * workspace.stride(0);
  p.aux_bytes = aux_bytes;
  p.flag_val = flag_offset;
  p.initial_round = static_cast<int32_t>(initial_round);
  A2AD_CHECK_CUDA(a2ad::launch_initialize(p, current_stream(workspace)), "initialize launch");
}

// --- fake (meta) implementations: shapes only, for torch.compile and graph capture ---

void dispatch_meta(const Tensor&, TensorList, Tensor&, int64_t, int64_t, IntArrayRef, IntArrayRef,
                   const std::optional<Tensor>&, const std::optional<Tensor>&, int64_t, const std::optional<Tensor>&,
                   int64_t) {}

void sanitize_meta(Tensor&, const Tensor&, int64_t, int64_t, int64_t) {}

Tensor combine_meta(const Tensor& payload, Tensor&, int64_t, int64_t local_num_tokens, int64_t, int64_t, bool,
                    const std::optional<Tensor>&, const std::optional<Tensor>&, bool, int64_t,
                    const std::optional<Tensor>&, int64_t) {
  A2AD_CHECK(payload.dim() == 3, "a2ad: payload must be [ep_size, rt, hidden], got ", payload.sizes());
  return at::empty({local_num_tokens, payload.size(2)}, payload.options());
}

void initialize_meta(Tensor&, int64_t, int64_t, int64_t, int64_t) {}

// --- host helpers (no tensors) ---------------------------------------------------

std::mutex g_registered_mutex;
std::map<uintptr_t, std::pair<int64_t, int>> g_registered;  // host ptr -> (device ptr, refcount)

// Register host memory (the control block) for GPU access; returns its device
// pointer. Registering the same address again returns the same pointer
// (reference counted).
int64_t host_register(int64_t ptr, int64_t size) {
  A2AD_CHECK(ptr != 0, "a2ad: host_register: ptr is null");
  A2AD_CHECK(size > 0, "a2ad: host_register: size must be > 0, got ", size);
  std::lock_guard<std::mutex> lock(g_registered_mutex);
  auto it = g_registered.find(static_cast<uintptr_t>(ptr));
  if (it != g_registered.end()) {
    it->second.second += 1;
    return it->second.first;
  }
  void* host = reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
  A2AD_CHECK_CUDA(cudaHostRegister(host, static_cast<size_t>(size), cudaHostRegisterMapped | cudaHostRegisterPortable),
                  "cudaHostRegister of the control block");
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err != cudaSuccess) {
    cudaHostUnregister(host);
    A2AD_CHECK(false, "a2ad: cudaHostGetDevicePointer of the control block failed: ", cudaGetErrorString(err));
  }
  const auto d = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dev));
  g_registered[static_cast<uintptr_t>(ptr)] = {d, 1};
  return d;
}

void host_unregister(int64_t ptr) {
  std::lock_guard<std::mutex> lock(g_registered_mutex);
  auto it = g_registered.find(static_cast<uintptr_t>(ptr));
  A2AD_CHECK(it != g_registered.end(), "a2ad: host_unregister: ", ptr, " was not registered by host_register");
  if (--it->second.second > 0) return;
  g_registered.erase(it);
  A2AD_CHECK_CUDA(cudaHostUnregister(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr))),
                  "cudaHostUnregister of the control block");
}

int64_t sm_count(int64_t device) {
  int n = 0;
  A2AD_CHECK_CUDA(a2ad::sm_count(static_cast<int>(device), &n), "SM count query");
  return n;
}

}  // namespace

TORCH_LIBRARY(a2ad, m) {
  m.def(
      "make_plan(Tensor workspace, int ep_rank, int ep_size, int top_k, int num_experts, int[] aux, int control, "
      "int timeout_ns, int sm_budget, int diag, bool degrade=False, int seen_out=0, int seen_dev=0) -> int",
      &make_plan);
  m.def("free_plan(int plan) -> ()", &free_plan);
  m.def(
      "dispatch(Tensor experts, Tensor[] payloads, Tensor(a!) workspace, int plan, int rt, int[] payload_offsets, "
      "int[] spec=[], Tensor? eplb_local=None, Tensor(b!)? eplb_out=None, int eplb_offset=0, Tensor? caller_mask=None, "
      "int caller_mask_value=-1) -> ()");
  m.def("sanitize(Tensor(a!) recv_ids, Tensor workspace, int plan, int rt, int invalid_id) -> ()");
  m.def(
      "combine(Tensor payload, Tensor(a!) workspace, int plan, int local_num_tokens, int rt, int combine_offset, "
      "bool payload_in_workspace, Tensor(b!)? degraded=None, Tensor(c!)? output=None, bool low_precision=False, "
      "int spec=0, Tensor? caller_mask=None, int caller_mask_value=-1) -> Tensor");
  m.def("initialize(Tensor(a!) workspace, int rank, int aux_bytes, int flag_offset, int initial_round) -> ()");
  m.def("host_register(int ptr, int size) -> int", &host_register);
  m.def("host_unregister(int ptr) -> ()", &host_unregister);
  m.def("sm_count(int device) -> int", &sm_count);
}

TORCH_LIBRARY_IMPL(a2ad, CUDA, m) {
  m.impl("dispatch", &dispatch_cuda);
  m.impl("sanitize", &sanitize_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("initialize", &initialize_cuda);
}

TORCH_LIBRARY_IMPL(a2ad, Meta, m) {
  m.impl("dispatch", &dispatch_meta);
  m.impl("sanitize", &sanitize_meta);
  m.impl("combine", &combine_meta);
  m.impl("initialize", &initialize_meta);
}

// No op here has a gradient. Without an Autograd kernel the dispatcher routes calls through
// torch's autograd-not-implemented fallback, which crashed the process (seen on torch 2.11)
// when a kernel's input check threw; a fallthrough skips the Autograd key altogether.
TORCH_LIBRARY_IMPL(a2ad, Autograd, m) {
  m.impl("dispatch", torch::CppFunction::makeFallthrough());
  m.impl("sanitize", torch::CppFunction::makeFallthrough());
  m.impl("combine", torch::CppFunction::makeFallthrough());
  m.impl("initialize", torch::CppFunction::makeFallthrough());
}

// The module's direct entry points (see the top of this file). Lists arrive as vectors;
// errors are the same std::runtime_error (RuntimeError in Python).
namespace {

void dispatch_direct(const Tensor& experts, const std::vector<Tensor>& payloads, Tensor workspace, int64_t plan,
                     int64_t rt, const std::vector<int64_t>& payload_offsets, const std::vector<int64_t>& spec,
                     const std::optional<Tensor>& eplb_local, const std::optional<Tensor>& eplb_out,
                     int64_t eplb_offset, const std::optional<Tensor>& caller_mask, int64_t caller_mask_value) {
  dispatch_cuda(experts, payloads, workspace, plan, rt, payload_offsets, spec, eplb_local, eplb_out, eplb_offset,
                caller_mask, caller_mask_value);
}

void sanitize_direct(Tensor recv_ids, const Tensor& workspace, int64_t plan, int64_t rt, int64_t invalid_id) {
  sanitize_cuda(recv_ids, workspace, plan, rt, invalid_id);
}

Tensor combine_direct(const Tensor& payload, Tensor workspace, int64_t plan, int64_t local_num_tokens, int64_t rt,
                      int64_t combine_offset, bool payload_in_workspace, const std::optional<Tensor>& degraded,
                      const std::optional<Tensor>& output, bool low_precision, int64_t spec,
                      const std::optional<Tensor>& caller_mask, int64_t caller_mask_value) {
  return combine_cuda(payload, workspace, plan, local_num_tokens, rt, combine_offset, payload_in_workspace, degraded,
                      output, low_precision, spec, caller_mask, caller_mask_value);
}

// Block quantization of a combine output (csrc/quantize.cu); client/quant.py checks the
// format, layout and shapes, this the tensors the kernel writes through.
void quantize_direct(const Tensor& x, Tensor out, Tensor scales, int64_t fmt, int64_t layout, double scale,
                     const std::optional<Tensor>& scale_t) {
  A2AD_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "a2ad: quantize: x must be a contiguous CUDA [T, H] tensor");
  const auto dt = x.scalar_type();
  A2AD_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat, "a2ad: quantize: x must be bf16, fp16 or fp32, got ", dt);
  A2AD_CHECK(fmt >= 0 && fmt <= 2, "a2ad: quantize: fmt must be 0 (MXFP8), 1 (MXFP4) or 2 (NVFP4), got ", fmt);
  A2AD_CHECK(layout >= 0 && layout <= 2, "a2ad: quantize: layout must be 0 (128x4), 1 (8x4) or 2 (linear), got ", layout);
  const int64_t T = x.size(0), H = x.size(1), block = fmt == 2 ? 16 : 32;
  A2AD_CHECK(H % block == 0, "a2ad: quantize: H ", H, " is not a multiple of the block ", block);
  const int64_t cols = H / block, rm = layout == 0 ? 128 : (layout == 1 ? 8 : 1), cm = layout == 2 ? 1 : 4;
  const int64_t want_scales = (T + rm - 1) / rm * rm * ((cols + cm - 1) / cm * cm);
  const int64_t want_out = fmt == 0 ? T * H : T * H / 2;
  for (const Tensor* t : {&out, &scales}) {
    A2AD_CHECK(t->is_cuda() && t->device() == x.device() && t->scalar_type() == at::kByte && t->is_contiguous(),
               "a2ad: quantize: out and scales must be contiguous uint8 tensors on x's device ", x.device());
  }
  A2AD_CHECK(out.numel() == want_out, "a2ad: quantize: out holds ", out.numel(), " bytes, expected ", want_out);
  A2AD_CHECK(scales.numel() == want_scales, "a2ad: quantize: scales hold ", scales.numel(), " bytes, expected ", want_scales);
  const float* scale_ptr = nullptr;
  if (scale_t.has_value()) {
    const Tensor& s = *scale_t;
    A2AD_CHECK(s.is_cuda() && s.device() == x.device() && s.scalar_type() == at::kFloat && s.numel() == 1,
               "a2ad: quantize: scale_t must be one fp32 element on x's device");
    scale_ptr = s.data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int code = dt == at::kBFloat16 ? 0 : (dt == at::kHalf ? 1 : 2);
  A2AD_CHECK_CUDA(a2ad::launch_quantize(x.data_ptr(), code, T, H, out.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                                        static_cast<int>(fmt), static_cast<int>(layout), static_cast<float>(scale),
                                        scale_ptr, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
                  "quantize launch");
}

// a2ad.deep_ep's local steps (csrc/ll.cu). a2ad/deep_ep.py makes every tensor; these checks
// keep a direct call inside the tensors it passes.
void check_ll(const Tensor& t, const Tensor& like, const char* name, std::initializer_list<c10::ScalarType> dtypes) {
  A2AD_CHECK(t.is_cuda() && t.device() == like.device(), "a2ad: ll: ", name, " must be on ", like.device(), ", got ",
             t.device());
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  A2AD_CHECK(ok, "a2ad: ll: ", name, " has dtype ", t.scalar_type());
}

void check_dense(const Tensor& t, const char* name, int64_t numel) {
  A2AD_CHECK(t.is_contiguous() && t.numel() == numel, "a2ad: ll: ", name, " must be contiguous with ", numel,
             " elements, got ", t.sizes(), " strides ", t.strides());
}

// rows of [n0, n1, width] whose last two dimensions are dense: the stride of the first, in bytes
int64_t ll_source_stride_bytes(const Tensor& t, int64_t n0, int64_t n1, int64_t row_bytes, const char* name) {
  const int64_t es = t.element_size();
  A2AD_CHECK(t.dim() == 3 && t.size(0) == n0 && t.size(1) == n1 && t.size(2) * es == row_bytes && t.stride(2) == 1 &&
                 t.stride(1) * es == row_bytes && t.stride(0) >= n1 * t.stride(1),
             "a2ad: ll: ", name, " must be [", n0, ", ", n1, ", ", row_bytes, " bytes] with dense rows, got ",
             t.sizes(), " strides ", t.strides());
  return t.stride(0) * es;
}

a2ad::LlRouting ll_routing(const Tensor& topk_idx, const Tensor& like) {
  check_ll(topk_idx, like, "topk_idx", {at::kLong, at::kInt});
  A2AD_CHECK(topk_idx.dim() == 2 && topk_idx.is_contiguous() && topk_idx.size(1) >= 1 && topk_idx.size(1) <= 32,
             "a2ad: ll: topk_idx must be a contiguous [T, K <= 32] tensor, got ", topk_idx.sizes());
  a2ad::LlRouting r{};
  if (topk_idx.scalar_type() == at::kLong) r.idx64 = topk_idx.data_ptr<int64_t>();
  else r.idx32 = topk_idx.data_ptr<int32_t>();
  r.T = topk_idx.size(0);
  r.K = static_cast<int>(topk_idx.size(1));
  return r;
}

void ll_pack_direct(const Tensor& x, const Tensor& topk_idx, Tensor route, Tensor meta, Tensor rows,
                    const Tensor& scales, int64_t rank, int64_t lx, bool round_scale) {
  check_ll(x, x, "x", {at::kBFloat16});
  A2AD_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 128 == 0 &&
                 reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
             "a2ad: ll_pack: x must be a contiguous 16-byte aligned [T, H % 128 == 0] tensor, got ", x.sizes());
  a2ad::LlRouting r = ll_routing(topk_idx, x);
  A2AD_CHECK(r.T == x.size(0), "a2ad: ll_pack: topk_idx has ", r.T, " rows, x ", x.size(0));
  const int64_t n = r.T * r.K, H = x.size(1);
  check_ll(route, x, "route", {at::kInt});
  check_dense(route, "route", n);
  check_ll(meta, x, "meta", {at::kInt});
  check_dense(meta, "meta", 2 * n);
  check_ll(rows, x, "rows", {at::kFloat8_e4m3fn, at::kByte});
  check_ll(scales, x, "scales", {at::kFloat});
  check_dense(scales, "scales", n * (H / 128));
  check_dense(rows, "rows", n * H);
  A2AD_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0, "a2ad: ll_pack: rows must be 16-byte aligned");
  a2ad::LlPackParams p{};
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.routing = r;
  p.H = static_cast<int>(H);
  p.rank = static_cast<int>(rank);
  p.lx = static_cast<int>(lx);
  p.route = route.data_ptr<int32_t>();
  p.meta = meta.data_ptr<int32_t>();
  p.rows = reinterpret_cast<uint8_t*>(rows.data_ptr());
  p.scales = scales.data_ptr<float>();
  p.round_scale = round_scale;
  const c10::cuda::CUDAGuard guard(x.device());
  A2AD_CHECK_CUDA(a2ad::launch_ll_pack(p, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
                  "ll_pack launch");
}

// A dispatch of a round of (token, k) pairs (a2ad.deep_ep's, a top_k = 1 job): x's rows and
// the pairs' metadata (token, expert id) go to the owners of topk_idx's experts, one slot per
// pair with an expert (dispatch_kernel's kPairs; DispatchParams says what). The received
// payloads are the rows ([ep, rt, hidden] of x's dtype) and the metadata ([ep, rt, 2] int32)
// at payload_offsets.
void dispatch_pairs_direct(const Tensor& x, const Tensor& topk_idx, Tensor workspace, int64_t plan, int64_t rt,
                           const std::vector<int64_t>& payload_offsets, const std::vector<int64_t>& spec,
                           const std::optional<Tensor>& caller_mask, int64_t caller_mask_value) {
  const Plan pl = plan_of(plan, workspace);
  c10::cuda::CUDAGuard guard(workspace.device());
  A2AD_CHECK(pl.top_k == 1, "a2ad: dispatch_pairs: the job's top_k must be 1 (one token per pair), got ", pl.top_k);
  check_same_device(x, workspace, "x");
  A2AD_CHECK(x.dim() == 2 && x.size(1) >= 1 && x.is_contiguous(), "a2ad: dispatch_pairs: x must be a contiguous [T, hidden] "
             "tensor, got ", x.sizes());
  const a2ad::LlRouting r = ll_routing(topk_idx, x);
  A2AD_CHECK(r.T == x.size(0), "a2ad: dispatch_pairs: topk_idx has ", r.T, " rows, x ", x.size(0));
  const int64_t pairs = r.T * r.K;
  a2ad::DispatchParams p = dispatch_params(pl, workspace, rt);
  A2AD_CHECK(pairs <= rt, "a2ad: dispatch_pairs: ", pairs, " pairs, more than runtime_max_tokens_per_rank=", rt);
  A2AD_CHECK(payload_offsets.size() == 2, "a2ad: dispatch_pairs: 2 payload offsets (rows, metadata), got ",
             payload_offsets.size());
  p.experts = r.idx32;
  p.pair_ids64 = r.idx64;
  p.pair_group = r.K;
  p.local_num_tokens = static_cast<int>(pairs);
  p.top_k = 1;
  p.num_payloads = 2;
  const int64_t bytes[2] = {x.size(1) * static_cast<int64_t>(x.element_size()), 8};
  for (int i = 0; i < 2; ++i) {
    set_payload_region(pl, workspace, rt, i, payload_offsets[i], bytes[i], "dispatch_pairs: payload", &p);
  }
  p.payload[0] = static_cast<const uint8_t*>(x.data_ptr());
  p.payload[1] = nullptr;  // the kernel writes each pair's (token, expert id)
  set_spec(spec, &p);
  A2AD_CHECK(p.spec[0] == 2 && p.spec[1] == bytes[0] && p.spec[2] == bytes[1] && p.spec[8] == 0,
             "a2ad: dispatch_pairs: spec must describe the rows (", bytes[0], " bytes) and the metadata (8 bytes), "
             "no EPLB statistics");
  caller_mask_args(caller_mask, caller_mask_value, workspace, &p.caller_mask);
  A2AD_CHECK_CUDA(a2ad::launch_dispatch(p, current_stream(workspace)), "dispatch_pairs launch");
}

// An ll_arrange block keeps its per-(expert, source) counts in at most the shared memory a
// launch gets without opting in to more.
bool ll_arrange_fits(int64_t lx, int64_t ep, int64_t slots_per_block) {
  return lx >= 1 && ep >= 1 && lx * ep <= (int64_t{1} << 20) &&
         a2ad::ll_arrange_smem_bytes(static_cast<int>(lx), static_cast<int>(ep), static_cast<int>(slots_per_block)) <=
             48 * 1024;
}

void ll_arrange_direct(const Tensor& meta, const Tensor& counts, const Tensor& rows, const std::optional<Tensor>& scales,
                       Tensor out_rows, const std::optional<Tensor>& out_scales, Tensor recv_count, Tensor src_info,
                       Tensor layout_range, Tensor dest, const std::optional<Tensor>& stats, int64_t rank, int64_t lx,
                       int64_t num_max, int64_t slots_per_block, bool ue8m0, bool early) {
  check_ll(meta, meta, "meta", {at::kInt});
  A2AD_CHECK(meta.dim() == 3 && meta.size(2) == 2, "a2ad: ll_arrange: meta must be [ep, rt, 2], got ", meta.sizes());
  const int64_t ep = meta.size(0), rt = meta.size(1), r_total = ep * num_max;
  A2AD_CHECK(ep >= 1 && ep <= a2ad::kMaxEpSize && rt >= 1 && lx >= 1 && num_max >= 1 && rank >= 0 && rank < ep,
             "a2ad: ll_arrange: ep ", ep, ", rt ", rt, ", lx ", lx, ", num_max ", num_max, ", rank ", rank);
  A2AD_CHECK(slots_per_block >= 32 && slots_per_block % 32 == 0 && slots_per_block <= 1024,
             "a2ad: ll_arrange: slots_per_block must be a multiple of 32 in [32, 1024], got ", slots_per_block);
  A2AD_CHECK(ll_arrange_fits(lx, ep, slots_per_block),
             "a2ad: ll_arrange: ", lx * ep, " experts need more than 48 KB of shared memory");
  const int64_t meta_stride = ll_source_stride_bytes(meta, ep, rt, 8, "meta") / 4;
  check_ll(counts, meta, "counts", {at::kInt});
  check_dense(counts, "counts", ep);
  A2AD_CHECK(rows.is_cuda() && rows.device() == meta.device() && rows.dim() == 3, "a2ad: ll_arrange: rows must be [ep, rt, width] on ",
             meta.device());
  const int64_t row_bytes = rows.size(2) * rows.element_size();
  A2AD_CHECK(row_bytes % 16 == 0 && row_bytes > 0, "a2ad: ll_arrange: a row must be a multiple of 16 bytes, got ", row_bytes);
  const int64_t rows_stride = ll_source_stride_bytes(rows, ep, rt, row_bytes, "rows");
  A2AD_CHECK(out_rows.is_cuda() && out_rows.device() == meta.device() && out_rows.is_contiguous() &&
                 out_rows.numel() * out_rows.element_size() == lx * r_total * row_bytes,
             "a2ad: ll_arrange: out_rows must be a contiguous [lx, ep * num_max] array of ", row_bytes, "-byte rows");
  A2AD_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0 && rows_stride % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(out_rows.data_ptr()) % 16 == 0,
             "a2ad: ll_arrange: rows and out_rows must be 16-byte aligned (the rows are copied in 16-byte vectors)");
  int64_t ns = 0, scales_stride = 0;
  const bool fp8 = scales.has_value();
  A2AD_CHECK(fp8 == out_scales.has_value(), "a2ad: ll_arrange: scales and out_scales go together");
  if (fp8) {
    check_ll(*scales, meta, "scales", {at::kFloat});
    ns = scales->dim() == 3 ? scales->size(2) : 0;
    scales_stride = ll_source_stride_bytes(*scales, ep, rt, 4 * ns, "scales") / 4;
    A2AD_CHECK(ns >= 1 && (!ue8m0 || ns % 4 == 0), "a2ad: ll_arrange: ", ns, " scales per row");
    const Tensor& o = *out_scales;
    check_ll(o, meta, "out_scales", {ue8m0 ? at::kInt : at::kFloat});
    // DeepEP's layout: [lx, r_total, ns (or ns / 4)] viewed over [lx, ns (or ns / 4), r_total] memory
    const int64_t cols = ue8m0 ? ns / 4 : ns;
    A2AD_CHECK(o.dim() == 3 && o.size(0) == lx && o.size(1) == r_total && o.size(2) == cols && o.stride(1) == 1 &&
                   o.stride(2) == r_total && o.stride(0) == cols * r_total,
               "a2ad: ll_arrange: out_scales must be [", lx, ", ", r_total, ", ", cols, "] over [", lx, ", ", cols, ", ",
               r_total, "] memory, got ", o.sizes(), " strides ", o.strides());
  }
  check_ll(recv_count, meta, "recv_count", {at::kInt});
  check_dense(recv_count, "recv_count", lx);
  check_ll(src_info, meta, "src_info", {at::kInt});
  check_dense(src_info, "src_info", lx * r_total);
  check_ll(layout_range, meta, "layout_range", {at::kLong});
  check_dense(layout_range, "layout_range", lx * ep);
  check_ll(dest, meta, "dest", {at::kLong});
  check_dense(dest, "dest", ep * rt);
  if (stats.has_value()) {
    check_ll(*stats, meta, "stats", {at::kInt});
    check_dense(*stats, "stats", lx);
  }
  A2AD_CHECK(lx * r_total * row_bytes < (int64_t{1} << 62) && r_total < (int64_t{1} << 31),
             "a2ad: ll_arrange: the output is too large");
  a2ad::LlArrangeParams p{};
  p.meta = meta.data_ptr<int32_t>();
  p.meta_src_stride = meta_stride;
  p.counts = counts.data_ptr<int32_t>();
  p.rows = reinterpret_cast<const uint8_t*>(rows.data_ptr());
  p.rows_src_stride = rows_stride;
  p.scales = fp8 ? scales->data_ptr<float>() : nullptr;
  p.scales_src_stride = scales_stride;
  p.ep = static_cast<int>(ep);
  p.rt = static_cast<int>(rt);
  p.lx = static_cast<int>(lx);
  p.rank = static_cast<int>(rank);
  p.ns = static_cast<int>(ns);
  p.row_bytes = static_cast<int>(row_bytes);
  p.r_total = static_cast<int>(r_total);
  p.ue8m0 = fp8 && ue8m0;
  p.slots_per_block = static_cast<int>(slots_per_block);
  p.out_rows = reinterpret_cast<uint8_t*>(out_rows.data_ptr());
  if (fp8) {
    if (ue8m0) p.out_ue8m0 = reinterpret_cast<uint8_t*>(out_scales->data_ptr());
    else p.out_scales = out_scales->data_ptr<float>();
  }
  p.recv_count = recv_count.data_ptr<int32_t>();
  p.src_info = src_info.data_ptr<int32_t>();
  p.layout_range = layout_range.data_ptr<int64_t>();
  p.dest = dest.data_ptr<int64_t>();
  p.stats = stats.has_value() ? stats->data_ptr<int32_t>() : nullptr;
  const c10::cuda::CUDAGuard guard(meta.device());
  A2AD_CHECK_CUDA(a2ad::launch_ll_arrange(p, c10::cuda::getCurrentCUDAStream(meta.device().index()).stream(), early),
                  "ll_arrange launch");
}

// a2ad.deep_ep's combine of a round of (token, k) pairs (CombineParams, "low-latency pairs"):
// x holds the expert outputs (bf16 rows of `hidden`, any count), stage_index each slot's row
// in x, and out [T, hidden] gets each token's weighted sum of its pairs' rows.
void combine_pairs_direct(const Tensor& x, Tensor workspace, int64_t plan, int64_t rt, int64_t combine_offset,
                          const Tensor& stage_index, const Tensor& topk_idx, const Tensor& weights, Tensor out,
                          const std::optional<Tensor>& degraded, int64_t spec, const std::optional<Tensor>& caller_mask,
                          int64_t caller_mask_value) {
  const Plan pl = plan_of(plan, workspace);
  c10::cuda::CUDAGuard guard(workspace.device());
  A2AD_CHECK(pl.top_k == 1, "a2ad: combine_pairs: the job's top_k must be 1 (one token per pair), got ", pl.top_k);
  check_ll(out, workspace, "out", {at::kBFloat16});
  A2AD_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) % 8 == 0 &&
                 reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
             "a2ad: combine_pairs: out must be a contiguous 16-byte aligned [T, hidden % 8 == 0] tensor, got ",
             out.sizes());
  const int64_t hidden = out.size(1), row_bytes = 2 * hidden;
  const a2ad::LlRouting r = ll_routing(topk_idx, out);
  A2AD_CHECK(r.T == out.size(0), "a2ad: combine_pairs: topk_idx has ", r.T, " rows, out ", out.size(0));
  const int64_t pairs = r.T * r.K;
  A2AD_CHECK(rt >= 1 && rt <= pl.aux.max_num_tokens && pairs <= rt, "a2ad: combine_pairs: rt ", rt, " for ", pairs,
             " pairs (at most ", pl.aux.max_num_tokens, ")");
  check_ll(weights, out, "weights", {at::kFloat});
  check_dense(weights, "weights", pairs);
  check_ll(x, out, "x", {at::kBFloat16});
  A2AD_CHECK(x.is_contiguous() && x.numel() % hidden == 0 && x.numel() >= hidden &&
                 reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
             "a2ad: combine_pairs: x must be a contiguous 16-byte aligned array of bf16 rows of ", hidden, ", got ",
             x.sizes());
  check_ll(stage_index, out, "stage_index", {at::kLong});
  check_dense(stage_index, "stage_index", pl.ep_size * rt);
  const int64_t region = pl.ep_size * rt * row_bytes;
  A2AD_CHECK(combine_offset >= pl.aux.block_counters && combine_offset % 16 == 0 &&
                 combine_offset + region <= workspace.size(1),
             "a2ad: combine_pairs: combine region [", combine_offset, ", +", region, ") does not fit a row of ",
             workspace.size(1), " bytes");
  a2ad::CombineParams p = combine_params(pl, workspace, rt, combine_offset, spec, caller_mask, caller_mask_value,
                                         degraded, r.T, "combine_pairs: ", "T");
  p.payload = static_cast<const uint8_t*>(x.data_ptr());
  p.payload_in_workspace = false;
  p.out = out.data_ptr();
  p.dtype = a2ad::DType::kBFloat16;
  p.hidden = hidden;
  p.local_num_tokens = static_cast<int>(pairs);
  p.top_k = 1;
  p.low_precision = false;
  p.stage_index = stage_index.data_ptr<int64_t>();
  p.payload_rows = x.numel() / hidden;
  p.group = r.K;
  p.group_weights = weights.data_ptr<float>();
  p.group_ids64 = r.idx64;
  p.group_ids32 = r.idx32;
  // (with no pairs too: the round's flags go round every rank)
  A2AD_CHECK_CUDA(a2ad::launch_combine(p, current_stream(workspace)), "combine_pairs launch");
}

// Every kernel of the extension loaded on `device` now (csrc/moe_a2a.cuh says why).
void load_kernels(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  A2AD_CHECK_CUDA(a2ad::load_dispatch_kernels(), "loading the dispatch kernels");
  A2AD_CHECK_CUDA(a2ad::load_combine_kernels(), "loading the combine kernel");
  A2AD_CHECK_CUDA(a2ad::load_sanitize_kernels(), "loading the sanitize kernels");
  A2AD_CHECK_CUDA(a2ad::load_quantize_kernels(), "loading the quantize kernel");
  A2AD_CHECK_CUDA(a2ad::load_ll_kernels(), "loading the deep_ep kernels");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "a2ad kernels: direct entry points of the data-plane ops (same arguments as torch.ops.a2ad.*)";
  m.def("dispatch", &dispatch_direct, "torch.ops.a2ad.dispatch without the dispatcher", pybind11::arg("experts"),
        pybind11::arg("payloads"), pybind11::arg("workspace"), pybind11::arg("plan"), pybind11::arg("rt"),
        pybind11::arg("payload_offsets"), pybind11::arg("spec") = std::vector<int64_t>{},
        pybind11::arg("eplb_local") = pybind11::none(), pybind11::arg("eplb_out") = pybind11::none(),
        pybind11::arg("eplb_offset") = 0, pybind11::arg("caller_mask") = pybind11::none(),
        pybind11::arg("caller_mask_value") = -1);
  m.def("sanitize", &sanitize_direct, "torch.ops.a2ad.sanitize without the dispatcher");
  m.def("combine", &combine_direct, "torch.ops.a2ad.combine without the dispatcher", pybind11::arg("payload"),
        pybind11::arg("workspace"), pybind11::arg("plan"), pybind11::arg("local_num_tokens"), pybind11::arg("rt"),
        pybind11::arg("combine_offset"), pybind11::arg("payload_in_workspace"), pybind11::arg("degraded") = pybind11::none(),
        pybind11::arg("output") = pybind11::none(), pybind11::arg("low_precision") = false, pybind11::arg("spec") = 0,
        pybind11::arg("caller_mask") = pybind11::none(), pybind11::arg("caller_mask_value") = -1);
  m.def("load_kernels", &load_kernels, "load every kernel on a device now (not lazily at its first launch)",
        pybind11::arg("device"));
  m.def("quantize", &quantize_direct, "block quantization (MXFP8/MXFP4/NVFP4) of a combine output", pybind11::arg("x"),
        pybind11::arg("out"), pybind11::arg("scales"), pybind11::arg("fmt"), pybind11::arg("layout"),
        pybind11::arg("scale"), pybind11::arg("scale_t") = pybind11::none());
  m.def("ll_pack", &ll_pack_direct, "a2ad.deep_ep: an FP8 dispatch's (token, k) pairs (csrc/ll.cu)", pybind11::arg("x"),
        pybind11::arg("topk_idx"), pybind11::arg("route"), pybind11::arg("meta"), pybind11::arg("rows"),
        pybind11::arg("scales"), pybind11::arg("rank"), pybind11::arg("lx"), pybind11::arg("round_scale"));
  m.def("ll_arrange", &ll_arrange_direct, "a2ad.deep_ep: the received pairs expert-major (csrc/ll.cu)",
        pybind11::arg("meta"), pybind11::arg("counts"), pybind11::arg("rows"), pybind11::arg("scales"),
        pybind11::arg("out_rows"), pybind11::arg("out_scales"), pybind11::arg("recv_count"), pybind11::arg("src_info"),
        pybind11::arg("layout_range"), pybind11::arg("dest"), pybind11::arg("stats"), pybind11::arg("rank"),
        pybind11::arg("lx"), pybind11::arg("num_max"), pybind11::arg("slots_per_block"), pybind11::arg("ue8m0"),
        pybind11::arg("early") = true);
  m.def("ll_arrange_fits", &ll_arrange_fits, "whether an ll_arrange block's counts fit its shared memory",
        pybind11::arg("lx"), pybind11::arg("ep"), pybind11::arg("slots_per_block"));
  m.def("dispatch_pairs", &dispatch_pairs_direct,
        "a2ad.deep_ep: dispatch of a round of (token, k) pairs, x's rows and their metadata (csrc/dispatch.cu)",
        pybind11::arg("x"), pybind11::arg("topk_idx"), pybind11::arg("workspace"), pybind11::arg("plan"),
        pybind11::arg("rt"), pybind11::arg("payload_offsets"), pybind11::arg("spec"), pybind11::arg("caller_mask"),
        pybind11::arg("caller_mask_value"));
  m.def("combine_pairs", &combine_pairs_direct,
        "a2ad.deep_ep: combine of a round of (token, k) pairs, each token's weighted sum (csrc/combine.cu)",
        pybind11::arg("x"), pybind11::arg("workspace"), pybind11::arg("plan"), pybind11::arg("rt"),
        pybind11::arg("combine_offset"), pybind11::arg("stage_index"), pybind11::arg("topk_idx"),
        pybind11::arg("weights"), pybind11::arg("out"), pybind11::arg("degraded"), pybind11::arg("spec"),
        pybind11::arg("caller_mask"), pybind11::arg("caller_mask_value"));
}
