// Rejection sampling of a ragged batch whose q and p rows are carried as candidates
// (verification/rejection.py wraps it and owns the rule; its vectorised torch path is the
// reference this follows, step for step). With the caches cold after the target's forward, the
// torch path's thirty-odd small ops cost about 0.7 ms a step; this is one call.
//
//   rejection_candidates(x, q_ids, q_probs, p_ids, p_probs, counts, uniforms, last_uniforms, residual_eps)
//       -> (num_accepted, last_tokens)
//   x # [S] int64: the admitted draft tokens, request after request (counts[b] each);
//   q_ids / q_probs # [S, Wq]: q_i of those slots as candidates (ids ascending, padding = V, prob 0);
//   p_ids / p_probs # [S + B, Wp]: p_i, request b's counts[b] slot rows and then its bonus row;
//   uniforms # [S] float64: phase 1 of the draw order; last_uniforms: one float64 per request (phase 2);
//   num_accepted # [B] int64, last_tokens # [B] int64: each request's recovered or bonus token.
//
// Slot i is accepted iff u_i * q_i(x_i) < p_i(x_i) (in float64); at the first rejected slot the
// last token is drawn from max(0, p_i - q_i) on p's candidates (float32, as torch's clamp(p - q, 0)),
// or from p_i where that residual's mass is <= residual_eps; with every slot accepted, from the bonus
// row. The draw is sampling.sample's inverse CDF (float64 running sums in ascending id order). The
// residual's mass is summed in float64 where torch sums float32 lanes: the two differ by rounding
// only, so they could disagree only on a mass within rounding of residual_eps (1e-6).

#include "common.h"

#include <cmath>
#include <vector>

namespace {

// A row's probability of `token` among its w candidates (0 where it is not one of them).
inline float lookup(const int64_t* ids, const float* probs, int64_t w, int64_t token) {
  for (int64_t j = 0; j < w; ++j)
    if (ids[j] == token) return probs[j];
  return 0.0f;
}

std::tuple<at::Tensor, at::Tensor> rejection_candidates(const at::Tensor& x, const at::Tensor& q_ids, const at::Tensor& q_probs,
                                                        const at::Tensor& p_ids, const at::Tensor& p_probs,
                                                        at::IntArrayRef counts, const at::Tensor& uniforms,
                                                        at::ArrayRef<double> last_uniforms, double residual_eps) {
  const int64_t b_count = static_cast<int64_t>(counts.size()), s = x.size(0);
  const int64_t wq = q_probs.size(1), wp = p_probs.size(1);
  TORCH_CHECK(x.scalar_type() == at::kLong && x.dim() == 1 && x.is_contiguous(), "x must be a contiguous [S] int64 tensor");
  TORCH_CHECK(q_ids.scalar_type() == at::kLong && q_probs.scalar_type() == at::kFloat && q_ids.sizes() == q_probs.sizes() &&
              q_probs.dim() == 2 && q_probs.size(0) == s && q_ids.is_contiguous() && q_probs.is_contiguous(),
              "q_ids / q_probs must be contiguous [S, Wq] int64 / float32 tensors");
  TORCH_CHECK(p_ids.scalar_type() == at::kLong && p_probs.scalar_type() == at::kFloat && p_ids.sizes() == p_probs.sizes() &&
              p_probs.dim() == 2 && p_probs.size(0) == s + b_count && p_ids.is_contiguous() && p_probs.is_contiguous(),
              "p_ids / p_probs must be contiguous [S + B, Wp] int64 / float32 tensors");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.dim() == 1 && uniforms.size(0) == s && uniforms.is_contiguous(),
              "uniforms must be a contiguous [S] float64 tensor");
  TORCH_CHECK(static_cast<int64_t>(last_uniforms.size()) == b_count, "last_uniforms needs one value per request");
  auto num_accepted = at::empty({b_count}, x.options());
  auto last_tokens = at::empty({b_count}, x.options());
  const int64_t* xp = x.data_ptr<int64_t>();
  const int64_t* qi = q_ids.data_ptr<int64_t>();
  const float* qp = q_probs.data_ptr<float>();
  const int64_t* pi = p_ids.data_ptr<int64_t>();
  const float* pp = p_probs.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  std::vector<float> residual(wp);
  int64_t d = 0;  // request b's first slot; its first target row is d + b
  for (int64_t b = 0; b < b_count; ++b) {
    const int64_t k = counts[b], t = d + b;
    TORCH_CHECK(k >= 0 && d + k <= s, "counts must be >= 0 and sum to S");
    int64_t n = k;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t token = xp[d + i];
      const double px = lookup(pi + (t + i) * wp, pp + (t + i) * wp, wp, token);
      const double qx = lookup(qi + (d + i) * wq, qp + (d + i) * wq, wq, token);
      if (!(up[d + i] * qx < px)) {
        n = i;
        break;
      }
    }
    const int64_t row = t + n;
    const float* weights = pp + row * wp;
    if (n < k) {  // the residual on p's candidates, against q at the rejected slot
      double mass = 0.0;
      for (int64_t j = 0; j < wp; ++j) {
        const float q = lookup(qi + (d + n) * wq, qp + (d + n) * wq, wq, pi[row * wp + j]);
        residual[j] = std::max(weights[j] - q, 0.0f);
        mass += residual[j];
      }
      if (static_cast<float>(mass) > static_cast<float>(residual_eps)) weights = residual.data();  // as torch compares
    }
    num_accepted.data_ptr<int64_t>()[b] = n;
    double total = 0.0;
    for (int64_t j = 0; j < wp; ++j) total += weights[j];
    TORCH_CHECK(wp > 0 && std::isfinite(total) && total > 0.0, "rejection_candidates: a last-token row without weight");
    last_tokens.data_ptr<int64_t>()[b] = pi[row * wp + specav_native::inverse_cdf(weights, wp, last_uniforms[b])];
    d += k;
  }
  TORCH_CHECK(d == s, "counts must sum to S");
  return {num_accepted, last_tokens};
}

}  // namespace

SPECAV_FRAGMENT(m) {
  m.def("rejection_candidates(Tensor x, Tensor q_ids, Tensor q_probs, Tensor p_ids, Tensor p_probs, int[] counts, "
        "Tensor uniforms, float[] last_uniforms, float residual_eps) -> (Tensor, Tensor)");
}

SPECAV_IMPL(m) {
  m.impl("rejection_candidates", &rejection_candidates);
}
