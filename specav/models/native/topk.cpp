// Passes over 152k-entry vocabulary rows that top-k sampling and the drafter's features need
// (specav/topk.py wraps them): one pass for the k largest entries of each row of x / t and whether
// the row has a distribution at all, one more for how many entries tie with the k-th and, where
// asked, the sums of the softmax tail that the features read. torch.topk took 0.3-0.4 ms a row here,
// the first pass about a tenth of it.
//
//   scan_rows(x, t, k, tails) -> (values, indices, at_least, bad, second, tail, moment)
//     x # [N, V] float32, t # [N] float32 (rows with t <= 0 are divided by 1, as
//     sampling.temperature_logits does), 1 <= k <= V (V >= 2 with tails);
//     values # [N, k] float32: the k largest of z = x / t in descending order (ties in index order),
//     indices # [N, k] int64: where they are, at_least # [N] int64: how many entries of z are >= the
//     k-th largest (k unless the k-th ties with entries beyond it; the caller then keeps all ties),
//     bad # [N] bool: the row holds a NaN or +inf or no finite entry (sampling.non_finite_rows; the
//     other outputs of such a row mean nothing). With tails, also # [N] each: second (float32), the
//     second largest of z, and with m = values[:, 0] and d_j = max(z_j - m, -100) over every entry but
//     the first maximum: tail (float64) = sum_j exp(d_j), moment (float64) = sum_j exp(d_j) d_j;
//     acceptance/features.py turns them into logit(q_max), q_max, the entropy and the top-2 margin.
//     Without tails those three are empty.
//   scaled_top_k(x, t, k) -> (values, indices, at_least) and top_two_tail(z) -> (values # [N, 2], indices,
//     tail, moment): the same passes (top_two_tail is scan_rows(z, 1, 2, tails)).
//
// z is computed by the same IEEE division as torch's `x / t`, so values equal torch's bit for bit.
// NaN entries are never selected.
//
// exp here is common.h's exp8 (Cephes' expf, within 2 ulp of torch's), 0 below d = -87.3 where
// float32 turns subnormal (torch's exp gives at most 152k x 1.2e-38
// more there, far below what the clamp of logit(q_max) can see). Sums run in float32 lanes over 256
// entries, then in float64.
//
// The first pass keeps candidates that reach the current threshold in a buffer of 4k; when it fills,
// the k largest are kept and the threshold rises to the k-th of them. Most entries of a row fail one
// vector comparison against the threshold, so the pass costs about one read of the row.

#include "common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Candidate = std::pair<float, int64_t>;

constexpr int64_t kChunks = 4;  // work items per row of scan_rows (fewer for short rows)

inline bool before(const Candidate& a, const Candidate& b) {  // descending value, then ascending index
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The k largest entries of z = x / t (descending, ties in index order) into values / indices.
// Indices count from `offset` (x is a chunk of a row starting there); returns how many entries it
// found (k unless the chunk holds fewer non-NaN entries: the rest of values is -inf). *largest_x gets
// the chunk's largest entry of x (NaN lanes aside) and *any_nan_x whether it holds a NaN.
int64_t top_k_row(const float* x, int64_t v, float t, int64_t k, int64_t offset, float* values, int64_t* indices,
                  float* largest_x, bool* any_nan_x) {
  std::vector<Candidate> keep;
  const size_t capacity = static_cast<size_t>(std::max<int64_t>(4 * k, 64));
  keep.reserve(capacity + 8);
  // An entry joins `keep` where it reaches the threshold. After the first compaction `keep` holds
  // the k first (in `before`'s order) of every entry seen, and the threshold is the k-th of them:
  // an entry that only ties with it comes later in the row than all k, so it can never be among
  // the k, and from then on only entries above the threshold join. Where a row is mostly -inf (a
  // drafter's vocabulary-subset head, models/vocab_subset.py) and a chunk holds fewer than k finite
  // entries, the threshold stays -inf: taking every -inf entry that ties with it made the scan of
  // such a chunk several times the cost of reading it.
  float threshold = -std::numeric_limits<float>::infinity();
  bool compacted = false;
  const __m256 tv = _mm256_set1_ps(t);
  __m256 largest = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  auto compact = [&]() {
    std::nth_element(keep.begin(), keep.begin() + (k - 1), keep.end(), before);
    threshold = keep[k - 1].first;  // the k-th largest so far
    keep.resize(k);
    compacted = true;
  };
  auto joins = [&](float z) { return compacted ? z > threshold : z >= threshold; };
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    largest = _mm256_max_ps(largest, xv);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    const __m256 z = _mm256_div_ps(xv, tv);
    const __m256 thr = _mm256_set1_ps(threshold);
    int mask = _mm256_movemask_ps(compacted ? _mm256_cmp_ps(z, thr, _CMP_GT_OQ) : _mm256_cmp_ps(z, thr, _CMP_GE_OQ));
    if (!mask) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    while (mask) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      keep.emplace_back(lanes[j], offset + i + j);  // the mask's test is joins(lanes[j])
    }
    if (keep.size() >= capacity) compact();
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float top = std::max({lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5], lanes[6], lanes[7]});
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < v; ++i) {
    any_nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
    const float z = x[i] / t;
    if (joins(z)) keep.emplace_back(z, offset + i);
  }
  *largest_x = top;
  *any_nan_x = any_nan;
  if (static_cast<int64_t>(keep.size()) > k) compact();
  std::sort(keep.begin(), keep.end(), before);
  const int64_t found = std::min<int64_t>(static_cast<int64_t>(keep.size()), k);  // < k only where NaN entries were skipped
  for (int64_t j = 0; j < k; ++j) {
    values[j] = j < found ? keep[j].first : -std::numeric_limits<float>::infinity();
    indices[j] = j < found ? keep[j].second : 0;
  }
  return found;
}

