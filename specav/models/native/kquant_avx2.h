// Row kernels of kquant.cpp for AVX2 (with FMA and F16C): the floor every supported CPU has.
// Included by kquant.cpp inside its translation unit; 256-bit vectors, 16 vector registers.
#pragma once

namespace {

// Activation rows per pass over a weight row: each row's integer sum of the block stays in a
// register (its float sum waits in memory between blocks), beside the weight's decoded codes and
// scales; past these counts (Q6_K decodes four code vectors at once) the compiler spilled the sums,
// and a tile of 8 Q6_K rows ran slower than 6 + 2 on the Zen 3 EPYC (docs/quantized.md, "The AVX2
// tiles").
constexpr int kTileQ4K = 8, kTileQ6K = 6;
// The schedule this variant starts from (kquant.cpp; schedule.py measures which runs fastest on
// the machine at hand): each weight row passes over every tile, K in one pass, measured faster on
// an AVX2 EPYC than the AVX-512 variant's order and segments (5 and 16 rows, docs/quantized.md).
constexpr bool kTileOuter = false, kSegmentK = false;
constexpr const char* kIsa = "avx2 fma f16c";

// Byte masks for _mm256_shuffle_epi8: mask [lo][hi] repeats int16 word lo of the low 128-bit lane
// across that lane and word hi of the high lane across the high lane. A table in memory, so each
// shuffle takes its mask as one load: masks built from immediates cost four instructions at every
// use (the compiler rebuilt them inside the loop over blocks).
alignas(32) inline constexpr struct WordMasks {
  uint8_t bytes[8][8][32];
  constexpr WordMasks() : bytes() {
    for (int lo = 0; lo < 8; ++lo)
      for (int hi = 0; hi < 8; ++hi)
        for (int j = 0; j < 16; j += 2) {
          bytes[lo][hi][j] = static_cast<uint8_t>(2 * lo), bytes[lo][hi][j + 1] = static_cast<uint8_t>(2 * lo + 1);
          bytes[lo][hi][16 + j] = static_cast<uint8_t>(2 * hi), bytes[lo][hi][17 + j] = static_cast<uint8_t>(2 * hi + 1);
        }
  }
} kWordMasks;

// Word i of each 128-bit lane of v, repeated across that lane (i: 0..7, a compile-time constant
// once the loops are unrolled). `lo_word`/`hi_word` pick per lane: low lane word lo, high lane hi.
inline __m256i broadcast_words(__m256i v, int lo_word, int hi_word) {
  return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(kWordMasks.bytes[lo_word][hi_word])));
}

// What a tile spends per row on 64 codes of a Q4_K block (sub-blocks 2c and 2c + 1: nibbles lo and
// hi, their activations x0 and x1, scales s_lo and s_hi as int16 words): u8 x s8 products added in
// pairs (maddubs), times the sub-block scale and added in pairs again (madd), into the int32 sums.
inline __m256i dot64(__m256i isum, __m256i lo, __m256i hi, __m256i x0, __m256i x1, __m256i s_lo, __m256i s_hi) {
  return _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s_lo),
                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s_hi)));
}

// dot64 with one scale word for both sub-blocks (int8_peak: the arithmetic alone).
inline __m256i peak_step(__m256i isum, __m256i lo, __m256i hi, __m256i x0, __m256i x1, __m256i s) {
  return dot64(isum, lo, hi, x0, x1, s, s);
}

