// Runs the quantize kernel's per-block arithmetic (csrc/quantize.cu) on the host, entry by
// entry of the padded scale array, so that tests/test_quant.py can check it against the
// reference quantizer where no GPU is present (both the 16-byte vector and the unaligned paths).
//
// usage: quantize_host_driver IN DTYPE T H FMT LAYOUT SCALE OUT SCALES
//   IN: the raw [T, H] input (DTYPE 0 bf16, 1 fp16, 2 fp32); OUT, SCALES: files written.
#include "quantize.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

static std::vector<unsigned char> read_all(const char* path) {
  std::vector<unsigned char> buf;
  FILE* f = std::fopen(path, "rb");
  if (!f) return buf;
  unsigned char tmp[65536];
  size_t n;
  while ((n = std::fread(tmp, 1, sizeof tmp, f)) > 0) buf.insert(buf.end(), tmp, tmp + n);
  std::fclose(f);
  return buf;
}

static bool write_all(const char* path, const std::vector<unsigned char>& buf) {
  FILE* f = std::fopen(path, "wb");
  if (!f) return false;
  const bool ok = std::fwrite(buf.data(), 1, buf.size(), f) == buf.size();
  return std::fclose(f) == 0 && ok;
}

int main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s IN DTYPE T H FMT LAYOUT SCALE OUT SCALES\n", argv[0]);
    return 2;
  }
  std::vector<unsigned char> in = read_all(argv[1]);
  a2ad::QuantParams p{};
  p.dtype = std::atoi(argv[2]);
  p.T = std::atoll(argv[3]);
  p.H = std::atoll(argv[4]);
  p.fmt = std::atoi(argv[5]);
  p.layout = std::atoi(argv[6]);
  p.scale = std::strtof(argv[7], nullptr);
  p.scale_ptr = nullptr;
  std::vector<unsigned char> out(static_cast<size_t>(p.fmt == 0 ? p.T * p.H : p.T * p.H / 2), 0xEE);
  p.x = in.data();
  p.out = out.data();
  if (!a2ad::plan_quantize(p)) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const size_t elem = p.dtype == 2 ? 4 : 2;
  if (in.size() != static_cast<size_t>(p.T * p.H) * elem) {
    std::fprintf(stderr, "input holds %zu bytes, expected %lld\n", in.size(), static_cast<long long>(p.T * p.H * elem));
    return 2;
  }
  std::vector<unsigned char> scales(static_cast<size_t>(p.prows * p.pcols), 0xEE);
  p.scales = scales.data();
  if (!p.x_aligned || !p.out_aligned) {
    std::fprintf(stderr, "host buffers are not 16-byte aligned\n");
    return 2;
  }
  for (int64_t i = 0; i < p.prows * p.pcols; ++i) a2ad::quantize_entry(p, i);
  // The unaligned paths (element-wise loads and stores) must give the same bytes.
  std::vector<unsigned char> out2(out.size(), 0x11), scales2(scales.size(), 0x11);
  p.out = out2.data();
  p.scales = scales2.data();
  p.x_aligned = p.out_aligned = false;
  for (int64_t i = 0; i < p.prows * p.pcols; ++i) a2ad::quantize_entry(p, i);
  if (out2 != out || scales2 != scales) {
    std::fprintf(stderr, "the unaligned path differs from the vectorized one\n");
    return 1;
  }
  return write_all(argv[8], out) && write_all(argv[9], scales) ? 0 : 1;
}
