// Matmul on GGUF k-quant blocks as the file stores them: y_i = x @ W_i^T (+ b_i) for one or more
// weights W_i in Q4_K or Q6_K that share the input x (q/k/v, gate/up: one call per layer).
//
// Decoding one token reads every weight once, so on a CPU it is memory-bound: the kernel reads the
// file's 4.5 (Q4_K) or 6.6 (Q6_K) bits per weight, as laid out in the file (144 / 210 bytes per
// 256 weights; no repacking at load). Weights keep their exact codes and scales; each activation
// row is quantised to int8 with one float scale per 256 elements (round to nearest even,
// scale = max|x| / 127), and the dot products run in integers:
//
//   Q4_K, sub-block j of 32:  w = d * sc_j * q - dmin * m_j        (q in 0..15, sc_j, m_j in 0..63)
//     sum_i w_i x_i = dx * d * sum_j sc_j * sum_i q_i xq_i  -  sum_j (dmin * m_j) * (dx * sum_i xq_i)
//   Q6_K, sub-block j of 16:  w = d * sc_j * (q - 32)              (q in 0..63, sc_j int8)
//     sum_i w_i x_i = dx * d * sum_j sc_j * (sum_i q_i xq_i  -  32 * sum_i xq_i)
//
// Integer ranges: u8 x s8 products are added in pairs into int16 (_mm*_maddubs_epi16): Q4_K
// 2 * 15 * 127 and Q6_K 2 * 63 * 127 = 16002 < 32767, so nothing saturates; the int32 sums per
// 256-block stay below 2^26 and are converted to float once per block (exact below 2^24 per lane).
//
// Multi-row: each weight block is decoded once per tile of activation rows (up to kTileQ4K /
// kTileQ6K rows, their sums held in registers: AVX2 8 / 6, AVX-512 8 / 8) and applied to every
// row of the tile, so verifying K + 1 rows reads the weights once and decodes them once per tile (kquant_avx2.h,
// kquant_avx512.h: the tile kernels of each instruction set). The schedule (which loop is outer,
// tiles or weight rows; whether long rows, K = 8960 at 5 rows and more, go in segments of K so a
// tile's activations stay in the L1 cache; whether multi-row calls prefetch their weights) is
// chosen per machine at run time (set_schedule; schedule.py measures), each variant starting from
// the loops measured fastest where it was written.
// A Q4_K weight may also come repacked at load with 8 output features interleaved (type kQ4KX8 =
// 112, x8_tile below): the same codes and scales, laid out so that 4 activation bytes meet 4 codes
// of 8 features in one dot product and a row needs no horizontal sums; several rows then cost
// about 1.5x fewer cycles than in the file's layout (docs/quantized.md). One call may mix layouts.
// The work is split over output features in chunks, each thread one contiguous run of them.
// Every output depends only on its own row of x, computed by the same instructions whatever the
// tile: the kernel is batch-invariant.
//
// A weight's K may exceed x's width up to the next multiple of 256 (weights requantised from
// 32-element formats, K = 896, padded with zero weights): x is quantised with zeros past its width.
// Where x's width ends in the first half of a block (K mod 256 in 1..128), a Q4_K weight may leave
// out the last block's second half, its last 64 bytes (sub-blocks 4-7: zero weights against zero
// activations): each row then holds nb * 144 - 64 bytes, 11% fewer to read at K = 896, and the
// results are the padded weight's bit for bit (the integer sums only lose terms that are 0).

#include "ops.h"

#include <array>
#include <atomic>
#include <chrono>
#include <type_traits>
#include <vector>