// One Q4_K weight row (nb blocks of 144 bytes: d, dmin, 12 bytes of scales, 128 of nibbles; with
// half_last, the last block's first 80: its sub-blocks 0-3) against activation rows r0 .. r0 + R - 1;
// writes out[r * ldo] = dot + bias.
template <int R>
void q4k_tile(const uint8_t* w, const ActView& a, int64_t r0, int64_t b0, int64_t b1, float* state, float* out, int64_t ldo,
            float bias, bool half_last) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // Each row's codes, scales and 32-code sums, from block b0 on (the compiler need not recompute
  // them from `a` in every block: the stores of the scales' unpacking could alias it).
  const int8_t* xq[R];
  const float *dx[R], *xs[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.xq + (r0 + r) * a.kp + b0 * 256;
    dx[r] = a.dx + (r0 + r) * a.nb + b0;
    xs[r] = a.xs32 + (r0 + r) * (a.kp / 32) + b0 * 8;
  }
  const int64_t prefetch = a.prefetch;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + 8 * r);
  // Block i (b0 + i) of C 32-byte parts of nibbles (4, or 2 in a half block).
  auto block = [&](auto parts, const uint8_t* blk, int64_t i) __attribute__((always_inline)) {
    constexpr int C = decltype(parts)::value;
    prefetch_weights(prefetch, blk, 16 + 32 * C);
    // d and dmin in one conversion: lanes 0 and 1.
    uint32_t halves;
    std::memcpy(&halves, blk, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(halves)));
    uint32_t u[4];
    unpack_q4k_scales(blk + 4, u);
    // The 8 sub-block scales (bytes 0-7) and mins (8-15) as one vector, from registers.
    const __m128i sm = _mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]), static_cast<int>(u[1]), static_cast<int>(u[0]));
    // The scales as int16 in both 128-bit lanes.
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < C; ++c) {  // 32 bytes = 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + c * 32));
      const __m256i lo = _mm256_and_si256(bytes, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      const __m256i s_lo = broadcast_words(scales, 2 * c, 2 * c);
      const __m256i s_hi = broadcast_words(scales, 2 * c + 1, 2 * c + 1);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq[r] + i * 256 + c * 64;
        isum[r] = dot64(isum[r], lo, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)), s_lo, s_hi);
        // Keeps each row's sum one running register: left free, the compiler regroups the integer
        // additions to the end of the block and spills their operands to the stack.
        asm("" : "+x"(isum[r]));
      }
    }
    // The min term, dmin * m_j against dx * (sum of sub-block j's 32 codes): 8 lanes.
    const __m256 mf = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    const __m256 vd = _mm256_broadcastss_ps(dd);
    for (int r = 0; r < R; ++r) {  // acc += d dx isum - (dmin m) . (dx xs)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(vd, _mm256_broadcast_ss(dx[r] + i)), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(mf, _mm256_loadu_ps(xs[r] + i * 8), acc[r]);
    }
  };
  const bool half = half_last && b1 == a.nb;  // the row's last block, in this segment, is half a block
  const int64_t full = b1 - b0 - (half ? 1 : 0);
  const uint8_t* blk = w + b0 * 144;
  for (int64_t i = 0; i < full; ++i, blk += 144) block(std::integral_constant<int, 4>{}, blk, i);
  if (half) block(std::integral_constant<int, 2>{}, blk, full);
  finish(acc, b1 == a.nb, state, out, ldo, bias);
}

// One Q6_K weight row (nb blocks of 210 bytes: ql 128, qh 64, 16 int8 scales, d).
template <int R>
void q6k_tile(const uint8_t* w, const ActView& a, int64_t r0, int64_t b0, int64_t b1, float* state, float* out, int64_t ldo,
            float bias) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03);
  const int8_t* xq[R];  // each row's codes, scales and 16-code sums from block b0 on, as in q4k_tile
  const float* dx[R];
  const int16_t* xs[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = a.xq + (r0 + r) * a.kp + b0 * 256;
    dx[r] = a.dx + (r0 + r) * a.nb + b0;
    xs[r] = a.xs16 + (r0 + r) * (a.kp / 16) + b0 * 16;
  }
  const int64_t prefetch = a.prefetch;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + 8 * r);
  const uint8_t* ql = w + b0 * 210;
  for (int64_t i = 0; i < b1 - b0; ++i, ql += 210) {
    prefetch_weights(prefetch, ql, 210);
    const uint8_t* qh = ql + 128;
    const __m256 vd = _mm256_set1_ps(f16_to_f32(ql + 208));
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    // The 16 scales as int16: scales 0-7 in both lanes of halves[0], 8-15 in both lanes of halves[1].
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 192)));
    const __m256i halves[2] = {_mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
    for (int half = 0; half < 2; ++half) {  // 128 elements: ql 64 bytes, qh 32 bytes, 8 scales
      const uint8_t* l = ql + half * 64;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + half * 32));
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
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + i * 256 + half * 128 + part * 32));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[part], x), scale));
          asm("" : "+x"(isum[r]));  // one running register a row, as in q4k_tile
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      // The -32 of every code, in integers: 32 * sum_j sc_j * (sum of sub-block j's codes); then
      // acc += d dx (isum - that).
      const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r] + i * 16)), all);
      const __m256i sum = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(vd, _mm256_broadcast_ss(dx[r] + i)), _mm256_cvtepi32_ps(sum), acc[r]);
    }
  }
  finish(acc, b1 == a.nb, state, out, ldo, bias);
}

// The interleaved Q4_K tile's dot products (x8_tile, kquant.cpp): u8 x s8 in groups of 4 into int32
// (maddubs, then madd against ones: pairs of 15 * 128 fit int16), and int16 pairs into int32.
constexpr int kTileX8 = 2;  // 16 registers: two rows' five sums beside the decoded codes
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

// Calls fn(std::integral_constant<int, R>{}, r0) for every tile of up to R rows of `rows`.
template <int R, typename Fn>
void for_tiles(int64_t rows, const Fn& fn) {
  int64_t r0 = 0;
  for (; r0 + R <= rows; r0 += R) fn(std::integral_constant<int, R>{}, r0);
  if constexpr (R > 1) {
    if (rows - r0 > 0) for_tiles<R - 1>(rows - r0, [&](auto r, int64_t r1) { fn(r, r0 + r1); });
  }
}

}  // namespace
