// Passes over 152k-entry vocabulary rows that top-k sampling and the drafter's features need
// (specav/topk.py wraps them): the k largest entries of each row of x / t in one pass (torch.topk
// took 0.3-0.4 ms a row here, this about a tenth of it), and the features' top two with the sums
// of the softmax tail.
//
//   scaled_top_k(x, t, k) -> (values, indices, at_least)
//     x # [N, V] float32, t # [N] float32 (rows with t <= 0 are divided by 1, as
//     sampling.temperature_logits does), 1 <= k <= V;
//     values # [N, k] float32: the k largest of z = x / t in descending order (ties in index order),
//     indices # [N, k] int64: where they are, at_least # [N] int64: how many entries of z are >= the
//     k-th largest (k unless the k-th ties with entries beyond it; the caller then keeps all ties).
//
// z is computed by the same IEEE division as torch's `x / t`, so values equal torch's bit for bit.
// NaN entries are never selected (the callers refuse rows holding NaN before they get here).
//
//   top_two_tail(z) -> (values, indices, tail, moment)
//     z # [N, V] float32 without NaN or +inf, V >= 2; values # [N, 2], indices # [N, 2] int64: the two
//     largest entries as scaled_top_k(z, 1, 2) gives them; with m = values[:, 0] and d_j = max(z_j - m,
//     -100) over every entry but the first maximum: tail # [N] float64 = sum_j exp(d_j), moment # [N]
//     float64 = sum_j exp(d_j) d_j. acceptance/features.py turns them into logit(q_max), q_max, the
//     entropy and the top-2 margin.
//
// exp here is common.h's exp8 (Cephes' expf, within 2 ulp of torch's), 0 below d = -87.3 where
// float32 turns subnormal (torch's exp gives at most 152k x 1.2e-38
// more there, far below what the clamp of logit(q_max) can see). Sums run in float32 lanes over 256
// entries, then in float64.
//
// The pass keeps candidates that reach the current threshold in a buffer of 4k; when it fills, the
// k largest are kept and the threshold rises to the k-th of them. Most entries of a row fail one
// vector comparison against the threshold, so the pass costs about one read of the row.

#include "common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Candidate = std::pair<float, int64_t>;

inline bool before(const Candidate& a, const Candidate& b) {  // descending value, then ascending index
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

void top_k_row(const float* x, int64_t v, float t, int64_t k, float* values, int64_t* indices, int64_t* at_least) {
  std::vector<Candidate> keep;
  const size_t capacity = static_cast<size_t>(std::max<int64_t>(4 * k, 64));
  keep.reserve(capacity + 8);
  float threshold = -std::numeric_limits<float>::infinity();
  const __m256 tv = _mm256_set1_ps(t);
  auto compact = [&]() {
    std::nth_element(keep.begin(), keep.begin() + (k - 1), keep.end(), before);
    threshold = keep[k - 1].first;  // the k-th largest so far
    keep.resize(k);
  };
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 z = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_set1_ps(threshold), _CMP_GE_OQ));
    if (!mask) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    while (mask) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      if (lanes[j] >= threshold) keep.emplace_back(lanes[j], i + j);
    }
    if (keep.size() >= capacity) compact();
  }
  for (; i < v; ++i) {
    const float z = x[i] / t;
    if (z >= threshold) keep.emplace_back(z, i);
  }
  if (static_cast<int64_t>(keep.size()) > k) compact();
  std::sort(keep.begin(), keep.end(), before);
  const int64_t found = static_cast<int64_t>(keep.size());  // < k only where NaN entries were skipped
  for (int64_t j = 0; j < k; ++j) {
    values[j] = j < found ? keep[j].first : -std::numeric_limits<float>::infinity();
    indices[j] = j < found ? keep[j].second : 0;
  }
  // How many entries reach the k-th value: a second pass, since entries tied with it may have been
  // dropped when the buffer was compacted (skipped where the caller does not ask).
  if (at_least == nullptr) return;
  const float kth = values[k - 1];
  const __m256 kv = _mm256_set1_ps(kth);
  int64_t count = 0;
  i = 0;
  for (; i + 8 <= v; i += 8)
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), kv, _CMP_GE_OQ)));
  for (; i < v; ++i) count += x[i] / t >= kth;
  *at_least = count;
}

