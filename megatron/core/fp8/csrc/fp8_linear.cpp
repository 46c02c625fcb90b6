// The host path of an FP8 linear layer's forward and backward in one C++ call each
// (`megatron/core/fp8/cpp_linear.py` builds and loads it; `linear.py` calls it).
//
// In Python each cast and each GEMM of an FP8 linear layer costs the host tens of microseconds
// (argument handling, three allocations, a Triton launch, the Fp8Tensor bookkeeping); a step of
// small layers is bound by that host time. Here the forward's cast and GEMM, and the backward's
// cast, its two GEMMs, the bias gradient and (at a weight's first backward) the weight's
// transposed copy, run from one call each, which also flattens the layer's N-d input and shapes
// its outputs: the casts are the Triton kernels' arithmetic (`fp8_kernels.cu`) and the GEMMs
// `torch._scaled_mm`'s (`fp8_gemm.cpp`), so the results are the Python path's bit for bit.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "error_text.h"
#include "fp8_gemm.h"
#include "fp8_kernels.h"

namespace megatron_fp8 {
namespace {

at::ScalarType fp8_dtype(bool e4m3) {
  return e4m3 ? at::ScalarType::Float8_e4m3fn : at::ScalarType::Float8_e5m2;
}

// Checks that `tensor` is one fp32 element on `device` (a scale or an amax record).
void check_scalar(const at::Tensor& tensor, const at::Device& device, const char* what) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.numel() == 1 &&
                  tensor.device() == device,
              "fp8 cast: the ", what, " must be one fp32 element on ", text(device), ", got ",
              text(tensor.scalar_type()), " ", text(tensor.sizes()), " on ",
              text(tensor.device()));
}

// The cast of a 2-D tensor (`fp8_kernels.h`'s `launch_cast`), with the scale given (delayed
// scaling) or, when `scale` is undefined, from the tensor's own absolute maximum (current
// scaling): {row-major FP8 or undefined, the scale's inverse, the transposed copy or undefined}.
std::vector<at::Tensor> cast_impl(const at::Tensor& input, const at::Tensor& scale,
                                  const at::Tensor& record, bool e4m3, bool rowwise,
                                  bool transpose) {
  TORCH_CHECK(input.dim() == 2 && input.is_cuda(), "fp8 cast: a 2-D CUDA tensor, got ",
              text(input.sizes()), " on ", text(input.device()));
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "fp8 cast: bf16, fp16 or fp32 input, got ", text(dtype));
  const int64_t rows = input.size(0), cols = input.size(1);
  TORCH_CHECK(cols <= kMaxCastColumns, "fp8 cast: at most ", text(kMaxCastColumns),
              " columns, got ", text(cols));
  if (scale.defined()) check_scalar(scale, input.device(), "scale");
  if (record.defined()) check_scalar(record, input.device(), "amax record");
  const at::Tensor x = input.contiguous();
  const int64_t padded_rows =
      (rows + kTransposedRowAlignment - 1) / kTransposedRowAlignment * kTransposedRowAlignment;
  const auto byte_options = x.options().dtype(fp8_dtype(e4m3));
  const auto float_options = x.options().dtype(at::kFloat);
  const bool from_amax = !scale.defined();
  const at::Tensor scale_source = from_amax ? at::zeros({}, float_options) : scale;
  at::Tensor scale_inv = at::empty(scale_source.sizes(), float_options);
  at::Tensor out = rowwise ? at::empty({rows, cols}, byte_options) : at::Tensor();
  at::Tensor out_t = transpose ? at::empty({cols, padded_rows}, byte_options) : at::Tensor();
  if (x.numel() == 0) {
    if (transpose) out_t.zero_();
    if (from_amax) {
      scale_inv.fill_(1.f);  // the scale of an empty tensor: 1, as its amax is 0
    } else {
      at::reciprocal_out(scale_inv, scale);
    }
    return {out, scale_inv, out_t};
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (from_amax) C10_CUDA_CHECK(launch_amax(x, scale_source, stream));
  C10_CUDA_CHECK(
      launch_cast(x, scale_source, from_amax, record, e4m3, out, out_t, scale_inv, stream));
  if (from_amax && record.defined()) {
    // Current scaling's amax (the scale's source) max-ed into the record, as `quantize` does.
    at::Tensor destination = record;
    at::maximum_out(destination, record, scale_source.reshape(record.sizes()));
  }
  return {out, scale_inv, out_t};
}