namespace {

using specav_native::f16_to_f32;
using specav_native::hsum;
using specav_native::parallel_chunks;
using specav_native::parallel_runs;

constexpr int64_t kBlock = 256;  // super-block: one activation scale, one d (and dmin)
constexpr int64_t kQ4KBytes = 144, kQ6KBytes = 210;
constexpr int64_t kQ4K = 12, kQ6K = 14;  // ggml type codes
constexpr int64_t kQ4KX8 = 112;  // Q4_K repacked with 8 output features interleaved (x8_tile), specav's own code

// Activations of T rows, quantised per 256-element block (the width padded to nb * 256 with zeros).
struct Activations {
  int64_t rows = 0, nb = 0, kp = 0;  // kp = nb * 256
  at::Tensor xq;    // [T, kp] int8 codes
  at::Tensor dx;    // [T, nb] float scales
  at::Tensor xs16;  // [T, kp / 16] int16 sums of 16 codes (|sum| <= 2032)
  at::Tensor xs32;  // [T, kp / 32] float: dx * sum of 32 codes (the Q4_K min term)
  at::Tensor xs32i;  // [T, kp / 32] int16 sums of 32 codes (|sum| <= 4064), where asked: x8_tile's min term
};

// Raw pointers into Activations, for the row kernels.
struct ActView {
  const int8_t* xq;
  const float *dx, *xs32;
  const int16_t* xs16;
  int64_t nb, kp;
  int64_t prefetch;  // bytes ahead of the decoded weight block to prefetch, 0 for none (prefetch_weights)
};

// Shared by every variant's row kernels (included below).

// Q4_K's 12 bytes of 6-bit scales and mins -> sc (u[0..1]) and m (u[2..3]) as 8 bytes each
// (llama.cpp's unpacking; the gguf package's get_scale_min is the reference in the tests).
inline void unpack_q4k_scales(const uint8_t* packed, uint32_t u[4]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_low = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_low;
  u[0] &= kmask1;
}

// With the schedule's kSchedulePrefetch, a call of several rows asks for the weight bytes
// `distance` (ActView::prefetch) ahead of the block it decodes (the next blocks of the row, then
// the next rows): with a long K, each weight row also streams its tile's activations in from the
// L2 cache, and on a Zen 4 EPYC the hardware prefetchers then fell behind the weights (K = 8960 at
// 2 to 16 rows took 14-40% less time with this, docs/quantized.md; one row, where they keep up,
// 7-15% more, and on a Zen 3 EPYC within 3% either way).
inline void prefetch_weights(int64_t distance, const uint8_t* block, int64_t bytes) {
  if (distance > 0) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(block) + distance + o, _MM_HINT_T0);
  }
}

// After blocks b0 .. b1 - 1 of a weight row: its R partial sums kept in state (8 floats a row) for
// the next segment of blocks, or, after the last block, out[r * ldo] = their sum + bias.
template <int R>
inline void finish(const __m256 (&acc)[R], bool last, float* state, float* out, int64_t ldo, float bias) {
  for (int r = 0; r < R; ++r) {
    if (last) out[r * ldo] = hsum(acc[r]) + bias;
    else _mm256_storeu_ps(state + 8 * r, acc[r]);
  }
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "kquant_avx512.h"
#else
#include "kquant_avx2.h"
#endif

// Q4_K with 8 output features interleaved (kq_matmul's type kQ4KX8 = 112; quant_kernels.KQuantX8Weight
// packs it at load from the file's blocks, the same codes and scales). Per group of 8 features and 256-element
// block, 1184 bytes:
//   codes   1024  32 vectors of 32 bytes; in vector v, feature n's 4 bytes hold its codes 8v .. 8v + 3
//                 (low nibbles) and 8v + 4 .. 8v + 7 (high nibbles)
//   sc        64  [sub-block j][feature n] u8        m  64  [pair p][feature n][2] u8: m_2p, m_2p+1
//   d         16  [feature n] f16                 dmin  16  [feature n] f16
// Where x's width ends in the first half of the last block (weights requantised with K padded,
// the drafter's K = 896), that block may hold only its first 16 vectors of codes (sub-blocks 0-3)
// before its scales: 672 bytes, the other half being zero weights against zero activations.
// A vector's lanes are the 8 features, so a row needs no horizontal sums: 4 activation bytes,
// broadcast, meet 4 codes of every feature in one u8 x s8 dot (dot4), a sub-block's sums (8 of
// them, 32 codes) take the features' scales in one multiply, and the min term is 4 dot2 of the
// (m_2p, m_2p+1) pairs against the row's 32-code sums. In integers per block (sc q x: < 2^31),
// then d dx and dmin dx in float; each row's sums in the same order whatever the tile.
namespace {

constexpr int64_t kX8Features = 8, kX8Bytes = 1184, kX8HalfBytes = 672;

// acc[r] += block b of one group of features (w: the block, its codes first, its scales at codes
// bytes) against R rows; J sub-blocks of codes (8, or 4 in a half block).
template <int R, int J>
inline void x8_block(const uint8_t* w, int64_t b, const int8_t* const* xq, const float* const* dx,
                     const int16_t* const* s32, __m256 (&acc)[R]) {
  constexpr int64_t kSc = 128 * J, kMins = kSc + 64, kD = kSc + 128, kDmin = kSc + 144;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i isum[R], msum[R];
  for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm256_setzero_si256();
  for (int j = 0; j < J; ++j) {  // sub-block j: vectors 4j .. 4j + 3
    __m256i lo_sum[R], hi_sum[R];  // two chains a row: low and high nibbles
    for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm256_setzero_si256();
    for (int q = 0; q < 4; ++q) {
      const int v = 4 * j + q;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * v));
      const __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      for (int r = 0; r < R; ++r) {
        int32_t x0, x1;
        std::memcpy(&x0, xq[r] + b * 256 + 8 * v, 4);
        std::memcpy(&x1, xq[r] + b * 256 + 8 * v + 4, 4);
        lo_sum[r] = dot4(lo_sum[r], lo, _mm256_set1_epi32(x0));
        hi_sum[r] = dot4(hi_sum[r], hi, _mm256_set1_epi32(x1));
      }
    }
    const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + kSc + 8 * j)));
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(lo_sum[r], hi_sum[r]), sc));
  }
  for (int p = 0; p < J / 2; ++p) {  // the min term: m_2p s_2p + m_2p+1 s_2p+1 per feature
    const __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kMins + 16 * p)));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, s32[r] + b * 8 + 2 * p, 4);
      msum[r] = dot2(msum[r], m, _mm256_set1_epi32(pair));
    }
  }
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kD)));
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kDmin)));
  for (int r = 0; r < R; ++r) {  // acc += d dx isum - dmin dx msum
    const __m256 vdx = _mm256_broadcast_ss(dx[r] + b);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, vdx), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(dmin, vdx), acc[r]);
  }
}