// How many entries of z = x / t reach `kth`: a second pass, since entries tied with the k-th value may
// have been dropped when the buffer was compacted.
int64_t count_at_least(const float* x, int64_t v, float t, float kth) {
  const __m256 tv = _mm256_set1_ps(t), kv = _mm256_set1_ps(kth);
  int64_t count = 0, i = 0;
  for (; i + 8 <= v; i += 8)
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), kv, _CMP_GE_OQ)));
  for (; i < v; ++i) count += x[i] / t >= kth;
  return count;
}

// One pass over a chunk of z = x / t for its part of the tail and moment (see the top: every entry
// but index `skip` of the chunk, d = max(z - m, -100)) and how many of its entries reach kth.
void tail_row(const float* x, int64_t v, float t, float m, int64_t skip, float kth, double* tail, double* moment,
              int64_t* at_least) {
  const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m), floor = _mm256_set1_ps(-100.0f), kv = _mm256_set1_ps(kth);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd(), m0 = _mm256_setzero_pd(), m1 = _mm256_setzero_pd();
  // Eight -inf entries add exactly nothing (e = 0, e d = -0, and they do not reach a finite kth):
  // skipped, as most of a vocabulary-subset head's row is (models/vocab_subset.py).
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const bool skip_minus_inf = kth > -std::numeric_limits<float>::infinity();
  int64_t count = 0, i = 0;
  while (i + 8 <= v) {
    __m256 ts = _mm256_setzero_ps(), ms = _mm256_setzero_ps();
    const int64_t end = std::min<int64_t>(v - v % 8, i + 256);
    for (; i < end; i += 8) {
      const __m256 xv = _mm256_loadu_ps(x + i);
      if (skip_minus_inf && _mm256_movemask_ps(_mm256_cmp_ps(xv, minus_inf, _CMP_EQ_OQ)) == 0xFF) continue;
      const __m256 z = _mm256_div_ps(xv, tv);
      count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(z, kv, _CMP_GE_OQ)));
      const __m256 d = _mm256_max_ps(_mm256_sub_ps(z, mv), floor);
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
    const float z = x[i] / t;
    count += z >= kth;
    if (i == skip) continue;
    const float d = std::max(z - m, -100.0f);
    const float e = d >= -87.3f ? std::exp(d) : 0.0f;
    ts += e;
    ms += static_cast<double>(e) * d;
  }
  *tail = ts;
  *moment = ms;
  *at_least = count;
}

