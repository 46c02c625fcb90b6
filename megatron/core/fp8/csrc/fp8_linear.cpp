// An FP8 linear layer as one C++ autograd node (`megatron/core/fp8/cpp_linear.py` builds and
// loads it; `linear.py` calls it), and the cast and transpose it runs, for Python too.
//
// In Python each cast and each GEMM of an FP8 linear layer costs the host tens of microseconds
// (argument handling, allocations, a Triton launch, the Fp8Tensor bookkeeping), and a Python
// autograd function as many again (its frames forward and backward, its context object); a step
// of small layers is bound by that host time. Here the forward's cast and GEMM, and the
// backward's cast, its two GEMMs and the bias gradient, run in the node, which also flattens the
// layer's N-d input and shapes its outputs; the backward asks Python once, with the GIL taken for
// that call alone, where the weight gradient goes and for the FP8 weight's transpose (both the
// engine's state: `linear.native_backward_inputs`). The casts are the Triton kernels' arithmetic
// (`fp8_kernels.cu`) and the GEMMs `torch._scaled_mm`'s (`fp8_gemm.cpp`), so the results are the
// Python path's bit for bit.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include "error_text.h"
#include "fp8_gemm.h"
#include "fp8_kernels.h"
#include "linear_gemms.h"
#include "once_differentiable.h"
#include "weight_grad_target.h"

