// Float weights -> Q4_K blocks, for weights whose file format no native kernel runs (the drafter's
// Q5_0 / Q8_0 tensors, requantised at load: drafter precision never touches losslessness).
//
// llama.cpp's reference quantiser (quantize_row_q4_K_ref with make_qkx2_quants): per 32-element
// sub-block, a scale and a min fitted by weighted least squares over 21 candidate scales (weights
// |x| + rms of the sub-block), then the 8 scales and mins of a super-block quantised to 6 bits
// against float16 super-scales d and dmin, and the codes recomputed from those. The fit runs on
// 16 sub-blocks at once (two super-blocks, one per vector lane), split over threads: it runs at
// every load of a drafter (about 400 M weights).

#include "common.h"

#include <cmath>

namespace {

constexpr int kBlock = 256;

// Round to nearest, ties to even, for |f| < 2^22 (llama.cpp's trick: no libm call, so loops vectorise).
inline int nearest_int(float f) {
  const float v = f + 12582912.0f;  // 1.5 * 2^23: the integer lands in the low mantissa bits
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

constexpr int kLanes = 16;  // sub-blocks fitted together, one per vector lane (two super-blocks)

// Fits x ~ scale * L + min (L in 0..nmax, min <= 0) for kLanes sub-blocks of 32 at once (x[i][s]:
// element i of sub-block s, weights w likewise), as llama.cpp's make_qkx2_quants does for one: the
// min/max start, then nstep + 1 candidate scales, each refined by weighted least squares, keeping
// the best. Loops run over the lanes innermost, so the compiler vectorises them.
void make_qkx2_quants(const float (*x)[kLanes], const float (*w)[kLanes], int nmax, float rmin, float rdelta,
                      int nstep, uint8_t (*L)[kLanes], float* scale_out, float* min_out) {
  float mn[kLanes], mx[kLanes], sum_w[kLanes], sum_x[kLanes], range[kLanes], scale[kLanes], best[kLanes];
  for (int s = 0; s < kLanes; ++s) {
    mn[s] = mx[s] = x[0][s];
    sum_w[s] = w[0][s];
    sum_x[s] = w[0][s] * x[0][s];
  }
  for (int i = 1; i < 32; ++i)
    for (int s = 0; s < kLanes; ++s) {
      mn[s] = std::min(mn[s], x[i][s]);
      mx[s] = std::max(mx[s], x[i][s]);
      sum_w[s] += w[i][s];
      sum_x[s] += w[i][s] * x[i][s];
    }
  for (int s = 0; s < kLanes; ++s) {
    mn[s] = std::min(mn[s], 0.0f);
    range[s] = mx[s] > mn[s] ? mx[s] - mn[s] : 1.0f;  // a constant sub-block (mx == mn) is handled at the end
    scale[s] = range[s] / nmax;
    best[s] = 0;
  }
  const float top = static_cast<float>(nmax);
  float codes[32][kLanes], aux[32][kLanes];  // codes as floats (exact small integers): the loops stay in float lanes
  for (int i = 0; i < 32; ++i)
    for (int s = 0; s < kLanes; ++s) {
      const float l = std::min(top, std::max(0.0f, __builtin_rintf(top / range[s] * (x[i][s] - mn[s]))));
      codes[i][s] = l;
      const float diff = scale[s] * l + mn[s] - x[i][s];
      best[s] += w[i][s] * diff * diff;
    }
  for (int is = 0; is <= nstep; ++is) {
    float iscale[kLanes], sum_l[kLanes] = {}, sum_l2[kLanes] = {}, sum_xl[kLanes] = {};
    for (int s = 0; s < kLanes; ++s) iscale[s] = (rmin + rdelta * is + nmax) / range[s];
    for (int i = 0; i < 32; ++i)
      for (int s = 0; s < kLanes; ++s) {
        const float l = std::min(top, std::max(0.0f, __builtin_rintf(iscale[s] * (x[i][s] - mn[s]))));
        aux[i][s] = l;
        sum_l[s] += w[i][s] * l;
        sum_l2[s] += w[i][s] * l * l;
        sum_xl[s] += w[i][s] * l * x[i][s];
      }
    float this_scale[kLanes], this_min[kLanes], err[kLanes] = {};
    bool valid[kLanes];
    for (int s = 0; s < kLanes; ++s) {
      const float D = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s];
      valid[s] = D > 0;
      const float Dv = valid[s] ? D : 1.0f;
      this_scale[s] = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / Dv;
      this_min[s] = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / Dv;
      if (this_min[s] > 0) {
        this_min[s] = 0;
        this_scale[s] = sum_l2[s] > 0 ? sum_xl[s] / sum_l2[s] : 0.0f;
      }
    }
    for (int i = 0; i < 32; ++i)
      for (int s = 0; s < kLanes; ++s) {
        const float diff = this_scale[s] * aux[i][s] + this_min[s] - x[i][s];
        err[s] += w[i][s] * diff * diff;
      }
    bool better[kLanes];
    for (int s = 0; s < kLanes; ++s) {
      better[s] = valid[s] && err[s] < best[s];
      best[s] = better[s] ? err[s] : best[s];
      scale[s] = better[s] ? this_scale[s] : scale[s];
      mn[s] = better[s] ? this_min[s] : mn[s];
    }
    for (int i = 0; i < 32; ++i)
      for (int s = 0; s < kLanes; ++s) codes[i][s] = better[s] ? aux[i][s] : codes[i][s];
  }
  for (int i = 0; i < 32; ++i)
    for (int s = 0; s < kLanes; ++s) L[i][s] = static_cast<uint8_t>(codes[i][s]);
  for (int s = 0; s < kLanes; ++s) {  // constant sub-blocks (max == min) are the caller's to fix
    scale_out[s] = scale[s];
    min_out[s] = -mn[s];
  }
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

// Two 256-element blocks (x: 512 floats) -> 2 x 144 bytes: d f16, dmin f16, 12 bytes of 6-bit
// scales and mins, 128 bytes of nibbles each.
void quantize_blocks_q4k(const float* x, uint8_t* out) {
  float xs[32][kLanes], ws[32][kLanes], scales[kLanes], mins[kLanes];
  uint8_t fitted[32][kLanes];
  bool constant[kLanes];
  for (int s = 0; s < kLanes; ++s) {  // lane s: sub-block s (of 32 elements) of the two blocks
    float sum_x2 = 0, lo = x[32 * s], hi = x[32 * s];
    for (int i = 0; i < 32; ++i) {
      sum_x2 += x[32 * s + i] * x[32 * s + i];
      lo = std::min(lo, x[32 * s + i]);
      hi = std::max(hi, x[32 * s + i]);
    }
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int i = 0; i < 32; ++i) {
      xs[i][s] = x[32 * s + i];
      ws[i][s] = av_x + std::fabs(x[32 * s + i]);
    }
    constant[s] = hi == std::min(lo, 0.0f);  // max == min after min is clamped to <= 0
  }
  make_qkx2_quants(xs, ws, 15, -1.0f, 0.1f, 20, fitted, scales, mins);
  for (int s = 0; s < kLanes; ++s)
    if (constant[s]) {  // llama.cpp: every code 0, scale 0, min the (non-positive) value itself
      scales[s] = 0.0f;
      mins[s] = -std::min(x[32 * s], 0.0f);
      for (int i = 0; i < 32; ++i) fitted[i][s] = 0;
    }
  for (int blk = 0; blk < 2; ++blk) {
    const float* xb = x + 256 * blk;
    uint8_t* o = out + 144 * blk;
    uint8_t L[kBlock];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      max_scale = std::max(max_scale, scales[8 * blk + j]);
      max_min = std::max(max_min, mins[8 * blk + j]);
      for (int i = 0; i < 32; ++i) L[32 * j + i] = fitted[i][8 * blk + j];
    }
    uint8_t packed[12] = {0};
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < 8; ++j) {
      const uint8_t ls = static_cast<uint8_t>(std::min(63, nearest_int(inv_scale * scales[8 * blk + j])));
      const uint8_t lm = static_cast<uint8_t>(std::min(63, nearest_int(inv_min * mins[8 * blk + j])));
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
    for (int j = 0; j < 8; ++j) {  // the codes again, against the 6-bit scales actually stored
      uint8_t sc, m;
      scale_min_k4(j, packed, &sc, &m);
      const float ds = d * sc;
      if (ds == 0.0f) continue;  // L keeps the sub-block's fitted codes (as llama.cpp does)
      const float dm = dmin * m;
      for (int i = 0; i < 32; ++i)
        L[32 * j + i] = static_cast<uint8_t>(std::max(0, std::min(15, nearest_int((xb[32 * j + i] + dm) / ds))));
    }
    std::memcpy(o, &d16, 2);
    std::memcpy(o + 2, &dmin16, 2);
    std::memcpy(o + 4, packed, 12);
    uint8_t* q = o + 16;
    for (int j = 0; j < kBlock; j += 64, q += 32)  // 32 bytes: sub-block j/32 in the low nibbles, the next in the high
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
  }
}