// What scan_rows gives (see the top); second, tail and moment are empty without tails.
using Scan = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// scan_rows with each row's temperature at tp[row].
Scan scan(const at::Tensor& x, const float* tp, int64_t k, bool tails) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [N, V] float32 tensor");
  const int64_t n = x.size(0), v = x.size(1);
  TORCH_CHECK(k >= 1 && k <= v, "k must be in [1, V = ", v, "], got ", k);
  TORCH_CHECK(!tails || v >= 2, "the tail sums need V >= 2, got ", v);
  const int64_t found = tails ? std::max<int64_t>(k, 2) : k;  // the tails need the top two
  const int64_t with = tails ? n : 0;
  auto values = at::empty({n, k}, x.options());
  auto indices = at::empty({n, k}, x.options().dtype(at::kLong));
  auto at_least = at::empty({n}, x.options().dtype(at::kLong));
  auto bad = at::empty({n}, x.options().dtype(at::kBool));
  auto second = at::empty({with}, x.options());
  auto tail = at::empty({with}, x.options().dtype(at::kDouble));
  auto moment = at::empty({with}, x.options().dtype(at::kDouble));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  int64_t* cp = at_least.data_ptr<int64_t>();
  bool* bp = bad.data_ptr<bool>();
  float* sp = second.data_ptr<float>();
  double* tailp = tail.data_ptr<double>();
  double* mp = moment.data_ptr<double>();
  // Each row is cut into up to kChunks chunks of a multiple of the tail pass's 256-entry blocks, a cut
  // that depends on V alone (not on the batch or the thread count), so a row's results never depend
  // on them; the threads take the (row, chunk) items one at a time, so even one row keeps every core
  // busy, and a chunk that is mostly -inf (a vocabulary-subset head's high ids) costs its thread
  // little while the other works through a dense one.
  const int64_t chunk = std::max<int64_t>((v + kChunks * 256 - 1) / (kChunks * 256) * 256, 1024);
  const int64_t chunks = (v + chunk - 1) / chunk, items = n * chunks;
  auto span = [&](int64_t c) { return std::make_pair(c * chunk, std::min(v, (c + 1) * chunk)); };
  std::vector<float> chunk_values(items * found), chunk_largest(items);
  std::vector<int64_t> chunk_indices(items * found), chunk_found(items);
  std::vector<char> chunk_nan(items);
  auto temperature_of = [&](int64_t r) { return tp[r] > 0.0f ? tp[r] : 1.0f; };
  specav_native::parallel_chunks(items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks;
      const auto [lo, hi] = span(item % chunks);
      bool nan = false;
      chunk_found[item] = top_k_row(xp + r * v + lo, hi - lo, temperature_of(r), found, lo, chunk_values.data() + item * found,
                                    chunk_indices.data() + item * found, chunk_largest.data() + item, &nan);
      chunk_nan[item] = nan;
    }
  });
  std::vector<float> top_values(n * found);
  std::vector<int64_t> top_indices(n * found);
  for (int64_t r = 0; r < n; ++r) {  // merge the chunks' top k: each holds the row's top k within it
    std::vector<Candidate> keep;
    bool nan = false;
    float largest = -std::numeric_limits<float>::infinity();
    for (int64_t item = r * chunks; item < (r + 1) * chunks; ++item) {
      for (int64_t j = 0; j < chunk_found[item]; ++j)
        keep.emplace_back(chunk_values[item * found + j], chunk_indices[item * found + j]);
      nan |= chunk_nan[item] != 0;
      largest = std::max(largest, chunk_largest[item]);
    }
    const int64_t have = std::min<int64_t>(static_cast<int64_t>(keep.size()), found);
    std::partial_sort(keep.begin(), keep.begin() + have, keep.end(), before);
    for (int64_t j = 0; j < found; ++j) {
      top_values[r * found + j] = j < have ? keep[j].first : -std::numeric_limits<float>::infinity();
      top_indices[r * found + j] = j < have ? keep[j].second : 0;
    }
    std::copy_n(top_values.data() + r * found, k, vp + r * k);
    std::copy_n(top_indices.data() + r * found, k, ip + r * k);
    bp[r] = nan || !std::isfinite(largest);
  }
  std::vector<double> chunk_tail(items, 0.0), chunk_moment(items, 0.0);
  std::vector<int64_t> chunk_count(items, 0);
  specav_native::parallel_chunks(items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks;
      if (bp[r]) continue;  // no distribution: the caller refuses the row, nothing more to compute
      const auto [lo, hi] = span(item % chunks);
      const float* row = xp + r * v;
      const float kth = top_values[r * found + k - 1];
      if (tails)
        tail_row(row + lo, hi - lo, temperature_of(r), top_values[r * found], top_indices[r * found] - lo, kth,
                 &chunk_tail[item], &chunk_moment[item], &chunk_count[item]);
      else
        chunk_count[item] = count_at_least(row + lo, hi - lo, temperature_of(r), kth);
    }
  });
  for (int64_t r = 0; r < n; ++r) {
    double tail_sum = 0.0, moment_sum = 0.0;
    int64_t count = 0;
    for (int64_t item = r * chunks; item < (r + 1) * chunks; ++item) {
      tail_sum += chunk_tail[item];
      moment_sum += chunk_moment[item];
      count += chunk_count[item];
    }
    cp[r] = bp[r] ? 0 : count;
    if (tails) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      sp[r] = bp[r] ? nan : top_values[r * found + 1];
      tailp[r] = bp[r] ? nan : tail_sum;
      mp[r] = bp[r] ? nan : moment_sum;
    }
  }
  return {values, indices, at_least, bad, second, tail, moment};
}

