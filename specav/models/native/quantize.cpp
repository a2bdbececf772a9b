// Float weights -> Q4_K blocks, for weights whose file format no native kernel runs (the drafter's
// Q5_0 / Q8_0 tensors, requantised at load: drafter precision never touches losslessness).
//
// llama.cpp's reference quantiser (quantize_row_q4_K_ref with make_qkx2_quants): per 32-element
// sub-block, a scale and a min fitted by weighted least squares over 21 candidate scales (weights
// |x| + rms of the sub-block), then the 8 scales and mins of a super-block quantised to 6 bits
// against float16 super-scales d and dmin, and the codes recomputed from those. Plain scalar code:
// it runs once per load, split over rows.

#include "common.h"

#include <cmath>

namespace {

constexpr int kBlock = 256;

inline int nearest_int(float f) { return static_cast<int>(std::lrintf(f)); }

// Fits x ~ scale * L + min (L in 0..nmax, min <= 0) for one sub-block; returns scale, sets -min.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    sum_w += weights[i];
    sum_x += weights[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + n, 0);
    *the_min = -min;
    return 0.0f;
  }
  float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min)))));
    const float diff = scale * L[i] + min - x[i];
    best += weights[i] * diff * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      Laux[i] = static_cast<uint8_t>(l);
      sum_l += weights[i] * l;
      sum_l2 += weights[i] * l * l;
      sum_xl += weights[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float err = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * Laux[i] + this_min - x[i];
        err += weights[i] * diff * diff;
      }
      if (err < best) {
        std::copy(Laux, Laux + n, L);
        best = err;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One 256-element block -> 144 bytes: d f16, dmin f16, 12 bytes of 6-bit scales/mins, 128 of nibbles.
void quantize_block_q4k(const float* x, uint8_t* out) {
  uint8_t L[kBlock], Laux[32];
  float weights[32], mins[8], scales[8], max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.0f, 0.1f, 20);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  uint8_t packed[12] = {0};
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = static_cast<uint8_t>(std::min(63, nearest_int(inv_scale * scales[j])));
    const uint8_t lm = static_cast<uint8_t>(std::min(63, nearest_int(inv_min * mins[j])));
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
      packed[j - 4] |= ((ls >> 4) << 6);
      packed[j] |= ((lm >> 4) << 6);
    }
  }
  const uint16_t d16 = _cvtss_sh(max_scale / 63.0f, 0), dmin16 = _cvtss_sh(max_min / 63.0f, 0);
  const float d = _cvtsh_ss(d16), dmin = _cvtsh_ss(dmin16);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, packed, &sc, &m);
    const float ds = d * sc;
    if (ds == 0.0f) continue;  // L keeps the sub-block's fitted codes (as llama.cpp does)
    const float dm = dmin * m;
    for (int i = 0; i < 32; ++i)
      L[32 * j + i] = static_cast<uint8_t>(std::max(0, std::min(15, nearest_int((x[32 * j + i] + dm) / ds))));
  }
  std::memcpy(out, &d16, 2);
  std::memcpy(out + 2, &dmin16, 2);
  std::memcpy(out + 4, packed, 12);
  uint8_t* q = out + 16;
  for (int j = 0; j < kBlock; j += 64, q += 32)  // 32 bytes: sub-block j/32 in the low nibbles, the next in the high
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
}

// w [N, K] float32, K a multiple of 256 -> [N, K / 256 * 144] uint8 Q4_K blocks.
at::Tensor quantize_q4_k(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) % kBlock == 0,
              "w must be a contiguous [N, K] float32 tensor with K a multiple of 256");
  const int64_t n = w.size(0), nb = w.size(1) / kBlock;
  auto out = at::empty({n, nb * 144}, w.options().dtype(at::kByte));
  const float* wp = w.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  specav_native::parallel_chunks(n * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_block_q4k(wp + i * kBlock, op + i * 144);
  });
  return out;
}

}  // namespace

SPECAV_FRAGMENT(m) { m.def("quantize_q4_k(Tensor w) -> Tensor"); }

SPECAV_IMPL(m) { m.impl("quantize_q4_k", &quantize_q4_k); }
