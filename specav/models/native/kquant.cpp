// AVX2 matmul on GGUF k-quant blocks as stored: y = x @ W^T (+ bias) with W in Q4_K or Q6_K.
//
// Decoding one token reads every weight once, so on a CPU it is memory-bound: the kernel
// reads the file's 4.5 (Q4_K) or 6.6 (Q6_K) bits per weight instead of torch's int8 or
// bf16. Weights keep their exact codes and scales; each activation row is quantised to
// int8 with one float scale per 256 elements (round to nearest, scale = max|x| / 127),
// and the dot products run in integers:
//
//   Q4_K, sub-block j of 32:  w = d * sc_j * q - dmin * m_j        (q in 0..15)
//     sum_i w_i x_i ~= dx * (d * sum_j sc_j * sum_i q_i xq_i  -  dmin * sum_j m_j * sum_i xq_i)
//   Q6_K, sub-block j of 16:  w = d * sc_j * (q - 32)              (q in 0..63, sc_j int8)
//     sum_i w_i x_i ~= dx * d * sum_j sc_j * (sum_i q_i xq_i  -  32 * sum_i xq_i)
//
// Integer ranges: _mm256_maddubs_epi16 adds two u8 x s8 products into int16: Q4_K
// 2 * 15 * 127 and Q6_K 2 * 63 * 127 = 16002 < 32767, so nothing saturates; the int32
// sums per 256-block stay below 2^26 and are converted to float once per block.
//
// The Python side (specav/models/quant_kernels.py, KQuantWeight) unpacks the 6-bit Q4_K
// scales and the float16 super-block scales once at load; the codes stay as the file
// lays them out. Rows of x are processed in tiles of up to 4, so each weight block is
// loaded once per tile. Work is split over output features with at::parallel_for
// (torch's intra-op threads). Every output depends only on its own row of x: the
// kernel is batch-invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

using specav_native::hsum;

constexpr int64_t kBlock = 256;  // super-block: one activation scale, one d (and dmin)
constexpr int kTile = 4;         // rows of x per pass over a weight row

// Word i of each 128-bit lane of v, repeated across that lane (i: 0..7, a compile-time constant
// once the loops are unrolled). `lo_word`/`hi_word` pick per lane: low lane word lo, high lane hi.
inline __m256i broadcast_words(__m256i v, int lo_word, int hi_word) {
  const __m128i lo = _mm_set1_epi16(static_cast<short>((2 * lo_word) | ((2 * lo_word + 1) << 8)));
  const __m128i hi = _mm_set1_epi16(static_cast<short>((2 * hi_word) | ((2 * hi_word + 1) << 8)));
  return _mm256_shuffle_epi8(v, _mm256_setr_m128i(lo, hi));
}

// Activations of T rows, quantised: xq [T, K] int8, dx [T, K/256] scales, sum16 [T, K/16] int16
// (sums of 16 codes, |sum| <= 2032), for the min / offset terms of the dot products.
struct QuantizedRows {
  at::Tensor xq, dx, sum16;
};

QuantizedRows quantize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  auto xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, blocks}, x.options());
  auto sum16 = at::empty({rows, k / 16}, x.options().dtype(at::kShort));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  int16_t* sp = sum16.data_ptr<int16_t>();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, rows * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb) {
      const float* src = xp + rb * kBlock;  // rows are contiguous, so (row, block) is rb * 256
      int8_t* dst = qp + rb * kBlock;
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < kBlock; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.0f;
      dp[rb] = d;
      const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      for (int i = 0; i < kBlock; i += 32) {
        __m256i a[4];
        for (int j = 0; j < 4; ++j)  // round to nearest even (the default MXCSR mode)
          a[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * j), inv));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(packed, order));
      }
      int16_t* sums = sp + rb * (kBlock / 16);
      for (int g = 0; g < kBlock / 16; ++g) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += dst[16 * g + i];
        sums[g] = static_cast<int16_t>(s);
      }
    }
  });
  return {xq, dx, sum16};
}

void check_inputs(const at::Tensor& x, const at::Tensor& codes, int64_t code_bytes_per_block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous [T, K] float32 tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 256, got ", x.size(1));
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(1) == x.size(1) / kBlock &&
              codes.size(2) == code_bytes_per_block, "weight codes must be [N, K/256, ", code_bytes_per_block, "]");
}