Scan scan_rows(const at::Tensor& x, const at::Tensor& temperature, int64_t k, bool tails) {
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == x.size(0) && temperature.scalar_type() == at::kFloat,
              "temperature must be a float32 vector of one value per row");
  const at::Tensor t = temperature.contiguous();
  return scan(x, t.data_ptr<float>(), k, tails);
}

// processed probabilities of top-k candidates (topk.torch_candidate_probs is the reference): softmax over a row's k values, then the nucleus (the smallest prefix whose mass
// before the last token is < top_p, at least one token, plus every token tied with its last), then
// the row sorted by token id.
void candidate_row(const float* values, const int64_t* indices, int64_t k, double top_p, float* probs, int64_t* ids) {
  std::vector<float> p(k);
  const float m = values[0];
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += p[j] = std::exp(values[j] - m);
  for (int64_t j = 0; j < k; ++j) p[j] /= total;
  if (top_p < 1.0) {
    double cumulative = 0.0;
    int64_t kept = 0;
    for (int64_t j = 0; j < k; ++j) {  // as nucleus_in_sorted: a float64 running sum, less the entry
      cumulative += static_cast<double>(p[j]);
      kept += cumulative - static_cast<double>(p[j]) < top_p;  // the mass strictly above rank j
    }
    const float boundary = p[std::max<int64_t>(kept, 1) - 1];
    float sub = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      if (!(p[j] >= boundary && p[j] > 0.0f)) p[j] = 0.0f;
      sub += p[j];
    }
    for (int64_t j = 0; j < k; ++j) p[j] /= sub;
  }
  std::vector<int64_t> order(k);
  for (int64_t j = 0; j < k; ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return indices[a] < indices[b]; });
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = indices[order[j]];
    probs[j] = p[order[j]];
  }
}

std::tuple<at::Tensor, at::Tensor> candidate_probs(const at::Tensor& values, const at::Tensor& indices, const at::Tensor& top_p) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat && values.is_contiguous(), "values must be a contiguous [N, k] float32 tensor");
  TORCH_CHECK(indices.sizes() == values.sizes() && indices.scalar_type() == at::kLong && indices.is_contiguous(), "indices must be [N, k] int64 like values");
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == values.size(0) && top_p.scalar_type() == at::kFloat, "top_p must be a float32 vector of one value per row");
  const int64_t n = values.size(0), k = values.size(1);
  TORCH_CHECK(k >= 1, "candidate_probs needs k >= 1");
  auto probs = at::empty({n, k}, values.options());
  auto ids = at::empty({n, k}, indices.options());
  const at::Tensor tp = top_p.contiguous();
  for (int64_t r = 0; r < n; ++r)
    candidate_row(values.data_ptr<float>() + r * k, indices.data_ptr<int64_t>() + r * k, k, static_cast<double>(tp.data_ptr<float>()[r]),
                  probs.data_ptr<float>() + r * k, ids.data_ptr<int64_t>() + r * k);
  return {ids, probs};
}

// Rows sharing top-k = k in one call: scan_rows (with tails where asked), candidate_probs of each
// row's k largest and, where uniforms are given (in [0, 1), one per row), one token per row drawn
// from them: what sampling.distributions(_and_tails), then sampling.sample, give for such rows. The
// rows' parameters come as lists (building tensors of them cost more than the rest of a slot's glue):
// temperature and top_p are rounded to float32 first, as the tensors of the general path hold them.
//   draw_top_k(x, temperature, k, top_p, uniforms) -> (ids, probs, tokens, ok, gap, tail, moment)
//   top_k_probs(x, temperature, k, top_p) -> (ids, probs, ok)
// ids / probs # [N, k] as candidate_probs gives them, tokens # [N] int64, tail / moment as scan_rows
// gives them and gap # [N] its second largest less the largest (topk.Tails.gap, float32); ok # [N]
// bool is false where the row has no distribution or its k-th value ties with entries beyond k (the
// caller takes the general path: that row's other outputs mean nothing).
using TopKRows = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