namespace megatron_fp8 {
namespace {

using megatron::linear::flat;
using megatron::linear::with_last;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// `transpose` of each of `data`: one call from Python for a group of weights (an engine's
// unit's, whose backward needs them all), each a launch.
std::vector<at::Tensor> transpose_all(const std::vector<at::Tensor>& data) {
  std::vector<at::Tensor> transposed;
  transposed.reserve(data.size());
  for (const at::Tensor& tensor : data) transposed.push_back(transpose(tensor));
  return transposed;
}

// Python's `linear.native_backward_inputs(weight, accumulates, need_input)`, set once at load.
// Never destroyed: the interpreter may be gone when static destructors run.
py::object* backward_callback = new py::object();

// What a layer's forward takes besides its input, weight and bias: the caller's lookups.
struct LayerArgs {
  // The input cast's scale and amax record (undefined: scaled by the input's own amax; not
  // recorded), and the output gradient's, for the backward (a delayed-scaling state's views,
  // written in place, so the backward's cast reads their values then).
  at::Tensor scale, record, grad_scale, grad_record;
  // The weight's FP8 bytes, `[out, in]` row-major, and its scale's inverse.
  at::Tensor weight_data, weight_scale_inv;
  bool e4m3_forward, e4m3_backward;
  // The weight gradient's GEMM in FP8 (else in the input's precision, from the input).
  bool fp8_wgrad;
  // The forward GEMM's fast accumulation.
  bool fast_accum;
};

// What the forward saved for the weight gradient.
enum class WeightOperand {
  kNone,           // nothing: the weight needed no gradient
  kFp8Transposed,  // the input's padded FP8 transpose and its scale's inverse
  kInput,          // the input, for the weight gradient in its precision
};

// What the backward needs of the forward besides the saved tensors, in one capsule. Compiled
// autograd, which hashes a node's saved values, raises NotImplementedError on it: the node runs
// in the eager autograd engine only (its backward calls Python and cuBLASLt, which that tracing
// would not take either).
struct BackwardState : torch::CustomClassHolder {
  // The parameter itself, which the engine knows (a checkpoint's recomputation saves another
  // tensor object); also saved, for autograd's check that it was not modified in place.
  at::Tensor weight;
  at::Tensor grad_scale, grad_record;
  bool e4m3_backward = false;
  WeightOperand weight_operand = WeightOperand::kNone;
  bool has_bias = false;
  bool has_residual = false;
  at::ScalarType input_dtype = at::kBFloat16;
};

// Python's answer to a backward: where the weight gradient goes and, where the input gradient
// is wanted, the FP8 weight's contiguous transpose `[in, out]` and its scale's inverse.
struct BackwardInputs {
  megatron::WeightGradTarget target;
  at::Tensor weight_transposed, weight_scale_inv;
};

BackwardInputs ask_python(const at::Tensor& weight, bool need_weight, bool need_input) {
  BackwardInputs inputs;
  py::gil_scoped_acquire gil;
  TORCH_CHECK(*backward_callback, "fp8 linear: set_backward_callback was not called");
  // A backward that needs no weight gradient asks as one whose inputs leave the weight out.
  const py::tuple answer = (*backward_callback)(
      weight, need_weight ? megatron::accumulates(weight) : py::bool_(false), need_input);
  inputs.target = megatron::read_target(answer);
  // An unregistered weight's answer is "wanted" whatever the backward needs.
  inputs.target.wanted = inputs.target.wanted && need_weight;
  if (need_input) {
    inputs.weight_transposed = answer[2].cast<at::Tensor>();
    inputs.weight_scale_inv = answer[3].cast<at::Tensor>();
  }
  return inputs;
}

enum class WgradMode { kReturn, kOverwrite, kCopy, kAccumulate };

// How the weight gradient reaches `target`: returned, written over a contiguous tensor (by the
// GEMM), copied over one the GEMM cannot write, or added.
WgradMode wgrad_mode(const megatron::WeightGradTarget& target) {
  if (!target.tensor.defined()) return WgradMode::kReturn;
  if (!target.overwrite) return WgradMode::kAccumulate;
  return target.tensor.is_contiguous() ? WgradMode::kOverwrite : WgradMode::kCopy;
}

// Checks, before the gradient's cast records its amax, that the FP8 weight's transpose Python
// gave is `[in, out]` E4M3 bytes on `device`, with one fp32 scale.
void check_transposed_weight(const BackwardInputs& inputs, const at::Tensor& weight,
                             const at::Device& device) {
  const at::Tensor& transposed = inputs.weight_transposed;
  TORCH_CHECK(transposed.dim() == 2 && transposed.size(0) == weight.size(1) &&
                  transposed.size(1) == weight.size(0) &&
                  transposed.scalar_type() == at::kFloat8_e4m3fn && transposed.device() == device,
              "fp8 linear backward: the FP8 weight's transpose must be [", text(weight.size(1)),
              ", ", text(weight.size(0)), "] E4M3 on ", text(device), ", got ",
              text(transposed.scalar_type()), " ", text(transposed.sizes()), " on ",
              text(transposed.device()));
  check_scalar(inputs.weight_scale_inv, device, "weight scale's inverse");
}

// Checks, before the gradient's cast records its amax, that an engine's target is the weight's
// shape, on the gradient's device, and (for the FP8 GEMM's output) of a dtype it writes.
void check_target(const at::Tensor& target, const at::Tensor& weight, const at::Device& device,
                  bool fp8_output) {
  const at::ScalarType dtype = target.scalar_type();
  TORCH_CHECK_VALUE(!fp8_output || dtype == at::kBFloat16 || dtype == at::kHalf ||
                        dtype == at::kFloat,
                    "FP8 weight gradients go into bf16, fp16 or fp32 main_grads, got ",
                    text(dtype), ".");
  TORCH_CHECK(target.sizes() == weight.sizes() && target.device() == device,
              "fp8 linear backward: the weight-gradient target must be ", text(weight.sizes()),
              " on ", text(device), ", got ", text(target.sizes()), " on ",
              text(target.device()));
}

// `grad_t @ input_t^T` from the output gradient's and the input's padded FP8 transposes, where
// `target` says (returned in `dtype`, the weight's).
at::Tensor fp8_weight_grad(const megatron::WeightGradTarget& target, const at::Tensor& grad_t,
                           const at::Tensor& grad_scale_inv, const at::Tensor& input_t,
                           const at::Tensor& input_scale_inv, at::ScalarType dtype) {
  const at::Tensor b = input_t.t();
  const at::Tensor& out = target.tensor;
  switch (wgrad_mode(target)) {
    case WgradMode::kReturn:
      return scaled_mm(grad_t, b, grad_scale_inv, input_scale_inv, at::Tensor(), dtype, false);
    case WgradMode::kOverwrite:
      scaled_mm_into(out, /*accumulate=*/false, grad_t, b, grad_scale_inv, input_scale_inv);
      break;
    case WgradMode::kCopy:
      out.copy_(scaled_mm(grad_t, b, grad_scale_inv, input_scale_inv, at::Tensor(),
                          out.scalar_type(), false));
      break;
    case WgradMode::kAccumulate:
      if (out.scalar_type() == at::kFloat && out.is_contiguous()) {
        // The sum in the GEMM's epilogue.
        scaled_mm_into(out, /*accumulate=*/true, grad_t, b, grad_scale_inv, input_scale_inv);
      } else {
        out.add_(scaled_mm(grad_t, b, grad_scale_inv, input_scale_inv, at::Tensor(),
                           out.scalar_type(), false));
      }
      break;
  }
  return at::Tensor();
}

// `F.linear` with its three GEMMs in FP8, one autograd node (file comment).
struct Fp8Linear : public torch::autograd::Function<Fp8Linear> {
  // `x` (any leading dimensions) cast (with its padded transposed copy where the weight
  // gradient is FP8 and wanted), then `x_fp8 @ weight^T + bias` in `x`'s leading dimensions and
  // dtype, the bias in the GEMM where cuBLASLt takes it (a bf16 / fp16 output of the bias's
  // dtype), else added after; then `residual +` it, where given (`linear` passes one of the
  // output's shape and dtype with dense rows, with a bias the GEMM takes or none): in the GEMM,
  // rounded once with the product, where cuBLASLt takes it, else right after it.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, const LayerArgs& args,
                            bool weight_needs_grad) {
    const bool fp8_wgrad = weight_needs_grad && args.fp8_wgrad;
    const auto cast_out = cast_impl(flat(x), args.scale, args.record, args.e4m3_forward,
                                    /*rowwise=*/true, /*transpose=*/fp8_wgrad);
    const at::ScalarType out_dtype = x.scalar_type();
    const bool fused_bias =
        bias.has_value() && out_dtype != at::kFloat && bias->scalar_type() == out_dtype;
    at::Tensor out = scaled_mm(
        cast_out[0], args.weight_data.t(), cast_out[1], args.weight_scale_inv,
        fused_bias ? bias->contiguous() : at::Tensor(), out_dtype, args.fast_accum,
        residual.has_value() ? residual->view({-1, args.weight_data.size(0)}) : at::Tensor());
    if (bias.has_value() && !fused_bias) out = out + *bias;
    out = out.view(with_last(x, args.weight_data.size(0)));
    // The weight last: autograd then refuses a backward after an in-place write to it.
    auto state = c10::make_intrusive<BackwardState>();
    if (fp8_wgrad) {
      ctx->save_for_backward({cast_out[2], cast_out[1], weight});
      state->weight_operand = WeightOperand::kFp8Transposed;
    } else if (weight_needs_grad) {
      ctx->save_for_backward({x, weight});
      state->weight_operand = WeightOperand::kInput;
    } else {
      ctx->save_for_backward({weight});
    }
    state->weight = weight;
    state->grad_scale = args.grad_scale;
    state->grad_record = args.grad_record;
    state->e4m3_backward = args.e4m3_backward;
    state->has_bias = bias.has_value();
    state->has_residual = residual.has_value();
    state->input_dtype = out_dtype;
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }

