// Helpers shared by the native kernels (kquant.cpp, quantize.cpp, layers.cpp, decoder.cpp, topk.cpp,
// rejection.cpp), for every variant.
//
// Each variant (native/variants.py) compiles the same sources with its own instruction-set flags
// and its own op namespace, -DSPECAV_NS=<namespace>, so several variants can be loaded into one
// process side by side (the tests run each against the float64 emulation).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifndef SPECAV_NS
#error "build with -DSPECAV_NS=<the op namespace of this variant>"
#endif
// One more level of macros, so SPECAV_NS is expanded before torch's macros paste it.
#define SPECAV_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define SPECAV_FRAGMENT(m) SPECAV_FRAGMENT_(SPECAV_NS, m)
#define SPECAV_IMPL_(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define SPECAV_IMPL(m) SPECAV_IMPL_(SPECAV_NS, m)

namespace specav_native {

// The sum of a vector's 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x, 8 lanes, relative error ~2e-7 (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6
// polynomial, times 2^n). Inputs are clamped to [-87.3, 88.3], where 2^n and e^x stay normal floats.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 split in two: exact first product
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(pow2));
}

// Inverse CDF over w non-negative weights (verification/sampling.py's `sample` of candidate rows):
// the first index whose float64 running sum exceeds u * total (u in [0, 1)); where u * total rounds
// up to the total, the last index with weight. The total must be positive.
inline int64_t inverse_cdf(const float* weights, int64_t w, double u) {
  double total = 0.0;
  for (int64_t j = 0; j < w; ++j) total += static_cast<double>(weights[j]);
  const double threshold = u * total;
  double sum = 0.0;
  for (int64_t j = 0; j < w; ++j)
    if ((sum += static_cast<double>(weights[j])) > threshold) return j;
  for (int64_t j = w - 1; j > 0; --j)
    if (weights[j] > 0.0f) return j;
  return 0;
}

inline float f16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Runs fn(begin, end) over [0, n) in chunks of `chunk` items that torch's intra-op threads take one
// at a time (dynamic schedule): a thread slowed by another process on its core takes fewer chunks
// instead of holding the others at the end of a static split. fn must not throw.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, const Fn& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), chunks));
  if (threads <= 1 || omp_in_parallel()) {
    for (int64_t c = 0; c < chunks; ++c) fn(c * chunk, std::min(n, (c + 1) * chunk));
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) fn(c * chunk, std::min(n, (c + 1) * chunk));
}

// Runs fn(begin, end) over [0, n) with each of torch's intra-op threads taking one contiguous run:
// for work that streams memory (a weight matrix at one activation row), where a long sequential
// run per thread keeps the hardware prefetcher ahead and chunks taken one at a time did not
// (two threads at 1.1x one thread's speed on the AMD EPYC, contiguous runs 1.5x). A thread slowed
// by another process holds the others; ThreadChoice (threads.py) then moves to fewer threads.
template <typename Fn>
void parallel_runs(int64_t n, const Fn& fn) {
  const int64_t threads = std::max(at::get_num_threads(), 1);
  parallel_chunks(n, (n + threads - 1) / threads, fn);
}

}  // namespace specav_native