TopKRows top_k_rows(const at::Tensor& x, at::ArrayRef<double> temperature, int64_t k, at::ArrayRef<double> top_p,
                    const at::ArrayRef<double>* uniforms, bool tails) {
  const int64_t n = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(temperature.size()) == n && static_cast<int64_t>(top_p.size()) == n,
              "temperature and top_p need one value per row");
  TORCH_CHECK(!uniforms || static_cast<int64_t>(uniforms->size()) == n, "uniforms need one value per row");
  std::vector<float> t(n);
  for (int64_t r = 0; r < n; ++r) t[r] = static_cast<float>(temperature[r]);
  const auto [values, indices, at_least, bad, second, tail, moment] = scan(x, t.data(), k, tails);
  // Filled row by row below (no ATen op is dispatched: each costs tens of microseconds with the
  // caches cold after a forward, more than this whole loop).
  auto probs = at::empty({n, k}, x.options());
  auto ids = at::empty({n, k}, x.options().dtype(at::kLong));
  auto tokens = at::empty({uniforms ? n : 0}, x.options().dtype(at::kLong));
  auto ok = at::empty({n}, x.options().dtype(at::kBool));
  auto gap = at::empty({tails ? n : 0}, x.options());
  for (int64_t r = 0; r < n; ++r) {
    float* pr = probs.data_ptr<float>() + r * k;
    int64_t* ir = ids.data_ptr<int64_t>() + r * k;
    const float* vr = values.data_ptr<float>() + r * k;
    const bool good = !bad.data_ptr<bool>()[r] && at_least.data_ptr<int64_t>()[r] == k;
    ok.data_ptr<bool>()[r] = good;
    if (tails) gap.data_ptr<float>()[r] = second.data_ptr<float>()[r] - vr[0];
    if (!good) {
      std::fill_n(pr, k, 0.0f);
      std::fill_n(ir, k, int64_t{0});
      if (uniforms) tokens.data_ptr<int64_t>()[r] = -1;
      continue;
    }
    candidate_row(vr, indices.data_ptr<int64_t>() + r * k, k, static_cast<double>(static_cast<float>(top_p[r])), pr, ir);
    if (uniforms) tokens.data_ptr<int64_t>()[r] = ir[specav_native::inverse_cdf(pr, k, (*uniforms)[r])];
  }
  return {ids, probs, tokens, ok, gap, tail, moment};
}

TopKRows draw_top_k(const at::Tensor& x, at::ArrayRef<double> temperature, int64_t k, at::ArrayRef<double> top_p,
                    at::ArrayRef<double> uniforms) {
  return top_k_rows(x, temperature, k, top_p, &uniforms, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_k_probs(const at::Tensor& x, at::ArrayRef<double> temperature, int64_t k,
                                                           at::ArrayRef<double> top_p) {
  const auto rows = top_k_rows(x, temperature, k, top_p, nullptr, false);
  return {std::get<0>(rows), std::get<1>(rows), std::get<3>(rows)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> top_two_tail(const at::Tensor& z) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.is_contiguous(), "z must be a contiguous [N, V] float32 tensor");
  const auto scan = scan_rows(z, at::ones({z.size(0)}, z.options()), 2, true);
  return {std::get<0>(scan), std::get<1>(scan), std::get<5>(scan), std::get<6>(scan)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_top_k(const at::Tensor& x, const at::Tensor& temperature, int64_t k) {
  const auto scan = scan_rows(x, temperature, k, false);
  return {std::get<0>(scan), std::get<1>(scan), std::get<2>(scan)};
}

}  // namespace

SPECAV_FRAGMENT(m) {
  m.def("scaled_top_k(Tensor x, Tensor temperature, int k) -> (Tensor, Tensor, Tensor)");
  m.def("top_two_tail(Tensor z) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("candidate_probs(Tensor values, Tensor indices, Tensor top_p) -> (Tensor, Tensor)");
  m.def("scan_rows(Tensor x, Tensor temperature, int k, bool tails) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("draw_top_k(Tensor x, float[] temperature, int k, float[] top_p, float[] uniforms) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("top_k_probs(Tensor x, float[] temperature, int k, float[] top_p) -> (Tensor, Tensor, Tensor)");
}

SPECAV_IMPL(m) {
  m.impl("scaled_top_k", &scaled_top_k);
  m.impl("top_two_tail", &top_two_tail);
  m.impl("scan_rows", &scan_rows);
  m.impl("candidate_probs", &candidate_probs);
  m.impl("draw_top_k", &draw_top_k);
  m.impl("top_k_probs", &top_k_probs);
}
