// Row kernels of kquant.cpp for CPUs with AVX-512 VNNI, in 256-bit vectors (AVX-512 VL). Included
// by kquant.cpp inside its translation unit.
//
// The AVX2 kernels' layout and decoding (kquant_avx2.h), with the dot products in VNNI:
//
//   vpdpbusd   u8 codes x s8 activations -> int32 sums of 4 products, one sub-block per 128-bit
//              lane group (Q4_K <= 4 * 15 * 127, Q6_K <= 4 * 63 * 127 = 32004: they fit int16 ...)
//   vpackssdw  ... two such vectors -> one of int16 (exact, no saturation)
//   vpdpwssd   int16 sums x int16 sub-block scales, accumulated into the block's int32 sums
//
// 4 instructions per 64 codes and row where AVX2 takes 6 (maddubs, madd and add, twice); Q6_K's
// -32 offset is one more vpdpwssd per block. 256 bits and not 512: on the AMD EPYC (Zen 5) this
// was measured on, 512-bit instructions cost about twice the 256-bit ones, so the 512-bit kernels
// were slower at one row and no faster at 16 (docs/quantized.md); 32 vector registers (EVEX) let a
// tile hold 8 activation rows.
#pragma once

namespace {

constexpr int kTileQ4K = 8, kTileQ6K = 8;
// The schedule this variant starts from (kquant.cpp; schedule.py measures which runs fastest on
// the machine at hand): each tile passes over every weight row of a chunk, long K in segments,
// measured 10-25% faster at 5 and 16 rows than the AVX2 variant's order on the Zen 5 EPYC above
// (docs/quantized.md), 7-41% slower on the K = 8960 weights of a Zen 4 EPYC at 3 to 16 rows.
constexpr bool kTileOuter = true, kSegmentK = true;
constexpr const char* kIsa = "avx512vl avx512vnni (256-bit) avx2 fma f16c";

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The scale words for packs(p, q) (4 int16 of p's lanes, then 4 of q's, per 128-bit lane): in
// each 128-bit lane of `words` (16-bit words 0-7), word a for the low lane's first 4, b for its
// last 4, and in the high lane a2, b2.
inline __m256i pack_scales(__m256i words, int a, int b, int a2, int b2) {
  auto pair = [](int w) { return static_cast<char>(2 * w); };
  const __m256i idx = _mm256_setr_epi8(
      pair(a), pair(a) + 1, pair(a), pair(a) + 1, pair(a), pair(a) + 1, pair(a), pair(a) + 1,
      pair(b), pair(b) + 1, pair(b), pair(b) + 1, pair(b), pair(b) + 1, pair(b), pair(b) + 1,
      pair(a2), pair(a2) + 1, pair(a2), pair(a2) + 1, pair(a2), pair(a2) + 1, pair(a2), pair(a2) + 1,
      pair(b2), pair(b2) + 1, pair(b2), pair(b2) + 1, pair(b2), pair(b2) + 1, pair(b2), pair(b2) + 1);
  return _mm256_shuffle_epi8(words, idx);
}

// What a tile spends per row on 64 codes (two 32-byte parts of nibbles lo and hi, their activations
// x0 and x1, the scale words s for packs(lo's sums, hi's sums)): two vpdpbusd, a pack, a vpdpwssd.
inline __m256i dot64(__m256i isum, __m256i lo, __m256i hi, __m256i x0, __m256i x1, __m256i s) {
  const __m256i z = _mm256_setzero_si256();
  return _mm256_dpwssd_epi32(isum, _mm256_packs_epi32(_mm256_dpbusd_epi32(z, lo, x0), _mm256_dpbusd_epi32(z, hi, x1)), s);
}

// int8_peak's step: the arithmetic alone.
inline __m256i peak_step(__m256i isum, __m256i lo, __m256i hi, __m256i x0, __m256i x1, __m256i s) {
  return dot64(isum, lo, hi, x0, x1, s);
}

// One Q4_K weight row (nb blocks of 144 bytes: d, dmin, 12 bytes of scales, 128 of nibbles; with
// half_last, the last block's first 80: its sub-blocks 0-3) against activation rows r0 .. r0 + R - 1;
// writes out[r * ldo] = dot + bias.
template <int R>
void q4k_tile(const uint8_t* w, const ActView& a, int64_t r0, int64_t b0, int64_t b1, float* state, float* out, int64_t ldo,
            float bias, bool half_last) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + 8 * r);
  // Block b of C 32-byte parts of nibbles (4, or 2 in a half block).
  auto block = [&](auto parts, int64_t b) __attribute__((always_inline)) {
    constexpr int C = decltype(parts)::value;
    const uint8_t* blk = w + b * 144;
    prefetch_weights(a.prefetch, blk, 16 + 32 * C);
    const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
    uint32_t u[4];
    unpack_q4k_scales(blk + 4, u);
    // The 8 sub-block scales as int16 words, in both 128-bit lanes.
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
    __m256i lo[4], hi[4], s[4];
    for (int c = 0; c < C; ++c) {  // 32 bytes = 64 elements: low nibbles sub-block 2c, high 2c + 1
      const __m256i bytes = load256(blk + 16 + c * 32);
      lo[c] = _mm256_and_si256(bytes, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      s[c] = pack_scales(scales, 2 * c, 2 * c + 1, 2 * c, 2 * c + 1);
    }
    // The min term: dmin * m_j against dx * (sum of sub-block j's 32 codes), 8 lanes.
    const __m256 mf = _mm256_mul_ps(_mm256_set1_ps(dmin),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2)))));
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.xq + (r0 + r) * a.kp + b * 256;
      __m256i isum = _mm256_setzero_si256();
      for (int c = 0; c < C; ++c) isum = dot64(isum, lo[c], hi[c], load256(xr + 64 * c), load256(xr + 64 * c + 32), s[c]);
      const float xd = a.dx[(r0 + r) * a.nb + b];
      // The block's sum, d dx isum - (dmin m) . (dx xs), then one add: the sum carried over the
      // blocks waits for one addition per block, not for two fused multiply-adds.
      const __m256 mins = _mm256_mul_ps(mf, _mm256_loadu_ps(a.xs32 + (r0 + r) * (a.kp / 32) + b * 8));
      acc[r] = _mm256_add_ps(acc[r], _mm256_fmsub_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(isum), mins));
    }
  };
  for (int64_t b = b0; b < b1; ++b) {
    if (half_last && b == a.nb - 1) block(std::integral_constant<int, 2>{}, b);
    else block(std::integral_constant<int, 4>{}, b);
  }
  finish(acc, b1 == a.nb, state, out, ldo, bias);
}

