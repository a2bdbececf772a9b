// Row kernels of kquant.cpp for AVX-512 (F, BW, VL) with VNNI. Included by kquant.cpp inside its
// translation unit.
//
// Per weight row, a prepass decodes what every activation row shares (per block: d, the min
// term's dmin * m_j, and the sub-block scales arranged for vpdpwssd); then tiles of up to 8
// activation rows run the integer dot products against the decoded codes:
//
//   vpdpbusd   u8 codes x s8 activations -> int32 sums of 4 products (one sub-block per lane:
//              Q4_K <= 4 * 15 * 127, Q6_K <= 4 * 63 * 127 = 32004, so they fit int16 ...)
//   vpackssdw  ... two such vectors -> one of int16 (exact, no saturation)
//   vpdpwssd   int16 sums x int16 sub-block scales -> int32 block sums
//
// 3 multiplying instructions per 128 codes and row where maddubs + madd take 4. The block sum is
// converted to float once and scaled by d * dx; Q4_K's min term, sum_j (dmin m_j) (dx sum_j xq),
// is one vectorised dot over the whole row per activation row, after the blocks.
#pragma once

namespace {

constexpr int kTile = 8;
constexpr bool kQ4KOrder = true;  // the Q4_K kernel reads activations in the Q4_K order (kquant.cpp)
constexpr const char* kIsa = "avx512f avx512bw avx512vl avx512vnni fma f16c";
constexpr int64_t kMaxBlocks = 128;  // K <= 32768: the prepass keeps its decoded blocks on the stack

// Q4_K's 12 bytes of 6-bit scales and mins -> sc (u[0..1]) and m (u[2..3]) as 8 bytes each.
inline void unpack_q4k_scales(const uint8_t* packed, uint32_t u[4]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_low = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_low;
  u[0] &= kmask1;
}

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

// The index vector (for _mm512_permutexvar_epi16) that puts the scales of packs(p, q) in place:
// 128-bit lane k of the packed vector holds 4 int16 of p's lanes 4k..4k+3, then 4 of q's;
// p_sub[k] / q_sub[k] name the scale word those lanes belong to.
inline __m512i pack_scale_index(const int p_sub[4], const int q_sub[4]) {
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>((l % 8 < 4 ? p_sub : q_sub)[l / 8]);
  return _mm512_load_si512(idx);
}

// The block scale d_b * dx_rb of every block, for rows r0 .. r0 + R - 1 (vectorised over blocks).
template <int R>
inline void block_scales(const float* d, const ActView& a, int64_t r0, float (*dxd)[kMaxBlocks]) {
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < a.nb; b += 16) {
      const __mmask16 m = static_cast<__mmask16>(a.nb - b >= 16 ? 0xFFFF : (1u << (a.nb - b)) - 1);
      _mm512_mask_storeu_ps(dxd[r] + b, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, d + b),
                                                          _mm512_maskz_loadu_ps(m, a.dx + (r0 + r) * a.nb + b)));
    }
}

// sum over n floats of u * v (n a multiple of 8).
inline float dot(const float* u, const float* v, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, u + i), _mm512_maskz_loadu_ps(m, v + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// What the prepass of one weight row decodes, per block.
struct Decoded {
  alignas(64) int16_t scales[kMaxBlocks][2][32];  // the two vpdpwssd scale vectors
  alignas(64) int16_t minus32[kMaxBlocks][16];    // Q6_K: -32 * sc_j, against the sums of 16 codes
  alignas(64) float d[kMaxBlocks];
  alignas(64) float mins[kMaxBlocks * 8];          // Q4_K: dmin * m_j
};

template <int R>
void q4k_tile(const uint8_t* w, const Decoded& dec, const ActView& a, int64_t r0, float* out, int64_t ldo, float bias) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  float dxd[R][kMaxBlocks];
  block_scales<R>(dec.d, a, r0, dxd);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* qs = w + b * 144 + 16;
    const __m512i v0 = load512(qs), v1 = load512(qs + 64);
    // Low nibbles of v0: sub-blocks 0 and 2; high: 1 and 3; v1 likewise 4-7.
    const __m512i lo0 = _mm512_and_si512(v0, low4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
    const __m512i lo1 = _mm512_and_si512(v1, low4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
    const __m512i s01 = load512(dec.scales[b][0]), s23 = load512(dec.scales[b][1]);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.xq4 + (r0 + r) * a.kp + b * 256;
      const __m512i z = _mm512_setzero_si512();
      const __m512i h01 = _mm512_packs_epi32(_mm512_dpbusd_epi32(z, lo0, load512(xr)), _mm512_dpbusd_epi32(z, hi0, load512(xr + 64)));
      const __m512i h23 = _mm512_packs_epi32(_mm512_dpbusd_epi32(z, lo1, load512(xr + 128)), _mm512_dpbusd_epi32(z, hi1, load512(xr + 192)));
      const __m512i isum = _mm512_dpwssd_epi32(_mm512_madd_epi16(h01, s01), h23, s23);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dxd[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(acc[r]) - dot(dec.mins, a.xs32 + (r0 + r) * (a.kp / 32), a.nb * 8) + bias;
}

template <int R>
void q6k_tile(const uint8_t* w, const Decoded& dec, const ActView& a, int64_t r0, float* out, int64_t ldo, float bias) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(0x03);
  const __m512i shift_a = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  // 0 | 2
  const __m512i shift_b = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);   // 4 | 6
  float dxd[R][kMaxBlocks];
  block_scales<R>(dec.d, a, r0, dxd);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* ql = w + b * 210;
    // Per 128-element half: a 64-byte load of ql gives elements 0-63 (low nibbles) and 64-127
    // (high nibbles); their 2 high bits come from the half's 32 bytes of qh, shifted per 256 bits.
    __m512i q[4];
    for (int half = 0; half < 2; ++half) {
      const __m512i l = load512(ql + 64 * half);
      const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 128 + 32 * half)));
      q[2 * half] = _mm512_or_si512(_mm512_and_si512(l, low4),
                                    _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_a), three), 4));
      q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                        _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_b), three), 4));
    }
    const __m512i s01 = load512(dec.scales[b][0]), s23 = load512(dec.scales[b][1]);
    const __m512i m32 = _mm512_zextsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(dec.minus32[b])));
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = a.xq + (r0 + r) * a.kp + b * 256;
      const __m512i z = _mm512_setzero_si512();
      const __m512i h01 = _mm512_packs_epi32(_mm512_dpbusd_epi32(z, q[0], load512(xr)), _mm512_dpbusd_epi32(z, q[1], load512(xr + 64)));
      const __m512i h23 = _mm512_packs_epi32(_mm512_dpbusd_epi32(z, q[2], load512(xr + 128)), _mm512_dpbusd_epi32(z, q[3], load512(xr + 192)));
      __m512i isum = _mm512_dpwssd_epi32(_mm512_madd_epi16(h01, s01), h23, s23);
      // The -32 of every code: -32 * sc_j against the sums of 16 codes (16 int16 lanes, the rest zero).
      isum = _mm512_dpwssd_epi32(isum, _mm512_maskz_loadu_epi16(0xFFFF, a.xs16 + (r0 + r) * (a.kp / 16) + b * 16), m32);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dxd[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]) + bias;
}