// Blocks b0 .. b1 - 1 of one group of features (w: the group's first block; `half`: its last
// block, nb - 1, is a half block) against R rows; the rows' partial sums wait in state (8 floats
// a row) between segments of blocks; after the last block, out[r][0..7] = the sums + bias.
template <int R>
void x8_tile(const uint8_t* w, int64_t b0, int64_t b1, int64_t nb, bool half, const int8_t* const* xq,
             const float* const* dx, const int16_t* const* s32, float* state, float* const* out, const float* bias) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(state + 8 * r);
  const int64_t full_end = half && b1 == nb ? nb - 1 : b1;
  w += b0 * kX8Bytes;
  for (int64_t b = b0; b < full_end; ++b, w += kX8Bytes) {
    // The weights 2 KiB ahead, non-temporal: they pass through the L1 cache once and leave the rows'
    // activations there (a prefetch into every level, kquant's, did not help here).
    for (int64_t o = 0; o < kX8Bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + 2048 + o, _MM_HINT_NTA);
    x8_block<R, 8>(w, b, xq, dx, s32, acc);
  }
  if (full_end < b1) x8_block<R, 4>(w, nb - 1, xq, dx, s32, acc);
  if (b1 < nb) {
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(state + 8 * r, acc[r]);
    return;
  }
  const __m256 vb = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], _mm256_add_ps(acc[r], vb));
}

// Quantises one 256-element block (src may be shorter: `valid` elements, the rest zero).
void quantize_block(const float* src, int64_t valid, int8_t* dst, float* d_out) {
  alignas(32) float padded[kBlock];
  if (valid < kBlock) {
    std::fill(padded, padded + kBlock, 0.0f);
    std::copy(src, src + valid, padded);
    src = padded;
  }
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  *d_out = d;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  for (int i = 0; i < kBlock; i += 32) {
    __m256i a[4];
    for (int j = 0; j < 4; ++j)  // round to nearest even (the default MXCSR mode)
      a[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * j), inv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a[0], a[1]), _mm256_packs_epi32(a[2], a[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(packed, order));
  }
}

