// The k largest entries of each row of x / t, in one pass over the row: what top-k sampling and the
// drafter's features need of a 152k-entry vocabulary row (torch.topk took 0.3-0.4 ms a row here,
// this about a tenth of it).
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
  // dropped when the buffer was compacted.
  const float kth = values[k - 1];
  const __m256 kv = _mm256_set1_ps(kth);
  int64_t count = 0;
  i = 0;
  for (; i + 8 <= v; i += 8)
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), kv, _CMP_GE_OQ)));
  for (; i < v; ++i) count += x[i] / t >= kth;
  *at_least = count;
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
}

SPECAV_IMPL(m) {
  m.impl("scaled_top_k", &scaled_top_k);
}
