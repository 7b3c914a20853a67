// The coupled rule's exponential noise on CPU, one pass over [R, V] (specdec/sampling/coupled_noise.py loads it
// and holds the same formula as tensor ops, which every other device runs).
//
// Element (r, i): a 32-bit counter hash of the vocabulary index i under the row's two key words k0, k1,
// lowbias32((i * (k1 | 1)) ^ k0), its top 23 bits as a uniform u in (0, 1), and e = -log(u) by a fixed sequence of IEEE float32 operations (no libm call, no
// fused multiply-add: built with -ffp-contract=off), so every device computes the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

inline uint32_t mix(uint32_t x) {  // lowbias32 (Chris Wellons' hash prospector)
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

inline float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// -log(u) for u = (m + 0.5) * 2^-23, in the order coupled_noise.py's tensor ops take.
inline float neg_log_uniform(uint32_t m) {
  const float u = (static_cast<float>(static_cast<int32_t>(m)) + 0.5f) * 1.1920928955078125e-07f;  // 2^-23
  const uint32_t bits = bits_of(u);
  int32_t exponent = static_cast<int32_t>(bits >> 23) - 127;
  float f = float_of((bits & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool big = f > 1.41421353816986083984375f;           // sqrt(2) in float32
  f = big ? f * 0.5f : f;
  exponent += big ? 1 : 0;
  const float r = f - 1.0f;
  const float s = r / (r + 2.0f);
  const float s2 = s * s;
  float t = s2 * 0.111111111938953399658203125f;  // 1/9
  t = t + 0.14285714924335479736328125f;          // 1/7
  t = t * s2;
  t = t + 0.20000000298023223876953125f;  // 1/5
  t = t * s2;
  t = t + 0.3333333432674407958984375f;  // 1/3
  t = t * s2;
  float log1p = s + s * t;
  log1p = log1p + log1p;
  const float log_u = static_cast<float>(exponent) * 0.693147182464599609375f + log1p;  // ln 2 in float32
  return -log_u;
}

}  // namespace

// keys [R, 2] int32 (each row's two key words), out [R, V] float32.
void exponential_noise(const torch::Tensor& keys, torch::Tensor& out) {
  TORCH_CHECK(keys.dtype() == torch::kInt32 && keys.dim() == 2 && keys.size(1) == 2 && keys.is_contiguous());
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.is_contiguous() && out.size(0) == keys.size(0));
  const int64_t rows = out.size(0), vocab = out.size(1);
  const uint32_t* key = reinterpret_cast<const uint32_t*>(keys.data_ptr<int32_t>());
  float* noise = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(vocab, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t k0 = key[2 * r], multiplier = key[2 * r + 1] | 1u;
      float* row = noise + r * vocab;
      const uint32_t width = static_cast<uint32_t>(vocab);
      for (uint32_t i = 0; i < width; ++i) {
        row[i] = neg_log_uniform(mix((i * multiplier) ^ k0) >> 9);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exponential_noise", &exponential_noise, "the coupled rule's exponential noise, keys [R, 2] -> out [R, V]");
}