// tail and moment of one row (see the top): every entry but index `skip`, d = max(z - m, -100).
void tail_row(const float* z, int64_t v, float m, int64_t skip, double* tail, double* moment) {
  const __m256 mv = _mm256_set1_ps(m), floor = _mm256_set1_ps(-100.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd(), m0 = _mm256_setzero_pd(), m1 = _mm256_setzero_pd();
  int64_t i = 0;
  while (i + 8 <= v) {
    __m256 ts = _mm256_setzero_ps(), ms = _mm256_setzero_ps();
    const int64_t end = std::min<int64_t>(v - v % 8, i + 256);
    for (; i < end; i += 8) {
      const __m256 d = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(z + i), mv), floor);
      // 0 below d = -87.3, where exp8 clamps (float32's smallest normal is e^-87.34)
      __m256 e = _mm256_and_ps(specav_native::exp8(d), _mm256_cmp_ps(d, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));
      if (static_cast<uint64_t>(skip - i) < 8)  // the first maximum is left out of the sums
        e = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, _mm256_set1_epi32(static_cast<int>(skip - i)))), e);
      ts = _mm256_add_ps(ts, e);
      ms = _mm256_fmadd_ps(e, d, ms);
    }
    t0 = _mm256_add_pd(t0, _mm256_cvtps_pd(_mm256_castps256_ps128(ts)));
    t1 = _mm256_add_pd(t1, _mm256_cvtps_pd(_mm256_extractf128_ps(ts, 1)));
    m0 = _mm256_add_pd(m0, _mm256_cvtps_pd(_mm256_castps256_ps128(ms)));
    m1 = _mm256_add_pd(m1, _mm256_cvtps_pd(_mm256_extractf128_ps(ms, 1)));
  }
  alignas(32) double lanes_t[4], lanes_m[4];
  _mm256_store_pd(lanes_t, _mm256_add_pd(t0, t1));
  _mm256_store_pd(lanes_m, _mm256_add_pd(m0, m1));
  double ts = lanes_t[0] + lanes_t[1] + lanes_t[2] + lanes_t[3], ms = lanes_m[0] + lanes_m[1] + lanes_m[2] + lanes_m[3];
  for (; i < v; ++i) {
    if (i == skip) continue;
    const float d = std::max(z[i] - m, -100.0f);
    const float e = d >= -87.3f ? std::exp(d) : 0.0f;
    ts += e;
    ms += static_cast<double>(e) * d;
  }
  *tail = ts;
  *moment = ms;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> top_two_tail(const at::Tensor& z) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.is_contiguous(), "z must be a contiguous [N, V] float32 tensor");
  const int64_t n = z.size(0), v = z.size(1);
  TORCH_CHECK(v >= 2, "top_two_tail needs V >= 2, got ", v);
  auto values = at::empty({n, 2}, z.options());
  auto indices = at::empty({n, 2}, z.options().dtype(at::kLong));
  auto tail = at::empty({n}, z.options().dtype(at::kDouble));
  auto moment = at::empty({n}, z.options().dtype(at::kDouble));
  const float* zp = z.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  double* tp = tail.data_ptr<double>();
  double* mp = moment.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      top_k_row(zp + r * v, v, 1.0f, 2, vp + r * 2, ip + r * 2, nullptr);
      tail_row(zp + r * v, v, vp[r * 2], ip[r * 2], tp + r, mp + r);
    }
  });
  return {values, indices, tail, moment};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_top_k(const at::Tensor& x, const at::Tensor& temperature, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [N, V] float32 tensor");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == x.size(0) && temperature.scalar_type() == at::kFloat,
              "temperature must be a float32 vector of one value per row");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(k >= 1 && k <= v, "k must be in [1, V = ", v, "], got ", k);
  auto values = at::empty({n, k}, x.options());
  auto indices = at::empty({n, k}, x.options().dtype(at::kLong));
  auto at_least = at::empty({n}, x.options().dtype(at::kLong));
  const at::Tensor t = temperature.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  int64_t* cp = at_least.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float tr = tp[r] > 0.0f ? tp[r] : 1.0f;
      top_k_row(xp + r * v, v, tr, k, vp + r * k, ip + r * k, cp + r);
    }
  });
  return {values, indices, at_least};
}

}  // namespace

SPECAV_FRAGMENT(m) {
  m.def("scaled_top_k(Tensor x, Tensor temperature, int k) -> (Tensor, Tensor, Tensor)");
  m.def("top_two_tail(Tensor z) -> (Tensor, Tensor, Tensor, Tensor)");
}

SPECAV_IMPL(m) {
  m.impl("scaled_top_k", &scaled_top_k);
  m.impl("top_two_tail", &top_two_tail);
}
