// Causal attention of a packed step's short rows on CPU, each row against its own blocks of a paged KV pool
// (read through its block table), all rows and heads in one call (specdec/ragged_attention.py loads it;
// specdec/packed_forward.py calls it).
//
// A verify block or a draft step feeds a row 1-16 queries against ~50-1000 cached positions. SDPA's CPU kernel
// tiles for long query blocks and costs one call per row; here a (row, head) task computes its scores with the
// row's queries held in registers, takes a softmax per query over the positions it sees, and sums the values
// four queries at a time, so each line of the row's keys and values is read from memory once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

using Vec = at::vec::Vectorized<float>;

namespace {

float sum_of(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); }

// s[l] = scale * q . k_l for l in [0, seen); keys [seen, D] row-major.
void scores_of(const float* q, const float* keys, int64_t seen, int64_t D, float scale, float* s) {
  const int64_t V = Vec::size();
  int64_t l = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D == 64) {  // the query in 8 registers; four positions' dot products reduced together
    __m256 qv[8];
    for (int j = 0; j < 8; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
    for (; l + 4 <= seen; l += 4) {
      __m256 acc[4];
      for (int b = 0; b < 4; ++b) {
        const float* k = keys + (l + b) * D;
        __m256 even = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
        __m256 odd = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
        for (int j = 2; j < 8; j += 2) {
          even = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), even);
          odd = _mm256_fmadd_ps(qv[j + 1], _mm256_loadu_ps(k + 8 * j + 8), odd);
        }
        acc[b] = _mm256_add_ps(even, odd);
      }
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m128 four = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
      _mm_storeu_ps(s + l, _mm_mul_ps(four, _mm_set1_ps(scale)));
    }
  }
#endif
  for (; l < seen; ++l) {
    const float* k = keys + l * D;
    Vec acc(0.f);
    for (int64_t d = 0; d < D; d += V) acc = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), acc);
    s[l] = sum_of(acc) * scale;
  }
}

// s[0, seen) <- softmax(s[0, seen)).
void softmax_in_place(float* s, int64_t seen) {
  const int64_t V = Vec::size();
  const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, seen);
  const Vec top_v(top);
  Vec total_v(0.f);
  int64_t l = 0;
  for (; l + V <= seen; l += V) {
    const Vec e = (Vec::loadu(s + l) - top_v).exp_u20();
    e.store(s + l);
    total_v = total_v + e;
  }
  float total = sum_of(total_v);
  for (; l < seen; ++l) {
    s[l] = std::exp(s[l] - top);
    total += s[l];
  }
  const float inverse = 1.f / total;
  for (l = 0; l < seen; ++l) s[l] *= inverse;
}

}  // namespace

// query  [H, T, D]      float32, last dim contiguous (any other strides)
// keys   [Hkv, N, B, D] float32, contiguous: one layer of the pool, N blocks of B positions per head; values
//                       alike; H a multiple of Hkv
// rows   [R, 4] int64   (table, start, count, offset): query tokens offset..offset+count-1 are positions
//                       start..start+count-1 of a sequence whose blocks are tables[table], tables[table + 1], ...
//                       (position l in block tables[table + l / B] at l % B), and token i sees positions 0..start+i
// tables [M] int64      the rows' block tables, one after another
// out    [T, H, D]      float32, contiguous: the rows' tokens are written, other tokens left as they are
void ragged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& rows, const at::Tensor& tables, double scale, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 tensors only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [H, T, D] with D contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && out.is_contiguous(), "contiguous keys/values/out");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2 && rows.size(1) == 4,
              "rows must be int64 [R, 4]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 1,
              "tables must be int64 [M]");
  const int64_t H = query.size(0), D = query.size(2), Hkv = keys.size(0), N = keys.size(1), B = keys.size(2);
  TORCH_CHECK(keys.size(3) == D && H % Hkv == 0 && D % (2 * Vec::size()) == 0, "unsupported head layout");
  const int64_t R = rows.size(0), group = H / Hkv, q_h = query.stride(0), q_t = query.stride(1);
  const int64_t block_stride = B * D;  // floats from one block to the next
  const float* q_ptr = query.data_ptr<float>();
  const float* k_ptr = keys.data_ptr<float>();
  const float* v_ptr = values.data_ptr<float>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  float* o_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t V = Vec::size();
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs;  // [count rounded up to 4, start + count]: zero where a query sees nothing
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / H, h = task % H;
      const int64_t* table = table_ptr + row_ptr[4 * r];
      const int64_t start = row_ptr[4 * r + 1], n = row_ptr[4 * r + 2];
      const int64_t offset = row_ptr[4 * r + 3], L = start + n;
      const int64_t head_at = (h / group) * N * B * D;  // the head's [N, B, D]
      probs.assign((n + 3) / 4 * 4 * L, 0.f);
      for (int64_t i = 0; i < n; ++i) {
        float* p = probs.data() + i * L;
        const float* q = q_ptr + h * q_h + (offset + i) * q_t;
        const int64_t seen = start + i + 1;
        for (int64_t at = 0; at < seen; at += B) {  // block by block: B positions contiguous in each
          const float* K = k_ptr + table[at / B] * block_stride + head_at;
          scores_of(q, K, std::min(B, seen - at), D, fscale, p + at);
        }
        softmax_in_place(p, seen);
      }
      for (int64_t i0 = 0; i0 < n; i0 += 4) {  // four queries, two vectors of D at a time
        const int64_t last = std::min<int64_t>(L, start + i0 + 4);  // positions the group's last query sees
        const float* p = probs.data() + i0 * L;
        for (int64_t d = 0; d < D; d += 2 * V) {
          Vec acc[4][2];
          for (int b = 0; b < 4; ++b) acc[b][0] = acc[b][1] = Vec(0.f);
          for (int64_t at = 0; at < last; at += B) {
            const float* Vals = v_ptr + table[at / B] * block_stride + head_at + d;  // position at, dims d..
            const int64_t in_block = std::min(last - at, B);
            for (int64_t l = 0; l < in_block; ++l) {
              const Vec v0 = Vec::loadu(Vals + l * D), v1 = Vec::loadu(Vals + l * D + V);
              for (int b = 0; b < 4; ++b) {
                const Vec w(p[b * L + at + l]);
                acc[b][0] = at::vec::fmadd(w, v0, acc[b][0]);
                acc[b][1] = at::vec::fmadd(w, v1, acc[b][1]);
              }
            }
          }
          for (int b = 0; b < 4 && i0 + b < n; ++b) {
            float* o = o_ptr + ((offset + i0 + b) * H + h) * D + d;
            acc[b][0].store(o);
            acc[b][1].store(o + V);
          }
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ragged_attention", &ragged_attention, "causal attention of short packed rows against a paged KV pool");
}