  // The output gradient cast (rowwise for the input gradient, its padded transpose for an FP8
  // weight gradient), the input gradient `grad_fp8 @ weight` from the weight's contiguous
  // transpose, the weight gradient where Python says, and the bias gradient (the
  // high-precision gradient's column sums). Only what the running backward needs is computed
  // (`needs_input_grad` asks it), so a backward that needs neither the input's nor the weight's
  // gradient casts nothing and records no amax.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto state = c10::static_intrusive_pointer_cast<BackwardState>(
        ctx->saved_data["state"].toCapsule());
    // Differentiable once, as the Python path.
    const megatron::OnceDifferentiable once(grads);
    const at::Tensor& grad = grads[0];
    const c10::cuda::CUDAGuard guard(grad.device());
    const bool need_input = ctx->needs_input_grad(0);
    const bool need_bias = state->has_bias && ctx->needs_input_grad(2);
    const bool need_weight =
        state->weight_operand != WeightOperand::kNone && ctx->needs_input_grad(1);
    const BackwardInputs inputs = need_input || need_weight
                                      ? ask_python(state->weight, need_weight, need_input)
                                      : BackwardInputs();
    const megatron::WeightGradTarget& target = inputs.target;
    const bool fp8_wgrad =
        target.wanted && state->weight_operand == WeightOperand::kFp8Transposed;
    // Checked before the cast, which records the gradient's amax: a refused call changes nothing.
    if (need_input) check_transposed_weight(inputs, state->weight, grad.device());
    if (target.wanted && target.tensor.defined()) {
      check_target(target.tensor, state->weight, grad.device(), /*fp8_output=*/fp8_wgrad);
    }
    const at::Tensor grad_2d = flat(grad);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (need_input || fp8_wgrad) {
      const auto cast_out = cast_impl(grad_2d, state->grad_scale, state->grad_record,
                                      state->e4m3_backward, /*rowwise=*/need_input,
                                      /*transpose=*/fp8_wgrad);
      if (need_input) {
        const at::Tensor& transposed = inputs.weight_transposed;
        grad_input = scaled_mm(cast_out[0], transposed.t(), cast_out[1], inputs.weight_scale_inv,
                               at::Tensor(), state->input_dtype, /*fast_accum=*/false);
        grad_input = grad_input.view(with_last(grad, transposed.size(0)));
      }
      if (fp8_wgrad) {
        grad_weight = fp8_weight_grad(target, cast_out[2], cast_out[1], saved[0], saved[1],
                                      state->weight.scalar_type());
      }
    }
    if (target.wanted && state->weight_operand == WeightOperand::kInput) {
      // `--no-fp8-wgrad`: the fusing bf16 linear's weight gradient, from the saved input.
      grad_weight = megatron::linear::weight_grad_into(target, grad_2d, saved[0]);
    }
    if (need_bias) grad_bias = grad_2d.sum(0);
    // The residual's gradient is the output's, passed on (`needs_input_grad` counts the tensors
    // given: the residual's follows the bias, if any).
    at::Tensor grad_residual;
    if (state->has_residual && ctx->needs_input_grad(state->has_bias ? 3 : 2)) grad_residual = grad;
    return once.finish(
        {grad_input, grad_weight, grad_bias, grad_residual, at::Tensor(), at::Tensor()});
  }
};