Activations quantize_rows(const at::Tensor& x, int64_t nb, bool int_sums32 = false) {
  Activations a;
  a.rows = x.size(0);
  a.nb = nb;
  a.kp = nb * kBlock;
  const int64_t k = x.size(1), kp = a.kp;
  auto opts = x.options();
  a.xq = at::empty({a.rows, kp}, opts.dtype(at::kChar));
  a.dx = at::empty({a.rows, nb}, opts);
  a.xs16 = at::empty({a.rows, kp / 16}, opts.dtype(at::kShort));
  a.xs32 = at::empty({a.rows, kp / 32}, opts);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.xq.data_ptr<int8_t>();
  float* dp = a.dx.data_ptr<float>();
  int16_t* s16 = a.xs16.data_ptr<int16_t>();
  float* s32 = a.xs32.data_ptr<float>();
  if (int_sums32) a.xs32i = at::empty({a.rows, kp / 32}, opts.dtype(at::kShort));
  int16_t* s32i = int_sums32 ? a.xs32i.data_ptr<int16_t>() : nullptr;
  parallel_chunks(a.rows * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb) {
      const int64_t r = rb / nb, b = rb % nb, first = b * kBlock;
      int8_t* dst = qp + r * kp + first;
      quantize_block(xp + r * k + first, std::min<int64_t>(kBlock, k - first), dst, dp + rb);
      int16_t* sums = s16 + r * (kp / 16) + b * 16;
      for (int g = 0; g < kBlock / 16; ++g) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += dst[16 * g + i];
        sums[g] = static_cast<int16_t>(s);
      }
      for (int g = 0; g < kBlock / 32; ++g) {
        const int32_t sum = sums[2 * g] + sums[2 * g + 1];
        s32[r * (kp / 32) + b * 8 + g] = dp[rb] * static_cast<float>(sum);
        if (s32i) s32i[r * (kp / 32) + b * 8 + g] = static_cast<int16_t>(sum);
      }
    }
  });
  return a;
}

// The schedule, bits of kScheduleTileOuter and kScheduleSegmentK (the loops, see kq_matmul) and
// kSchedulePrefetch (prefetch_weights); every schedule computes the same results, so changing it
// between calls changes only the speed.
constexpr int64_t kScheduleTileOuter = 1, kScheduleSegmentK = 2, kSchedulePrefetch = 4;
std::atomic<int64_t> g_schedule{(kTileOuter ? kScheduleTileOuter : 0) | (kSegmentK ? kScheduleSegmentK : 0)};
constexpr int64_t kPrefetchBytes = 2048;  // 1-6 KiB measured alike on the Zen 4 EPYC

int64_t block_bytes(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4K || qtype == kQ6K || qtype == kQ4KX8,
              "kquant runs Q4_K (12), Q6_K (14) and Q4_K interleaved (112) weights, got type ", qtype);
  return qtype == kQ4K ? kQ4KBytes : qtype == kQ6K ? kQ6KBytes : kX8Bytes;
}

