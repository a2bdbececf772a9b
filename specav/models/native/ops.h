// The native ops that another translation unit calls: decoder.cpp composes a whole decoder layer
// from kquant.cpp's matmul and layers.cpp's ops. Declared in the variant's own namespace, so the
// libraries of two variants loaded side by side (the tests load every one) never share a symbol.
#pragma once

#include "common.h"

#include <optional>
#include <vector>

namespace specav_native::SPECAV_NS {

// kquant.cpp: y_i = x @ W_i^T (+ b_i) for Q4_K / Q6_K weights sharing the input x.
std::vector<at::Tensor> kq_matmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes,
                                  const c10::List<std::optional<at::Tensor>>& biases);

// layers.cpp: the small float32 operations between a layer's matmuls.
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& y, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u);
at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor attention(const at::Tensor& q, at::TensorList keys, at::TensorList values, at::IntArrayRef lengths,
                     double scale);

}  // namespace specav_native::SPECAV_NS
