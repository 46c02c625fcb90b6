// A linear layer's bf16 and fp16 GEMMs through cached cuBLASLt plans (`cublaslt_gemm.h`), with
// PyTorch's operators where cuBLASLt would not run what PyTorch runs: the helpers of the C++
// linear nodes (gradient-accumulation fusion's, and the FP8 layers' weight gradient in the input's
// precision, `--no-fp8-wgrad`). Asked the question PyTorch's calls ask, cuBLASLt's heuristic gives
// the algorithms they run, so the results are PyTorch's bit for bit.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/tunable/Tunable.h>
#include <torch/version.h>

#include <type_traits>
#include <vector>

#include "cublaslt_gemm.h"
#include "weight_grad_target.h"

namespace megatron::linear {

// `tensor` as the 2-D [rows, its last dimension] matrix a linear layer multiplies (a view where
// the strides allow, as `reshape`).
inline at::Tensor flat(const at::Tensor& tensor) {
  return tensor.dim() == 2 ? tensor : tensor.reshape({-1, tensor.size(-1)});
}

// The rows of `tensor` flattened to 2-D (the product of all sizes but the last).
inline int64_t rows_of(const at::Tensor& tensor) {
  int64_t rows = 1;
  for (int64_t dim = 0; dim + 1 < tensor.dim(); ++dim) rows *= tensor.size(dim);
  return rows;
}

// `tensor`'s sizes with the last one replaced: the shape of a GEMM's 2-D output viewed as the
// layer's N-d output.
inline std::vector<int64_t> with_last(const at::Tensor& tensor, int64_t last) {
  std::vector<int64_t> sizes = tensor.sizes().vec();
  sizes.back() = last;
  return sizes;
}

// Whether `option` (a bool in older PyTorch, `CuBLASReductionOption` in newer) is PyTorch's
// default for bf16 and fp16 GEMMs: reductions in reduced precision (split-K) allowed.
template <typename Option>
bool reduced_precision_allowed(Option option) {
  if constexpr (std::is_same_v<Option, bool>) {
    return option;
  } else {
    return option == Option::AllowReducedPrecisionWithSplitK;
  }
}

// Whether PyTorch's fp16 accumulation or an SM carveout is set (settings of PyTorch 2.7 on).
inline bool accumulates_in_fp16_or_carves_out_sms(const at::Context& context) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
  return context.allowFP16AccumulationCuBLAS() || context._SMCarveout_EXPERIMENTAL().has_value();
#else
  (void)context;
  return false;
#endif
}

// Whether an [m, k] x [k, n] GEMM of `operand`'s layer may go through cuBLASLt: bf16 or fp16
// (fp32 products follow PyTorch's TF32 settings), every dimension above 1 (PyTorch sends
// matrix-vector products, and a bias added to them, to other cuBLAS kernels), under PyTorch's
// default GEMM settings, which the cached plans ask cuBLASLt for. Settings that change what
// PyTorch's GEMMs compute or where they run (`torch.use_deterministic_algorithms`, no
// reduced-precision reductions, fp16 accumulation, an SM carveout, TunableOp) keep PyTorch's
// GEMMs. (Under autocast, whose casts the nodes would skip, `grad_accumulation.linear` does not
// run them.)
inline bool uses_cublaslt(const at::Tensor& operand, int64_t m, int64_t n, int64_t k) {
  const at::ScalarType dtype = operand.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || m <= 1 || n <= 1 || k <= 1) return false;
  const at::Context& context = at::globalContext();
  if (context.deterministicAlgorithms() || accumulates_in_fp16_or_carves_out_sms(context) ||
      at::cuda::tunable::getTuningContext()->IsTunableOpEnabled()) {
    return false;
  }
  return reduced_precision_allowed(dtype == at::kHalf ? context.allowFP16ReductionCuBLAS()
                                                      : context.allowBF16ReductionCuBLAS());
}

// Whether the weight gradient `grad_2d^T @ input_2d` may go through cuBLASLt.
inline bool weight_gemm_applies(const at::Tensor& grad_2d, const at::Tensor& input_2d) {
  return uses_cublaslt(grad_2d, grad_2d.size(1), input_2d.size(1), grad_2d.size(0));
}

// `target (+)= grad_2d^T @ input_2d` in the target's dtype, as `grad_accumulation._fuse` on CUDA.
inline void fuse(const at::Tensor& target, bool overwrite, const at::Tensor& grad_2d,
                 const at::Tensor& input_2d) {
  if (weight_gemm_applies(grad_2d, input_2d) &&
      cublaslt::gemm(target, /*accumulate=*/!overwrite, grad_2d.t(), input_2d)) {
    return;
  }
  at::Tensor main_grad = target;
  const int beta = overwrite ? 0 : 1;
  if (main_grad.scalar_type() == grad_2d.scalar_type()) {
    main_grad.addmm_(grad_2d.t(), input_2d, beta);
  } else {
    at::addmm_out(main_grad, main_grad, grad_2d.t(), input_2d, main_grad.scalar_type(), beta);
  }
}

// The weight gradient `grad_2d^T @ input` (flattened) where `target` says, as
// `grad_accumulation.weight_grad_into`: returned in the inputs' dtype, or undefined where it went
// into the engine's tensor or the backward wants none.
inline at::Tensor weight_grad_into(const WeightGradTarget& target, const at::Tensor& grad_2d,
                                   const at::Tensor& input) {
  if (!target.wanted) return at::Tensor();
  const at::Tensor input_2d = flat(input);
  if (target.tensor.defined()) {
    fuse(target.tensor, target.overwrite, grad_2d, input_2d);
    return at::Tensor();
  }
  if (weight_gemm_applies(grad_2d, input_2d)) {
    at::Tensor out = at::empty({grad_2d.size(1), input_2d.size(1)}, grad_2d.options());
    if (cublaslt::gemm(out, /*accumulate=*/false, grad_2d.t(), input_2d)) return out;
  }
  return grad_2d.t().matmul(input_2d);
}

}  // namespace megatron::linear