// One weight row (nb super-blocks) against a tile of R activation rows.
template <int R>
void q4k_row(const uint8_t* qs, const uint8_t* sc, const uint8_t* mn, const float* d, const float* dmin,
             int64_t nb, const int8_t* xq, const float* dx, const int16_t* sum16, int64_t k, float* out, int64_t n_out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    // The 8 sub-block scales as int16, in both 128-bit lanes.
    const __m256i scales = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * 8))));
    for (int c = 0; c < 4; ++c) {  // 32 bytes = 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * 128 + c * 32));
      const __m256i lo = _mm256_and_si256(bytes, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i s_lo = broadcast_words(scales, 2 * c, 2 * c);
      const __m256i s_hi = broadcast_words(scales, 2 * c + 1, 2 * c + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * k + b * kBlock + c * 64;
        const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr)));
        const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32)));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi)));
      }
    }
    // The mins, each twice (m0 m0 m1 m1 ... m7 m7), against the 16 sums of 16 codes: lane j of
    // madd is m_j * (sum of sub-block j's 32 codes).
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + b * 8));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    for (int r = 0; r < R; ++r) {
      const float xd = dx[r * nb + b];
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum16 + r * (k / 16) + b * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * xd), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin[b] * xd), _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, mins)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * n_out] = hsum(acc[r]);
}

template <int R>
void q6k_row(const uint8_t* ql, const uint8_t* qh, const int8_t* sc, const float* d,
             int64_t nb, const int8_t* xq, const float* dx, const int16_t* sum16, int64_t k, float* out, int64_t n_out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    // The 16 scales as int16: scales 0-7 in both lanes of halves[0], 8-15 in both lanes of halves[1].
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 16)));
    const __m256i halves[2] = {_mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
    for (int half = 0; half < 2; ++half) {  // 128 elements: ql 64 bytes, qh 32 bytes, 8 scales
      const uint8_t* l = ql + b * 128 + half * 64;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 64 + half * 32));
      // Elements 0-31, 32-63, 64-95, 96-127 of this half; the 2 high bits come from h's bit pairs.
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(h, two), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4)),
      };
      for (int part = 0; part < 4; ++part) {  // elements part*32 .. +31: scale 2 part (first 16), 2 part + 1
        const __m256i scale = broadcast_words(halves[half], 2 * part, 2 * part + 1);
        for (int r = 0; r < R; ++r) {
          const int64_t first = b * kBlock + half * 128 + part * 32;
          const __m256i p = _mm256_maddubs_epi16(q[part], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + first)));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // the -32 of every code: 32 * sum_j sc_j * (sum of sub-block j's codes)
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum16 + r * (k / 16) + b * 16));
      const float scale = d[b] * dx[r * nb + b];
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(32.0f * scale), _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, all)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * n_out] = hsum(acc[r]);
}

// Calls fn(std::integral_constant<int, R>) with R = tile (1..kTile), so row kernels get R at compile time.
template <typename Fn>
void with_tile(int64_t tile, const Fn& fn) {
  switch (tile) {
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    default: fn(std::integral_constant<int, 1>{});
  }
}

// Runs `row_kernel<R>` for every output feature and every tile of rows, split over features,
// then adds the bias (if any) to each output.
template <typename RowFn>
at::Tensor run_tiles(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias, const RowFn& row_fn) {
  const int64_t rows = x.size(0);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous()),
              "bias must be a contiguous float32 vector of the output features");
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // one weight row from memory, then every tile of x against it
      for (int64_t first = 0; first < rows; first += kTile)
        row_fn(i, first, std::min<int64_t>(kTile, rows - first), yp + first * n + i);
      if (bp)
        for (int64_t r = 0; r < rows; ++r) yp[r * n + i] += bp[i];
    }
  });
  return y;
}

