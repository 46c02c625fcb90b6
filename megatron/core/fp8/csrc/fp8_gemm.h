// FP8 GEMMs through cuBLASLt with the problem's descriptors and algorithm cached
// (`fp8_gemm.cpp`): the products `torch._scaled_mm` computes, with its settings, without its
// per-call descriptor set-up and heuristic query (about half its host time inside a training
// step), and with the sum into an fp32 output done by the GEMM.

#pragma once

#include <ATen/core/Tensor.h>

namespace megatron_fp8 {

// `a @ b * a_scale_inv * b_scale_inv (+ bias) (+ addend)` into a new [m, n] tensor of
// `out_dtype` (bf16, fp16 or fp32): `a` [m, k] row-major and `b` [k, n] column-major FP8 (not
// both E5M2), the scales one fp32 element each, `bias` [n] of `out_dtype` (bf16 or fp16;
// undefined: none); `fast_accum`: Hopper's faster, less exact accumulation; `addend` [m, n] of
// `out_dtype` (undefined: none) added in the GEMM (rounded once with the product) where
// cuBLASLt takes it, else after.
at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                     const at::Tensor& b_scale_inv, const at::Tensor& bias,
                     at::ScalarType out_dtype, bool fast_accum,
                     const at::Tensor& addend = at::Tensor());

// The same product written over (`accumulate` false) or added to (`accumulate` true: fp32
// only) the contiguous [m, n] `out`, without a bias.
void scaled_mm_into(const at::Tensor& out, bool accumulate, const at::Tensor& a,
                    const at::Tensor& b, const at::Tensor& a_scale_inv,
                    const at::Tensor& b_scale_inv);

}  // namespace megatron_fp8