// The weights of a kq_matmul call in the interleaved layout (type kQ4KX8), against rows of `a`:
// outputs yp[i] (rows x ns[i]) of each such weight i, its groups of 8 features row_bytes[i] apart
// (half[i]: each group's last block is a half block).
void x8_matmuls(const Activations& a, int64_t rows, const std::vector<int64_t>& which, const std::vector<const uint8_t*>& wp,
                const std::vector<const float*>& bp, const std::vector<float*>& yp, const std::vector<int64_t>& ns,
                const std::vector<int64_t>& row_bytes, const std::vector<char>& half) {
  const int64_t nb = a.nb;
  const int8_t* xq = a.xq.data_ptr<int8_t>();
  const float* dx = a.dx.data_ptr<float>();
  const int16_t* sp = a.xs32i.data_ptr<int16_t>();  // adjacent pairs of 32-code sums: the min term's dot2
  // Chunks of kX8Chunk feature groups, weight by weight, each thread a contiguous run of them, and
  // the weights prefetched 2 KiB ahead as non-temporal (x8_tile): with a long K (8960) the weights
  // streaming through the L1 cache otherwise evicted the activations, and 2 rows took twice the
  // time of one. K runs in segments of blocks only where a tile's activations would not fit the
  // L2 cache (kX8SegmentBytes), each segment passing over the chunk's groups, the rows' partial
  // sums waiting in `state` between segments: segments sized for the L1 cache (16 KiB) read a
  // chunk's weights as 8 interleaved streams, and on the Zen 4 EPYC the down projection (K = 8960)
  // took 1.1-1.3x the time of whole rows at 2-8 rows (docs/quantized.md); from the L2 cache the
  // activations keep up. Each row's blocks are summed in the same order whatever the tiles and
  // segments.
  constexpr int64_t kX8Chunk = 8, kX8SegmentBytes = 512 * 1024;
  std::vector<std::array<int64_t, 3>> chunks;
  for (const int64_t i : which)
    for (int64_t g = 0; g < ns[i] / kX8Features; g += kX8Chunk) chunks.push_back({i, g, std::min(ns[i] / kX8Features, g + kX8Chunk)});
  const int64_t seg = std::max<int64_t>(1, kX8SegmentBytes / (std::min<int64_t>(rows, kTileX8) * kBlock));
  parallel_runs(static_cast<int64_t>(chunks.size()), [&](int64_t begin, int64_t end) {
    std::vector<float> state(seg < nb ? kX8Chunk * rows * 8 : 0);
    for (int64_t c = begin; c < end; ++c) {
      const auto [i, g0, g1] = chunks[c];
      for (int64_t b0 = 0; b0 < nb; b0 += seg) {
        const int64_t b1 = std::min(nb, b0 + seg);
        for (int64_t g = g0; g < g1; ++g) {
          for_tiles<kTileX8>(rows, [&](auto tile, int64_t r0) {
            constexpr int R = decltype(tile)::value;
            const int8_t* xr[R];
            const float* dr[R];
            const int16_t* sr[R];
            float* out[R];
            for (int r = 0; r < R; ++r) {
              xr[r] = xq + (r0 + r) * a.kp;
              dr[r] = dx + (r0 + r) * nb;
              sr[r] = sp + (r0 + r) * (a.kp / 32);
              out[r] = yp[i] + (r0 + r) * ns[i] + g * kX8Features;
            }
            x8_tile<R>(wp[i] + g * row_bytes[i], b0, b1, nb, half[i], xr, dr, sr, state.data() + ((g - g0) * rows + r0) * 8, out,
                       bp[i] ? bp[i] + g * kX8Features : nullptr);
          });
        }
      }
    }
  });
}

}  // namespace