at::Tensor q4k_matmul(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sc, const at::Tensor& mn,
                      const at::Tensor& d, const at::Tensor& dmin, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qs, 128);
  const int64_t n = qs.size(0), nb = qs.size(1), k = x.size(1);
  TORCH_CHECK(sc.sizes() == at::IntArrayRef({n, nb, 8}) && mn.sizes() == sc.sizes() && d.sizes() == at::IntArrayRef({n, nb}) &&
              dmin.sizes() == d.sizes() && sc.scalar_type() == at::kByte && mn.scalar_type() == at::kByte &&
              d.scalar_type() == at::kFloat && dmin.scalar_type() == at::kFloat &&
              sc.is_contiguous() && mn.is_contiguous() && d.is_contiguous() && dmin.is_contiguous(),
              "Q4_K scales must be sc, mn [N, K/256, 8] uint8 and d, dmin [N, K/256] float32, contiguous");
  const QuantizedRows a = quantize_rows(x);
  const uint8_t *qp = qs.data_ptr<uint8_t>(), *sp = sc.data_ptr<uint8_t>(), *mp = mn.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp2 = dmin.data_ptr<float>(), *xd = a.dx.data_ptr<float>();
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const int16_t* s16 = a.sum16.data_ptr<int16_t>();
  return run_tiles(x, n, bias, [&](int64_t i, int64_t first, int64_t tile, float* out) {
    const uint8_t *q = qp + i * nb * 128, *s = sp + i * nb * 8, *m = mp + i * nb * 8;
    const float *di = dp + i * nb, *mi = mp2 + i * nb;
    const int8_t* xr = xq + first * k;
    const float* dr = xd + first * nb;
    const int16_t* sr = s16 + first * (k / 16);
    with_tile(tile, [&](auto r) { q4k_row<decltype(r)::value>(q, s, m, di, mi, nb, xr, dr, sr, k, out, n); });
  });
}

at::Tensor q6k_matmul(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                      const at::Tensor& d, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, ql, 128);
  const int64_t n = ql.size(0), nb = ql.size(1), k = x.size(1);
  TORCH_CHECK(qh.sizes() == at::IntArrayRef({n, nb, 64}) && sc.sizes() == at::IntArrayRef({n, nb, 16}) &&
              d.sizes() == at::IntArrayRef({n, nb}) && qh.scalar_type() == at::kByte && sc.scalar_type() == at::kChar &&
              d.scalar_type() == at::kFloat && qh.is_contiguous() && sc.is_contiguous() && d.is_contiguous(),
              "Q6_K parts must be qh [N, K/256, 64] uint8, sc [N, K/256, 16] int8, d [N, K/256] float32, contiguous");
  const QuantizedRows a = quantize_rows(x);
  const uint8_t *lp = ql.data_ptr<uint8_t>(), *hp = qh.data_ptr<uint8_t>();
  const int8_t* sp = sc.data_ptr<int8_t>();
  const float *dp = d.data_ptr<float>(), *xd = a.dx.data_ptr<float>();
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const int16_t* s16 = a.sum16.data_ptr<int16_t>();
  return run_tiles(x, n, bias, [&](int64_t i, int64_t first, int64_t tile, float* out) {
    const uint8_t *l = lp + i * nb * 128, *h = hp + i * nb * 64;
    const int8_t* s = sp + i * nb * 16;
    const float* di = dp + i * nb;
    const int8_t* xr = xq + first * k;
    const float* dr = xd + first * nb;
    const int16_t* sr = s16 + first * (k / 16);
    with_tile(tile, [&](auto r) { q6k_row<decltype(r)::value>(l, h, s, di, nb, xr, dr, sr, k, out, n); });
  });
}

// The activation quantisation alone, so tests can rebuild the kernel's arithmetic exactly.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be a contiguous [T, K] float32 tensor with K a multiple of 256");
  QuantizedRows a = quantize_rows(x);
  return {a.xq, a.dx};
}

}  // namespace

TORCH_LIBRARY(specav_kquant, m) {
  m.def("q4k_matmul(Tensor x, Tensor qs, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias=None) -> Tensor");
  m.def("q6k_matmul(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias=None) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specav_kquant, CPU, m) {
  m.impl("q4k_matmul", &q4k_matmul);
  m.impl("q6k_matmul", &q6k_matmul);
  m.impl("quantize_activations", &quantize_activations);
}
