// One decoder layer of the packed forward (packed.py) in one call, where every linear layer of it
// runs kquant at the forward's row count (the drafter up to 8 rows, the target at one row):
//
//   q, k, v = kq_matmul(x, [Wq, Wk, Wv])        rope_(q), rope_(k)
//   each request's new k, v written into its cache at layer `layer`, positions P_b .. P_b + n_b - 1
//   h += o_proj(attention(q, caches)),  x' = rms_norm(h) by the post-attention norm
//   h += down(silu_mul(gate(x'), up(x'))),  returns rms_norm(h) by the next layer's input norm
//
// Where the MLP's linears do not run kquant at the forward's row count (the target verifying a few
// rows runs its large linears on int8dyn), the attention half (through the post-attention norm) is
// one call, attention_block_, and the MLP runs op by op. Consecutive whole layers are one call,
// decoder_layers_ (a one-row forward: all of them).
//
// It calls the very functions the per-op path calls (kquant.cpp, layers.cpp, through ops.h), in
// the same order, on the same tensors: its results equal that path's bit for bit (tested in
// tests/test_native_layers.py). What it saves is the way back to Python between them: a decoding
// layer is about ten ops of a few microseconds of arithmetic each, and every forward streams
// megabytes of weights between them, so each return to Python and each dispatch of a small op
// starts on cold caches (about 0.6 ms a layer outside the matmuls on the AVX2 machine,
// docs/quantized.md).

#include "ops.h"

#include <cstring>
#include <vector>

namespace {

namespace ops = specav_native::SPECAV_NS;

c10::List<std::optional<at::Tensor>> some(const c10::List<std::optional<at::Tensor>>& all, size_t first, size_t count) {
  c10::List<std::optional<at::Tensor>> out;
  out.reserve(count);
  for (size_t i = first; i < first + count; ++i) out.push_back(all.get(i));
  return out;
}

// The attention half of a layer: weights, qtypes, biases: q, k, v, o (4 each); cache_keys[b],
// cache_values[b]: request b's whole cache [L, capacity, Hkv, D], of which the first cached[b]
// positions are filled. h += o_proj(attention(...)) in place; returns rms_norm(h) by the
// post-attention norm. Called alone where the MLP's linears do not run kquant at this row count
// (the target verifying several rows: its large linears on int8dyn), the MLP then op by op.
at::Tensor attention_block_(at::Tensor& h, const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes,
                            const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& post_norm,
                            double post_eps, const at::Tensor& cos, const at::Tensor& sin, at::TensorList cache_keys,
                            at::TensorList cache_values, int64_t layer, at::IntArrayRef cached, at::IntArrayRef lengths,
                            int64_t heads, double scale) {
  TORCH_CHECK(weights.size() == 4 && qtypes.size() == 4 && biases.size() == 4,
              "weights, qtypes and biases: q, k, v, o (4 each)");
  const int64_t batch = static_cast<int64_t>(lengths.size()), t = x.size(0);
  TORCH_CHECK(batch >= 1 && static_cast<int64_t>(cached.size()) == batch &&
              static_cast<int64_t>(cache_keys.size()) == batch && static_cast<int64_t>(cache_values.size()) == batch,
              "one cache (keys, values) and one cached length per request");
  const int64_t kv_heads = cache_keys[0].size(2), d = cache_keys[0].size(3), row = kv_heads * d;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const at::Tensor &k = cache_keys[b], &v = cache_values[b];
    TORCH_CHECK(k.dim() == 4 && k.scalar_type() == at::kFloat && k.is_contiguous() && v.sizes() == k.sizes() &&
                v.scalar_type() == at::kFloat && v.is_contiguous() && k.size(2) == kv_heads && k.size(3) == d,
                "caches must be contiguous [L, capacity, Hkv, D] float32 tensors of one shape per layer");
    TORCH_CHECK(layer >= 0 && layer < k.size(0), "layer ", layer, " is outside the cache's ", k.size(0), " layers");
    TORCH_CHECK(lengths[b] >= 1 && cached[b] >= 0 && cached[b] + lengths[b] <= k.size(1), "request ", b, ": ",
                cached[b], " cached + ", lengths[b], " new positions exceed its cache's capacity ", k.size(1));
    total += lengths[b];
  }
  TORCH_CHECK(total == t, "lengths must sum to x's rows");

  auto qkv = ops::kq_matmul(x, weights.slice(0, 3), qtypes.slice(0, 3), some(biases, 0, 3));
  at::Tensor q = qkv[0].view({t, heads, d}), k = qkv[1].view({t, kv_heads, d}), v = qkv[2].view({t, kv_heads, d});
  ops::rope_(q, cos, sin);
  ops::rope_(k, cos, sin);
  std::vector<at::Tensor> keys, values;
  keys.reserve(batch);
  values.reserve(batch);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t b = 0, start = 0; b < batch; start += lengths[b], ++b) {
    at::Tensor kb = cache_keys[b].select(0, layer), vb = cache_values[b].select(0, layer);  // [capacity, Hkv, D]
    const size_t bytes = static_cast<size_t>(lengths[b] * row) * sizeof(float);
    std::memcpy(kb.data_ptr<float>() + cached[b] * row, kp + start * row, bytes);
    std::memcpy(vb.data_ptr<float>() + cached[b] * row, vp + start * row, bytes);
    keys.push_back(kb.narrow(0, 0, cached[b] + lengths[b]));
    values.push_back(vb.narrow(0, 0, cached[b] + lengths[b]));
  }
  const at::Tensor out = ops::attention(q, keys, values, lengths, scale);
  const at::Tensor o = ops::kq_matmul(out.view({t, heads * d}), weights.slice(3, 1), qtypes.slice(3, 1), some(biases, 3, 1))[0];
  return ops::add_rms_norm_(h, o, post_norm, post_eps);
}