at::Tensor optional_or_undefined(const c10::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? *tensor : at::Tensor();
}

// Checks, before a device guard is made for it, that `x` is on a GPU.
void check_cuda(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_cuda(), "fp8 ", what, ": a CUDA tensor, got one on ", text(x.device()));
}

std::vector<at::Tensor> cast(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                             const c10::optional<at::Tensor>& record, bool e4m3, bool rowwise,
                             bool transpose) {
  check_cuda(x, "cast");
  const c10::cuda::CUDAGuard guard(x.device());
  return cast_impl(x, optional_or_undefined(scale), optional_or_undefined(record), e4m3,
                   rowwise, transpose);
}

// `data.t().contiguous()` for a 2-D FP8 tensor on the GPU (a weight's transposed copy).
at::Tensor transpose(const at::Tensor& data) {
  TORCH_CHECK(data.dim() == 2 && data.is_cuda() && data.element_size() == 1,
              "fp8 transpose: a 2-D CUDA tensor of 1-byte elements, got ",
              text(data.scalar_type()), " ", text(data.sizes()), " on ", text(data.device()));
  TORCH_CHECK(data.size(0) <= kMaxTransposeRows, "fp8 transpose: at most ",
              text(kMaxTransposeRows), " rows, got ", text(data.size(0)));
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor contiguous = data.contiguous();
  at::Tensor out = at::empty({data.size(1), data.size(0)}, data.options());
  if (data.numel() > 0) {
    C10_CUDA_CHECK(launch_transpose(contiguous, out, at::cuda::getCurrentCUDAStream()));
  }
  return out;
}

// `tensor` as the 2-D [rows, its last dimension] matrix the layer's GEMMs multiply (a view
// where the strides allow, as `reshape`).
at::Tensor flat(const at::Tensor& tensor) {
  return tensor.dim() == 2 ? tensor : tensor.reshape({-1, tensor.size(-1)});
}

// `tensor`'s sizes with the last one replaced by `last`: the shape of a GEMM's 2-D output
// viewed as the layer's N-d output.
std::vector<int64_t> with_last(const at::Tensor& tensor, int64_t last) {
  std::vector<int64_t> sizes = tensor.sizes().vec();
  sizes.back() = last;
  return sizes;
}

// Forward: `x` (any leading dimensions) cast (and, with `transpose`, its transposed copy for the
// weight gradient), then `x_fp8 @ weight^T + bias` in `x`'s leading dimensions, `weight` the
// FP8 weight `[out, in]` row-major; the bias in the GEMM where cuBLASLt takes it (a bf16 /
// fp16 output of the bias's dtype), else added after. Returns {out, the transposed copy or
// undefined, its scale's inverse}.
std::vector<at::Tensor> linear_forward(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                                       const c10::optional<at::Tensor>& record, bool e4m3,
                                       bool transpose, const at::Tensor& weight,
                                       const at::Tensor& weight_scale_inv,
                                       const c10::optional<at::Tensor>& bias, bool fast_accum) {
  check_cuda(x, "linear forward");
  // Checked before the cast, which records the input's amax: a refused call changes nothing.
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && weight.size(1) == x.size(-1),
              "fp8 linear forward: an input [..., in] and a weight [out, in], got ",
              text(x.sizes()), " and ", text(weight.sizes()));
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                                    bias->device() == x.device()),
              "fp8 linear forward: the bias must be [", text(weight.size(0)), "] on ",
              text(x.device()));
  const c10::cuda::CUDAGuard guard(x.device());
  auto cast_out = cast_impl(flat(x), optional_or_undefined(scale), optional_or_undefined(record),
                            e4m3, /*rowwise=*/true, transpose);
  const at::ScalarType out_dtype = x.scalar_type();
  const bool fused_bias =
      bias.has_value() && out_dtype != at::kFloat && bias->scalar_type() == out_dtype;
  at::Tensor out = scaled_mm(cast_out[0], weight.t(), cast_out[1], weight_scale_inv,
                             fused_bias ? bias->contiguous() : at::Tensor(), out_dtype,
                             fast_accum);
  if (bias.has_value() && !fused_bias) out = out + *bias;
  return {out.view(with_last(x, weight.size(0))), cast_out[2], cast_out[1]};
}

