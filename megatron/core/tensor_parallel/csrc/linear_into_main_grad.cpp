// Gradient-accumulation fusion's linear layer with its autograd node in C++
// (`megatron/core/tensor_parallel/native_linear.py` builds and loads it; `grad_accumulation.py`
// calls it).
//
// The Python autograd function `_LinearIntoMainGrad` costs the host tens of microseconds per
// linear layer and step more than `F.linear`'s C++ node: the function's Python frames forward
// and backward, its context object, and the backward holding the GIL through its three GEMM
// launches. Here forward and backward are C++; the backward asks Python only where the weight
// gradient goes (the engine's registry and state, `native_target`), with the GIL taken for that
// call alone.
//
// The bf16 and fp16 GEMMs run through cuBLASLt with their set-up cached (`cublaslt_gemm.h`),
// where PyTorch's GEMM calls set up cuBLAS's or cuBLASLt's at every call; the forward adds the
// bias in the GEMM's epilogue, as `F.linear` does through cuBLASLt. Asked the question PyTorch's
// calls ask, cuBLASLt's heuristic gives the algorithms they run: the tests find the Python path's
// results bit for bit. Elsewhere (fp32, products with a dimension of 1, GEMM settings other than
// PyTorch's defaults, layouts cuBLASLt does not take: `linear_gemms.h`, `forward_product`) the
// node runs the Python path's operators: `linear`, `matmul`, `addmm` into the target. The bias
// gradient is the Python path's `sum`.
//
// Given a `residual` (the layer's residual connection), the layer returns `residual +
// linear(input, weight, bias)`. One of the output's shape and dtype with dense rows joins the
// node: the GEMM adds it (cuBLAS's `C`, rounded once with the product and the bias) where
// cuBLASLt runs it, else the node adds it after, and its gradient is the output's, passed on: no
// launch forward, no node backward. Another is added after the node, as the Python path adds it.

#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include "cublaslt_gemm.h"
#include "linear_gemms.h"
#include "once_differentiable.h"
#include "weight_grad_target.h"

namespace megatron_linear {
namespace {

namespace lt = megatron::cublaslt;
using megatron::linear::flat;
using megatron::linear::rows_of;
using megatron::linear::uses_cublaslt;
using megatron::linear::with_last;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Python's `native_target(weight, accumulates) -> (wanted, FusionTarget | None)`, set once at
// load. Never destroyed: the interpreter may be gone when static destructors run.
py::object* target_callback = new py::object();

// Whether `residual` joins the node of a layer whose input is `input`: the output's shape and
// dtype, on its device, with dense rows (a view of the GEMM's 2-D output's layout).
bool joins_node(const at::Tensor& residual, const at::Tensor& input, const at::Tensor& weight) {
  return residual.scalar_type() == input.scalar_type() && residual.device() == input.device() &&
         residual.is_contiguous() &&
         residual.sizes() == at::IntArrayRef(with_last(input, weight.size(0)));
}

// `at::linear(input, weight, bias)`, plus `residual` where defined (`joins_node`). With a bias,
// `at::linear` adds it in the GEMM (one rounding) for a 2-D or contiguous input only, and after
// the product otherwise: those run ATen's. The residual joins a GEMM cuBLASLt runs.
at::Tensor forward_product(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const at::Tensor& residual) {
  const bool biased = bias.has_value() && bias->defined();
  if (input.dim() >= 2 && (!biased || input.dim() == 2 || input.is_contiguous()) &&
      uses_cublaslt(input, rows_of(input), weight.size(0), weight.size(1))) {
    const at::Tensor input_2d = flat(input);
    at::Tensor out = at::empty({input_2d.size(0), weight.size(0)}, input_2d.options());
    if (lt::gemm(out, /*accumulate=*/false, input_2d, weight.t(),
                 biased ? lt::Epilogue::kBias : lt::Epilogue::kNone,
                 biased ? *bias : at::Tensor(), at::Tensor(), at::Tensor(), false,
                 residual.defined() ? residual.view(out.sizes()) : at::Tensor())) {
      return out.view(with_last(input, weight.size(0)));
    }
  }
  const at::Tensor out = at::linear(input, weight, bias);
  return residual.defined() ? at::add(residual, out) : out;
}

// `grad_output.matmul(weight)`, the input gradient.
at::Tensor input_grad(const at::Tensor& grad_output, const at::Tensor& grad_2d,
                      const at::Tensor& weight) {
  if (uses_cublaslt(grad_2d, grad_2d.size(0), weight.size(1), weight.size(0))) {
    at::Tensor out = at::empty({grad_2d.size(0), weight.size(1)}, grad_2d.options());
    if (lt::gemm(out, /*accumulate=*/false, grad_2d, weight)) {
      return out.view(with_last(grad_output, weight.size(1)));
    }
  }
  return grad_output.matmul(weight);
}

// The weight gradient where the engine says (`linear_gemms.h`'s `weight_grad_into`): returned
// to autograd, or undefined where it went into the engine's target or this backward wants none.
at::Tensor weight_grad(const at::Tensor& grad_2d, const at::Tensor& input,
                       const at::Tensor& weight) {
  megatron::WeightGradTarget target;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(*target_callback, "linear_into_main_grad: set_target_callback was not called");
    target = megatron::read_target((*target_callback)(weight, megatron::accumulates(weight)));
  }
  return megatron::linear::weight_grad_into(target, grad_2d, input);
}

struct LinearIntoMainGrad : public torch::autograd::Function<LinearIntoMainGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual) {
    ctx->save_for_backward({input, weight});
    // The parameter itself: a checkpoint's recomputation saves another tensor object.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["has_residual"] = residual.has_value();
    return forward_product(input, weight, bias, residual.value_or(at::Tensor()));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad_output = grads[0];
    // Differentiable once, as the Python path.
    const megatron::OnceDifferentiable once(grads);
    const at::Tensor grad_2d = flat(grad_output);
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) grad_input = input_grad(grad_output, grad_2d, weight);
    if (ctx->needs_input_grad(1)) {
      grad_weight = megatron_linear::weight_grad(grad_2d, input,
                                                 ctx->saved_data["weight"].toTensor());
    }
    // `needs_input_grad` counts the tensors given: the residual's follows the bias, if any.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    if (has_bias && ctx->needs_input_grad(2)) grad_bias = grad_2d.sum(0);
    at::Tensor grad_residual;
    if (ctx->saved_data["has_residual"].toBool() && ctx->needs_input_grad(has_bias ? 3 : 2)) {
      grad_residual = grad_output;
    }
    return once.finish({grad_input, grad_weight, grad_bias, grad_residual});
  }
};

}  // namespace

at::Tensor linear_into_main_grad(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& residual) {
  if (residual.has_value() && !joins_node(*residual, input, weight)) {
    // Autograd's add, which casts the gradient to each input's dtype.
    return at::add(*residual,
                   LinearIntoMainGrad::apply(input, weight, bias, std::optional<at::Tensor>()));
  }
  return LinearIntoMainGrad::apply(input, weight, bias, residual);
}

void set_target_callback(py::object callback) { *target_callback = std::move(callback); }

}  // namespace megatron_linear

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_into_main_grad", &megatron_linear::linear_into_main_grad,
        "F.linear (plus a residual) whose weight gradient goes where the engine says (one C++ "
        "autograd node)",
        py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("residual") = py::none());
  m.def("set_target_callback", &megatron_linear::set_target_callback,
        "The Python function asked where each weight gradient goes");
}