// weights, qtypes, biases: q, k, v, o, gate, up, down (7 each); the caches as attention_block_'s.
at::Tensor decoder_layer_(at::Tensor& h, const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes,
                          const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& post_norm,
                          double post_eps, const at::Tensor& next_norm, double next_eps, const at::Tensor& cos,
                          const at::Tensor& sin, at::TensorList cache_keys, at::TensorList cache_values,
                          int64_t layer, at::IntArrayRef cached, at::IntArrayRef lengths, int64_t heads,
                          double scale) {
  TORCH_CHECK(weights.size() == 7 && qtypes.size() == 7 && biases.size() == 7,
              "weights, qtypes and biases: q, k, v, o, gate, up, down (7 each)");
  const at::Tensor normed = attention_block_(h, x, weights.slice(0, 4), qtypes.slice(0, 4), some(biases, 0, 4),
                                             post_norm, post_eps, cos, sin, cache_keys, cache_values, layer, cached,
                                             lengths, heads, scale);
  auto gate_up = ops::kq_matmul(normed, weights.slice(4, 2), qtypes.slice(4, 2), some(biases, 4, 2));
  const at::Tensor down = ops::kq_matmul(ops::silu_mul(gate_up[0], gate_up[1]), weights.slice(6, 1), qtypes.slice(6, 1),
                                         some(biases, 6, 1))[0];
  return ops::add_rms_norm_(h, down, next_norm, next_eps);
}

// Consecutive whole layers in one call: layer i of layers.size() as decoder_layer_ with weights,
// qtypes and biases 7i .. 7i + 6, post_norms[i], next_norms[i] (and their epsilons), layers[i] (its
// slot in each cache) and scales[i]; returns the last layer's normed output. A one-row forward of
// the packaged drafter is 24 layers of a few hundred microseconds each, and each return to Python
// between them (the loop, the next call's arguments) cost tens of microseconds.
at::Tensor decoder_layers_(at::Tensor& h, const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes,
                           const c10::List<std::optional<at::Tensor>>& biases, at::TensorList post_norms,
                           at::ArrayRef<double> post_eps, at::TensorList next_norms, at::ArrayRef<double> next_eps,
                           const at::Tensor& cos, const at::Tensor& sin, at::TensorList cache_keys,
                           at::TensorList cache_values, at::IntArrayRef layers, at::IntArrayRef cached,
                           at::IntArrayRef lengths, int64_t heads, at::ArrayRef<double> scales) {
  const size_t n = layers.size();
  TORCH_CHECK(n >= 1 && weights.size() == 7 * n && qtypes.size() == 7 * n && biases.size() == 7 * n &&
                  post_norms.size() == n && post_eps.size() == n && next_norms.size() == n && next_eps.size() == n &&
                  scales.size() == n,
              "per layer: 7 weights, qtypes and biases (q, k, v, o, gate, up, down), two norms, two epsilons and a scale");
  at::Tensor out = x;
  for (size_t i = 0; i < n; ++i) {
    out = decoder_layer_(h, out, weights.slice(7 * i, 7), qtypes.slice(7 * i, 7), some(biases, 7 * i, 7), post_norms[i],
                         post_eps[i], next_norms[i], next_eps[i], cos, sin, cache_keys, cache_values, layers[i], cached,
                         lengths, heads, scales[i]);
  }
  return out;
}

}  // namespace

SPECAV_FRAGMENT(m) {
  m.def("attention_block_(Tensor(a!) h, Tensor x, Tensor[] weights, int[] qtypes, Tensor?[] biases, Tensor post_norm, "
        "float post_eps, Tensor cos, Tensor sin, Tensor[] cache_keys, Tensor[] cache_values, int layer, int[] cached, "
        "int[] lengths, int heads, float scale) -> Tensor");
  m.def("decoder_layer_(Tensor(a!) h, Tensor x, Tensor[] weights, int[] qtypes, Tensor?[] biases, Tensor post_norm, "
        "float post_eps, Tensor next_norm, float next_eps, Tensor cos, Tensor sin, Tensor[] cache_keys, "
        "Tensor[] cache_values, int layer, int[] cached, int[] lengths, int heads, float scale) -> Tensor");
  m.def("decoder_layers_(Tensor(a!) h, Tensor x, Tensor[] weights, int[] qtypes, Tensor?[] biases, Tensor[] post_norms, "
        "float[] post_eps, Tensor[] next_norms, float[] next_eps, Tensor cos, Tensor sin, Tensor[] cache_keys, "
        "Tensor[] cache_values, int[] layers, int[] cached, int[] lengths, int heads, float[] scales) -> Tensor");
}

SPECAV_IMPL(m) {
  m.impl("attention_block_", &attention_block_);
  m.impl("decoder_layer_", &decoder_layer_);
  m.impl("decoder_layers_", &decoder_layers_);
}
