// The small float32 operations of a decoder layer, each one call instead of several torch ops.
//
// Between the large matmuls of a layer sit norms, rotary embedding, attention and the MLP's
// gate; on one decoding row each is a few microseconds of work, but as torch ops they cost
// 5-60 us each in dispatch, temporaries and threading (about a quarter of a decoding
// forward with the quantized weights). These do the same arithmetic in one pass each:
//
//   rms_norm(x, w, eps)            x * rsqrt(mean(x^2) + eps) * w            (transformers' RMSNorm)
//   add_rms_norm_(h, y, w, eps)    h += y, then rms_norm(h)                  (residual + next norm)
//   silu_mul(g, u)                 silu(g) * u                               (the gated MLP)
//   rope_(x, cos, sin)             x cos + rotate_half(x) sin, in place      (transformers' rotary)
//   attention(q, keys, values, lengths, scale)
//       causal attention of packed queries against each request's own cache, grouped-query:
//       query j of request b sees its cache's first P_b + j + 1 positions, P_b = len(keys[b]) - n_b.
//
// Results agree with the torch ops to float32 rounding (summation order and a polynomial
// exp differ), tested against them in tests/test_native_layers.py. Every row's result
// depends only on that row (and its request's cache): batch-invariant.

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using specav_native::exp8;
using specav_native::hsum;

inline float exp1(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp8(_mm256_set1_ps(x)));
  return lanes[0];
}

// s[i] <- e^(s[i] - max s), in place; returns their sum.
float softmax_numerators(float* s, int64_t n) {
  const float m = *std::max_element(s, s + n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  for (; i < n; ++i) total += (s[i] = exp1(s[i] - m));
  return total;
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              name, " must be a contiguous 2-D float32 tensor");
}

// Grain for at::parallel_for over rows of `width` floats: about 16k elements per task, so one
// decoding row stays on the calling thread (waking another costs more than the row).
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * h;
      float* o = out + t * h;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= h; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float sum = hsum(acc);
      for (; i < h; ++i) sum += xr[i] * xr[i];
      const float r = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
      for (i = 0; i < h; ++i) o[i] = (xr[i] * r) * w[i];
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous float32 vector of x's width");
  auto out = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                static_cast<float>(eps));
  return out;
}

inline float dot(const float* a, const float* b, int64_t d) {  // d: a multiple of 8
  // Four accumulators: one chain of dependent FMAs would wait on each one's latency.
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= d; i += 32)
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j), acc[j]);
  for (; i < d; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// out[0:d] = scale * sum_i p[i] * v[i * stride + 0:d], d a multiple of 8. Columns go in blocks of
// 64 held in 8 registers over all i (8 independent FMA chains), then blocks of 8.
void weighted_sum(const float* p, int64_t n, const float* v, int64_t stride, int64_t d, float scale, float* out) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i]);
      const float* vi = v + i * stride + c;
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * j), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + c + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(scale)));
  }
  for (; c < d; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v + i * stride + c), acc);
    _mm256_storeu_ps(out + c, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
  }
}

}  // namespace

namespace specav_native::SPECAV_NS {

at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& y, const at::Tensor& w, double eps) {
  check_rows(h, "h");
  check_rows(y, "y");
  TORCH_CHECK(h.sizes() == y.sizes(), "h and y must have one shape");
  h.add_(y);
  return rms_norm(h, w, eps);
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  check_rows(g, "g");
  check_rows(u, "u");
  TORCH_CHECK(g.sizes() == u.sizes(), "g and u must have one shape");
  auto out = at::empty_like(g);
  const int64_t total = g.numel();
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (total + 7) / 8, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = 8 * c;
      if (i + 8 <= total) {  // silu(g) = g / (1 + e^-g)
        const __m256 gv = _mm256_loadu_ps(gp + i);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(op + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
      } else {
        for (int64_t j = i; j < total; ++j) op[j] = gp[j] / (1.0f + exp1(-gp[j])) * up[j];
      }
    }
  });
  return out;
}

// x [T, heads, D] in place; cos, sin [T, D] (transformers' rotary: both halves of cos equal,
// likewise sin). rotate_half(x) = cat(-x2, x1).
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous [T, heads, D] float32 tensor");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t t_count = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == t_count && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, D] with D even");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, t_count, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * d, *s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
  return x;
}

// q [T, H, D]; keys[b], values[b] [P_b + n_b, Hkv, D] (a request's cache up to its new tokens);
// lengths[b] = n_b, summing to T. Work items: (packed row, kv head); each does the H / Hkv
// query heads that share the kv head, so each cached key and value is read once per item.
at::Tensor attention(const at::Tensor& q, at::TensorList keys, at::TensorList values, at::IntArrayRef lengths,
                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous [T, H, D] float32 tensor");
  const int64_t t_count = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  TORCH_CHECK(d % 8 == 0, "head dim must be a multiple of 8, got ", d);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == batch && static_cast<int64_t>(values.size()) == batch,
              "one keys and one values tensor per request");
  const int64_t kv_heads = batch ? keys[0].size(1) : 1;
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  std::vector<int64_t> request_of(t_count), query_of(t_count);  // packed row -> (request, query index)
  int64_t row = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor &k = keys[b], &v = values[b];
    TORCH_CHECK(k.dim() == 3 && k.size(1) == kv_heads && k.size(2) == d && k.scalar_type() == at::kFloat &&
                k.is_contiguous() && v.sizes() == k.sizes() && v.scalar_type() == at::kFloat && v.is_contiguous(),
                "keys and values must be contiguous [P + n, Hkv, D] float32 tensors");
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= k.size(0), "request ", b, " has ", lengths[b], " queries but ",
                k.size(0), " cached positions");
    for (int64_t j = 0; j < lengths[b]; ++j, ++row) {
      TORCH_CHECK(row < t_count, "lengths sum past q's rows");
      request_of[row] = b;
      query_of[row] = j;
    }
  }
  TORCH_CHECK(row == t_count, "lengths must sum to q's rows");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, t_count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, kvh = item % kv_heads, b = request_of[t];
      const int64_t seen = keys[b].size(0) - lengths[b] + query_of[t] + 1;  // causal: P_b + j + 1 positions
      const float* kp = keys[b].data_ptr<float>() + kvh * d;
      const float* vp = values[b].data_ptr<float>() + kvh * d;
      const int64_t stride = kv_heads * d;  // between positions
      scores.resize(group * seen);
      for (int64_t i = 0; i < seen; ++i) {
        const float* k = kp + i * stride;
        for (int64_t g = 0; g < group; ++g) scores[g * seen + i] = sc * dot(qp + (t * heads + kvh * group + g) * d, k, d);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * seen;
        const float total = softmax_numerators(s, seen);
        weighted_sum(s, seen, vp, stride, d, 1.0f / total, op + (t * heads + kvh * group + g) * d);
      }
    }
  });
  return out;
}

}  // namespace specav_native::SPECAV_NS

SPECAV_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor y, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("attention(Tensor q, Tensor[] keys, Tensor[] values, int[] lengths, float scale) -> Tensor");
}

SPECAV_IMPL(m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &specav_native::SPECAV_NS::add_rms_norm_);
  m.impl("silu_mul", &specav_native::SPECAV_NS::silu_mul);
  m.impl("rope_", &specav_native::SPECAV_NS::rope_);
  m.impl("attention", &specav_native::SPECAV_NS::attention);
}