// One Q6_K weight row (nb blocks of 210 bytes: ql 128, qh 64, 16 int8 scales, d).
template <int R>
void q6k_tile(const uint8_t* w, const ActView& a, int64_t r0, int64_t b0, int64_t b1, float* state, float* out, int64_t ldo,
            float bias) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i two = _mm256_set1_epi8(0x03);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + 8 * r);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* ql = w + b * 210;
    prefetch_weights(a.prefetch, ql, 210);
    const uint8_t* qh = ql + 128;
    const float d = f16_to_f32(ql + 208);
    // The 16 scales as int16 words: 0-7 in both lanes of halves[0], 8-15 in both lanes of halves[1].
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 192)));
    const __m256i halves[2] = {_mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
    const __m256i minus32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(all, 5));
    __m256i q[8], s[4];
    for (int half = 0; half < 2; ++half) {  // 128 elements: ql 64 bytes, qh 32 bytes, 8 scales
      const __m256i l0 = load256(ql + half * 64), l1 = load256(ql + half * 64 + 32), h = load256(qh + half * 32);
      // Elements 0-31, 32-63, 64-95, 96-127 of this half; the 2 high bits come from h's bit pairs.
      q[4 * half + 0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(h, two), 4));
      q[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4));
      q[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4));
      q[4 * half + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4));
      // Part p (32 elements) holds sub-blocks 2p (low 128-bit lane) and 2p + 1 (high); packs(part
      // 2i, part 2i + 1): low lane sub-blocks 4i, 4i + 2 of the half, high lane 4i + 1, 4i + 3.
      for (int i = 0; i < 2; ++i) s[2 * half + i] = pack_scales(halves[half], 4 * i, 4 * i + 2, 4 * i + 1, 4 * i + 3);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.xq + (r0 + r) * a.kp + b * 256;
      // The -32 of every code: -32 * sc_j against the sums of 16 codes.
      __m256i isum = _mm256_madd_epi16(load256(a.xs16 + (r0 + r) * (a.kp / 16) + b * 16), minus32);
      for (int pair = 0; pair < 4; ++pair)  // parts 2 pair and 2 pair + 1: elements 64 pair .. + 63
        isum = dot64(isum, q[2 * pair], q[2 * pair + 1], load256(xr + 64 * pair), load256(xr + 64 * pair + 32), s[pair]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.dx[(r0 + r) * a.nb + b]), _mm256_cvtepi32_ps(isum), acc[r]);
    }
  }
  finish(acc, b1 == a.nb, state, out, ldo, bias);
}

// The interleaved Q4_K tile's dot products (x8_tile, kquant.cpp): vpdpbusd and vpdpwssd.
constexpr int kTileX8 = 6;
inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
inline __m256i dot2(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }

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