enum WgradMode : int64_t { kReturn = 0, kOverwrite = 1, kCopy = 2, kAccumulate = 3 };

// Backward: the output gradient `grad` (any leading dimensions) cast (with its transposed copy
// where the weight gradient is wanted), the input gradient `grad_fp8 @ weight` in `input_dtype`
// and `grad`'s leading dimensions, from the weight's contiguous transpose `weight_transposed`
// (`[in, out]`; made here from `weight`, `[out, in]` row-major, when not given), the weight
// gradient `grad_t @ input_t^T` (returned in `wgrad_dtype`, or written, copied or added into
// `target` by `wgrad_mode`; an fp32 target's sum in the GEMM), and the bias gradient (the
// high-precision gradient's column sums). Returns {input gradient, weight gradient (kReturn
// only), bias gradient, the weight's transpose where made here}, each undefined where not asked
// for (the caller keeps the transpose for the weight's next backward).
std::vector<at::Tensor> linear_backward(
    const at::Tensor& grad, const c10::optional<at::Tensor>& scale,
    const c10::optional<at::Tensor>& record, bool e4m3, bool need_input,
    const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& weight_transposed,
    const c10::optional<at::Tensor>& weight_scale_inv, at::ScalarType input_dtype,
    bool need_wgrad, const c10::optional<at::Tensor>& input_t,
    const c10::optional<at::Tensor>& input_scale_inv, int64_t wgrad_mode,
    const c10::optional<at::Tensor>& target, at::ScalarType wgrad_dtype, bool need_bias) {
  check_cuda(grad, "linear backward");
  const c10::cuda::CUDAGuard guard(grad.device());
  TORCH_CHECK(grad.dim() >= 1, "fp8 linear backward: a gradient of at least one dimension");
  TORCH_CHECK(!need_input || ((weight.has_value() || weight_transposed.has_value()) &&
                              weight_scale_inv.has_value()),
              "fp8 linear backward: the input gradient needs weight or weight_transposed, and "
              "weight_scale_inv");
  // Checked before the cast, which records the gradient's amax.
  if (need_input) {
    const int64_t out = grad.size(-1);
    const bool fits = weight_transposed.has_value()
                          ? weight_transposed->dim() == 2 && weight_transposed->size(1) == out
                          : weight->dim() == 2 && weight->size(0) == out;
    TORCH_CHECK(fits, "fp8 linear backward: a weight [", text(out),
                ", in] (or its transpose [in, ", text(out), "]) for a gradient [..., ",
                text(out), "]");
  }
  TORCH_CHECK(!need_wgrad || (input_t.has_value() && input_scale_inv.has_value()),
              "fp8 linear backward: the weight gradient needs input_t and input_scale_inv");
  if (need_wgrad && wgrad_mode != kReturn) {
    TORCH_CHECK(target.has_value(), "fp8 linear backward: weight-gradient mode ",
                text(wgrad_mode), " writes into a target; none given");
    const std::vector<int64_t> expected_sizes = {grad.size(-1), input_t->size(0)};
    const at::IntArrayRef expected(expected_sizes);
    TORCH_CHECK(target->sizes() == expected && target->device() == grad.device(),
                "fp8 linear backward: the weight-gradient target must be ", text(expected),
                " on ", text(grad.device()), ", got ", text(target->sizes()), " on ",
                text(target->device()));
    TORCH_CHECK(wgrad_mode != kOverwrite || target->is_contiguous(),
                "fp8 linear backward: mode ", text(wgrad_mode),
                " writes the GEMM's output into the target, which must be contiguous");
    const at::ScalarType dtype = target->scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
                "fp8 linear backward: a bf16, fp16 or fp32 weight-gradient target, got ",
                text(dtype));
  }
  const at::Tensor grad_2d = flat(grad);
  at::Tensor made_transpose;
  at::Tensor grad_input, grad_weight, grad_bias;
  if (need_input || need_wgrad) {
    auto cast_out = cast_impl(grad_2d, optional_or_undefined(scale),
                              optional_or_undefined(record), e4m3, /*rowwise=*/need_input,
                              /*transpose=*/need_wgrad);
    if (need_input) {
      at::Tensor transposed;
      if (weight_transposed.has_value()) {
        transposed = *weight_transposed;
      } else {
        made_transpose = transpose(*weight);
        transposed = made_transpose;
      }
      grad_input = scaled_mm(cast_out[0], transposed.t(), cast_out[1], *weight_scale_inv,
                             at::Tensor(), input_dtype, /*fast_accum=*/false);
      grad_input = grad_input.view(with_last(grad, transposed.size(0)));
    }
    if (need_wgrad) {
      const at::Tensor& a = cast_out[2];
      const at::Tensor b = input_t->t();
      const at::Tensor& a_scale_inv = cast_out[1];
      switch (wgrad_mode) {
        case kReturn:
          grad_weight = scaled_mm(a, b, a_scale_inv, *input_scale_inv, at::Tensor(),
                                  wgrad_dtype, false);
          break;
        case kOverwrite:
          scaled_mm_into(*target, /*accumulate=*/false, a, b, a_scale_inv, *input_scale_inv);
          break;
        case kCopy:
          target->copy_(scaled_mm(a, b, a_scale_inv, *input_scale_inv, at::Tensor(),
                                  target->scalar_type(), false));
          break;
        case kAccumulate:
          if (target->scalar_type() == at::kFloat && target->is_contiguous()) {
            scaled_mm_into(*target, /*accumulate=*/true, a, b, a_scale_inv, *input_scale_inv);
          } else {
            target->add_(scaled_mm(a, b, a_scale_inv, *input_scale_inv, at::Tensor(),
                                   target->scalar_type(), false));
          }
          break;
        default:
          TORCH_CHECK(false, "fp8 linear backward: unknown weight-gradient mode ",
                      text(wgrad_mode));
      }
    }
  }
  if (need_bias) grad_bias = grad_2d.sum(0);
  return {grad_input, grad_weight, grad_bias, made_transpose};
}

}  // namespace
}  // namespace megatron_fp8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace megatron_fp8;
  m.def("cast", &cast, "FP8 cast of a 2-D CUDA tensor (and its padded transposed copy)",
        py::arg("x"), py::arg("scale"), py::arg("record"), py::arg("e4m3"),
        py::arg("rowwise") = true, py::arg("transpose") = true);
  m.def("transpose", &transpose, "The contiguous transpose of a 2-D FP8 CUDA tensor",
        py::arg("data"));
  m.def("linear_forward", &linear_forward, "An FP8 linear layer's forward: cast, then GEMM",
        py::arg("x"), py::arg("scale"), py::arg("record"), py::arg("e4m3"),
        py::arg("transpose"), py::arg("weight"), py::arg("weight_scale_inv"), py::arg("bias"),
        py::arg("fast_accum"));
  m.def("linear_backward", &linear_backward,
        "An FP8 linear layer's backward: cast, input- and weight-gradient GEMMs, bias gradient",
        py::arg("grad"), py::arg("scale"), py::arg("record"), py::arg("e4m3"),
        py::arg("need_input"), py::arg("weight"), py::arg("weight_transposed"),
        py::arg("weight_scale_inv"),
        py::arg("input_dtype"), py::arg("need_wgrad"), py::arg("input_t"),
        py::arg("input_scale_inv"), py::arg("wgrad_mode"), py::arg("target"),
        py::arg("wgrad_dtype"), py::arg("need_bias"));
}