namespace specav_native::SPECAV_NS {

std::vector<at::Tensor> kq_matmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes,
                                  const c10::List<std::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [T, K] float32 tensor");
  const int64_t n_weights = static_cast<int64_t>(weights.size()), rows = x.size(0), k = x.size(1);
  TORCH_CHECK(n_weights >= 1 && static_cast<int64_t>(qtypes.size()) == n_weights &&
              static_cast<int64_t>(biases.size()) == n_weights, "one qtype and one bias (or None) per weight");
  const int64_t nb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(k > 0, "x must have columns");
  std::vector<const uint8_t*> wp(n_weights);
  std::vector<const float*> bp(n_weights);
  std::vector<float*> yp(n_weights);
  std::vector<int64_t> ns(n_weights), row_bytes(n_weights);
  std::vector<char> half(n_weights);  // its rows end in half a Q4_K block
  const bool half_block = k % kBlock != 0 && k % kBlock <= kBlock / 2;
  std::vector<at::Tensor> ys;
  for (int64_t i = 0; i < n_weights; ++i) {
    const at::Tensor& w = weights[i];
    const int64_t bytes = block_bytes(qtypes[i]);
    // A Q4_K row (or group of 8 interleaved rows) may end in half a block: 64 (512) bytes fewer.
    const int64_t half_bytes = qtypes[i] == kQ4K ? 64 : qtypes[i] == kQ4KX8 ? kX8Bytes - kX8HalfBytes : 0;
    half[i] = half_block && half_bytes && w.dim() == 2 && w.size(1) == nb * bytes - half_bytes;
    row_bytes[i] = nb * bytes - (half[i] ? half_bytes : 0);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes[i],
                qtypes[i] == kQ4KX8 ? "interleaved Q4_K weight " : "weight ", i, " must be a contiguous [",
                qtypes[i] == kQ4KX8 ? "N / 8" : "N", ", ", nb, " * ", bytes, "] uint8 tensor",
                qtypes[i] == kQ4KX8 ? " (KQuantX8Weight)" : " of blocks", " for K = ", k,
                " (its K may be padded to a multiple of 256", half_block && half_bytes ?
                ", and end in the last block's first half" : "", "), got ", w.sizes());
    ns[i] = qtypes[i] == kQ4KX8 ? w.size(0) * kX8Features : w.size(0);
    const std::optional<at::Tensor> b = biases.get(i);
    TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == ns[i] && b->scalar_type() == at::kFloat && b->is_contiguous()),
                "bias ", i, " must be a contiguous float32 vector of the weight's output features");
    wp[i] = w.data_ptr<uint8_t>();
    bp[i] = b ? b->data_ptr<float>() : nullptr;
    ys.push_back(at::empty({rows, ns[i]}, x.options()));
    yp[i] = ys.back().data_ptr<float>();
  }
  if (rows == 0) return ys;
  const int64_t schedule = g_schedule.load(std::memory_order_relaxed);
  const bool any_interleaved = std::find(qtypes.begin(), qtypes.end(), kQ4KX8) != qtypes.end();
  const Activations a = quantize_rows(x, nb, any_interleaved);
  const ActView view{a.xq.data_ptr<int8_t>(), a.dx.data_ptr<float>(), a.xs32.data_ptr<float>(),
                     a.xs16.data_ptr<int16_t>(), nb, a.kp, rows > 1 && (schedule & kSchedulePrefetch) ? kPrefetchBytes : 0};
  // Chunks of output features, weight by weight: (weight, first feature, end feature). About 32 KiB
  // of weights each (16 rows of K = 8960, 56 of K = 1024): each chunk is a few microseconds of
  // work, so taking one (an atomic step of the dynamic schedule) costs little beside it (16 rows
  // whatever K made the drafter's K = 1024 layers 40% slower at two threads).
  std::vector<std::array<int64_t, 3>> chunks;
  std::vector<int64_t> interleaved;  // the weights of type kQ4KX8, run by x8_matmuls after the others
  int64_t max_chunk = 0;
  for (int64_t i = 0; i < n_weights; ++i) {
    if (qtypes[i] == kQ4KX8) {
      interleaved.push_back(i);
      continue;
    }
    const int64_t chunk = std::clamp<int64_t>(32768 / row_bytes[i], 16, 1024);
    max_chunk = std::max(max_chunk, chunk);
    for (int64_t f = 0; f < ns[i]; f += chunk) chunks.push_back({i, f, std::min(ns[i], f + chunk)});
  }
  // Loop order, per the schedule (set_schedule): with kScheduleTileOuter, each tile of activation
  // rows passes over every weight row of the chunk (the chunk's weights stay in the L2 cache), else
  // each weight row passes over every tile. With kScheduleSegmentK,
  // where a tile's activations would not fit the L1 cache (16 KiB: K = 8960 at 5 rows), K runs in
  // segments of blocks, the partial sums of each (weight row, activation row) waiting in `state`
  // between segments. Each row's blocks are summed in the same order whatever the order, segments
  // and tiles, so the results depend on none of them (nor on the row count).
  const bool tile_outer = schedule & kScheduleTileOuter, segment_k = schedule & kScheduleSegmentK;
  const int64_t tile_rows = std::min<int64_t>(rows, std::max(kTileQ4K, kTileQ6K));
  const int64_t seg = segment_k && tile_rows * a.kp > 16384 ? std::max<int64_t>(1, 16384 / (tile_rows * kBlock)) : nb;
  const int64_t* qt = qtypes.data();
  if (!chunks.empty()) parallel_runs(static_cast<int64_t>(chunks.size()), [&](int64_t begin, int64_t end) {
    std::vector<float> state(seg < nb ? max_chunk * rows * 8 : 0);
    for (int64_t c = begin; c < end; ++c) {
      const auto [i, first_feature, last_feature] = chunks[c];
      const int64_t n = ns[i];
      for (int64_t b0 = 0; b0 < nb; b0 += seg) {
        const int64_t b1 = std::min(nb, b0 + seg);
        // Every tile of the chunk's weight rows f and the activation rows, in the schedule's order;
        // tile(R, r0, f) runs weight row f against rows r0 .. r0 + R - 1, R up to max_tile.
        auto tiles = [&](auto max_tile, const auto& tile) {
          constexpr int M = decltype(max_tile)::value;
          if (tile_outer) {
            for_tiles<M>(rows, [&](auto r, int64_t r0) {
              for (int64_t f = first_feature; f < last_feature; ++f) tile(r, r0, f);
            });
          } else {
            for (int64_t f = first_feature; f < last_feature; ++f) for_tiles<M>(rows, [&](auto r, int64_t r0) { tile(r, r0, f); });
          }
        };
        const uint8_t* w = wp[i];
        const int64_t stride = row_bytes[i];
        float* y = yp[i];
        const float* bias = bp[i];
        auto st = [&](int64_t r0, int64_t f) { return state.data() + ((f - first_feature) * rows + r0) * 8; };
        if (qt[i] == kQ4K) {
          tiles(std::integral_constant<int, kTileQ4K>{}, [&](auto r, int64_t r0, int64_t f) {
            q4k_tile<decltype(r)::value>(w + f * stride, view, r0, b0, b1, st(r0, f), y + r0 * n + f, n, bias ? bias[f] : 0.0f, half[i]);
          });
        } else {
          tiles(std::integral_constant<int, kTileQ6K>{}, [&](auto r, int64_t r0, int64_t f) {
            q6k_tile<decltype(r)::value>(w + f * stride, view, r0, b0, b1, st(r0, f), y + r0 * n + f, n, bias ? bias[f] : 0.0f);
          });
        }
      }
    }
  });
  if (!interleaved.empty()) x8_matmuls(a, rows, interleaved, wp, bp, yp, ns, row_bytes, half);
  return ys;
}

}  // namespace specav_native::SPECAV_NS