// Calls tile<R>(...) for every tile of up to kTile rows of `rows`, R a compile-time constant.
template <int R = kTile, typename Fn>
void for_tiles(int64_t rows, const Fn& fn) {
  for (int64_t r0 = 0; r0 + R <= rows; r0 += R) fn(std::integral_constant<int, R>{}, r0);
  if constexpr (R > 1) {
    const int64_t done = rows / R * R;
    if (rows - done > 0) for_tiles<R - 1>(rows - done, [&](auto r, int64_t r0) { fn(r, done + r0); });
  }
}

// One Q4_K weight row (nb blocks of 144 bytes: d, dmin, 12 bytes of scales, 128 of nibbles)
// against `rows` activation rows (codes in the Q4_K order); writes out[r * ldo] = dot + bias.
void q4k_row(const uint8_t* w, const ActView& a, int64_t rows, float* out, int64_t ldo, float bias) {
  // The sub-block each packed lane group belongs to: h01 = packs(sb 0|2, sb 1|3), h23 = packs(4|6, 5|7).
  static const int p01[4] = {0, 0, 2, 2}, q01[4] = {1, 1, 3, 3}, p23[4] = {4, 4, 6, 6}, q23[4] = {5, 5, 7, 7};
  const __m512i i01 = pack_scale_index(p01, q01), i23 = pack_scale_index(p23, q23);
  Decoded dec;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = w + b * 144;
    dec.d[b] = f16_to_f32(blk);
    uint32_t u[4];
    unpack_q4k_scales(blk + 4, u);
    const __m512i s = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
    _mm512_store_si512(dec.scales[b][0], _mm512_permutexvar_epi16(i01, s));
    _mm512_store_si512(dec.scales[b][1], _mm512_permutexvar_epi16(i23, s));
    _mm256_storeu_ps(dec.mins + 8 * b, _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(blk + 2)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2))))));
  }
  for_tiles(rows, [&](auto r, int64_t r0) { q4k_tile<decltype(r)::value>(w, dec, a, r0, out + r0 * ldo, ldo, bias); });
}

// One Q6_K weight row (nb blocks of 210 bytes: ql 128, qh 64, 16 int8 scales, d) against `rows`
// activation rows in their natural order.
void q6k_row(const uint8_t* w, const ActView& a, int64_t rows, float* out, int64_t ldo, float bias) {
  // q[0] holds sub-blocks 0-3 (lanes 4k..4k+3: sub-block k), q[1] 4-7, q[2] 8-11, q[3] 12-15.
  static const int p01[4] = {0, 1, 2, 3}, q01[4] = {4, 5, 6, 7}, p23[4] = {8, 9, 10, 11}, q23[4] = {12, 13, 14, 15};
  const __m512i i01 = pack_scale_index(p01, q01), i23 = pack_scale_index(p23, q23);
  Decoded dec;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = w + b * 210;
    dec.d[b] = f16_to_f32(blk + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512i s = _mm512_zextsi256_si512(sc16);
    _mm512_store_si512(dec.scales[b][0], _mm512_permutexvar_epi16(i01, s));
    _mm512_store_si512(dec.scales[b][1], _mm512_permutexvar_epi16(i23, s));
    _mm256_store_si256(reinterpret_cast<__m256i*>(dec.minus32[b]), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5)));
  }
  for_tiles(rows, [&](auto r, int64_t r0) { q6k_tile<decltype(r)::value>(w, dec, a, r0, out + r0 * ldo, ldo, bias); });
}

}  // namespace