// The layer's entry: checks what the forward's cast would otherwise record an amax for, then
// the node (`weight` the parameter, whose gradient the backward places; `weight_data` its FP8
// bytes).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual,
                  const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& record,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& grad_record, const at::Tensor& weight_data,
                  const at::Tensor& weight_scale_inv, bool e4m3_forward, bool e4m3_backward,
                  bool fp8_wgrad, bool fast_accum) {
  check_cuda(x, "linear");
  TORCH_CHECK(x.dim() >= 1 && weight_data.dim() == 2 && weight.sizes() == weight_data.sizes() &&
                  weight_data.size(1) == x.size(-1),
              "fp8 linear: an input [..., in], a weight [out, in] and its FP8 bytes of the "
              "weight's shape, got ",
              text(x.sizes()), ", ", text(weight.sizes()), " and ", text(weight_data.sizes()));
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                                    bias->device() == x.device()),
              "fp8 linear: the bias must be [", text(weight.size(0)), "] on ", text(x.device()));
  const c10::cuda::CUDAGuard guard(x.device());
  const LayerArgs args{optional_or_undefined(scale),
                       optional_or_undefined(record),
                       optional_or_undefined(grad_scale),
                       optional_or_undefined(grad_record),
                       weight_data,
                       weight_scale_inv,
                       e4m3_forward,
                       e4m3_backward,
                       fp8_wgrad,
                       fast_accum};
  // Read here: in the node's forward grad mode is off.
  const bool weight_needs_grad = at::GradMode::is_enabled() && weight.requires_grad();
  // A residual joins the node where the GEMM can add it: the output's shape and dtype with
  // dense rows, and the bias (if any) in the GEMM too, so that it is added last.
  const at::ScalarType out_dtype = x.scalar_type();
  const bool joins_node =
      residual.has_value() && residual->scalar_type() == out_dtype &&
      residual->device() == x.device() && residual->is_contiguous() &&
      residual->sizes() == at::IntArrayRef(with_last(x, weight.size(0))) &&
      (!bias.has_value() || (out_dtype != at::kFloat && bias->scalar_type() == out_dtype));
  if (residual.has_value() && !joins_node) {
    // Autograd's add, which casts the gradient to each input's dtype.
    return at::add(*residual,
                   Fp8Linear::apply(x, weight, bias, std::optional<at::Tensor>(), args,
                                    weight_needs_grad));
  }
  return Fp8Linear::apply(x, weight, bias, residual, args, weight_needs_grad);
}

void set_backward_callback(py::object callback) { *backward_callback = std::move(callback); }

}  // namespace
}  // namespace megatron_fp8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace megatron_fp8;
  m.def("cast", &cast, "FP8 cast of a 2-D CUDA tensor (and its padded transposed copy)",
        py::arg("x"), py::arg("scale"), py::arg("record"), py::arg("e4m3"),
        py::arg("rowwise") = true, py::arg("transpose") = true);
  m.def("transpose", &transpose, "The contiguous transpose of a 2-D FP8 CUDA tensor",
        py::arg("data"));
  m.def("transpose_all", &transpose_all,
        "The contiguous transposes of 2-D FP8 CUDA tensors, in one call", py::arg("data"));
  m.def("linear", &linear,
        "F.linear with its GEMMs in FP8 (plus a residual), as one autograd node", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("scale"),
        py::arg("record"), py::arg("grad_scale"), py::arg("grad_record"), py::arg("weight_data"),
        py::arg("weight_scale_inv"), py::arg("e4m3_forward"), py::arg("e4m3_backward"),
        py::arg("fp8_wgrad"), py::arg("fast_accum"));
  m.def("set_backward_callback", &set_backward_callback,
        "The Python function the backward asks where the weight gradient goes, and for the FP8 "
        "weight's transpose");
}