namespace {

// Multiply-adds (weight code x activation code) per second of the kernels' arithmetic on register
// operands, summed over `threads` threads running at once (on a VM two "cores" may be one core's
// two hardware threads, sharing its multipliers): each runs the variant's per-row step on 64 codes
// (peak_step: the dot64 of the tile kernels) in independent chains, `iterations` times each, with no
// load, decode or memory in the way. What no tile of this variant can beat: at many rows, where one
// pass over the weights serves them all, the arithmetic bounds a matmul (bench native).
double int8_peak(int64_t iterations, int64_t threads) {
  TORCH_CHECK(iterations > 0 && threads > 0, "int8_peak needs iterations > 0 and threads > 0, got ", iterations,
              " and ", threads);
  constexpr int kChains = 6;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    __m256i lo = _mm256_set1_epi8(7), hi = _mm256_set1_epi8(9), x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(-2);
    const __m256i s = _mm256_set1_epi16(1);
    __m256i acc[kChains];
    for (auto& v : acc) v = _mm256_setzero_si256();
    for (int64_t i = 0; i < iterations; ++i) {
      for (int c = 0; c < kChains; ++c) {
        asm volatile("" : "+x"(x0), "+x"(x1));  // the operands "change" (no instruction): no step is shared or hoisted
        acc[c] = peak_step(acc[c], lo, hi, x0, x1, s);
      }
    }
    for (auto& v : acc) asm volatile("" : : "x"(v));  // the sums are used: nothing is left out
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(iterations) * threads * kChains * 64 / seconds;
}

// The activation quantisation alone (natural order), so tests can rebuild the kernel's arithmetic exactly.
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [T, K] float32 tensor");
  Activations a = quantize_rows(x, (x.size(1) + kBlock - 1) / kBlock);
  return {a.xq, a.dx};
}

std::string isa() { return kIsa; }

// Sets the schedule (bits: 1 tiles outer, 2 long K in segments, 4 prefetch the weights of multi-row
// calls) where `schedule` >= 0; returns the schedule in force before (so -1 only reads it).
int64_t set_schedule(int64_t schedule) {
  TORCH_CHECK(schedule <= (kScheduleTileOuter | kScheduleSegmentK | kSchedulePrefetch),
              "schedule bits are 1 (tiles outer), 2 (segments of K) and 4 (prefetch), got ", schedule);
  return schedule < 0 ? g_schedule.load() : g_schedule.exchange(schedule);
}

}  // namespace

SPECAV_FRAGMENT(m) {
  m.def("kq_matmul(Tensor x, Tensor[] weights, int[] qtypes, Tensor?[] biases) -> Tensor[]");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
  m.def("isa() -> str", &isa);  // no tensor arguments: one kernel for every dispatch key
  m.def("set_schedule(int schedule) -> int", &set_schedule);
  m.def("int8_peak(int iterations, int threads=1) -> float", &int8_peak);  // no tensor arguments, as isa
}

SPECAV_IMPL(m) {
  m.impl("kq_matmul", &specav_native::SPECAV_NS::kq_matmul);
  m.impl("quantize_activations", &quantize_activations);
}