// w [N, K] float32 -> [N, ceil(K / 256) * 144] uint8 Q4_K blocks, the last block of each row
// padded with zero weights where K is not a multiple of 256.
at::Tensor quantize_q4_k(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) > 0,
              "w must be a contiguous [N, K] float32 tensor");
  const int64_t n = w.size(0), k = w.size(1), nb = (k + kBlock - 1) / kBlock, blocks = n * nb;
  auto out = at::empty({n, nb * 144}, w.options().dtype(at::kByte));
  const float* wp = w.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  specav_native::parallel_chunks((blocks + 1) / 2, 32, [&](int64_t begin, int64_t end) {
    alignas(64) float pair_x[2 * kBlock];
    uint8_t pair_out[2 * 144];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t first = 2 * pair, count = std::min<int64_t>(2, blocks - first);
      std::fill(pair_x, pair_x + 2 * kBlock, 0.0f);  // past K, and past the last block: zeros
      for (int64_t j = 0; j < count; ++j) {
        const int64_t row = (first + j) / nb, col = (first + j) % nb * kBlock;
        std::copy(wp + row * k + col, wp + row * k + std::min(k, col + kBlock), pair_x + j * kBlock);
      }
      quantize_blocks_q4k(pair_x, pair_out);
      std::memcpy(op + first * 144, pair_out, count * 144);
    }
  });
  return out;
}

}  // namespace

SPECAV_FRAGMENT(m) { m.def("quantize_q4_k(Tensor w) -> Tensor"); }

SPECAV_IMPL(m) { m.impl("quantize_q4_k", &quantize_q4_k); }
