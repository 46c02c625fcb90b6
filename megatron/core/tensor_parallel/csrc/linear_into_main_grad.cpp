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
// PyTorch's defaults, layouts cuBLASLt does not take: `uses_cublaslt`, `forward_product`) the
// node runs the Python path's operators: `linear`, `matmul`, `addmm` into the target. The bias
// gradient is the Python path's `sum`.

#include <ATen/Context.h>
#include <ATen/cuda/tunable/Tunable.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <type_traits>

#include "cublaslt_gemm.h"
#include "once_differentiable.h"
#include "weight_grad_target.h"

namespace megatron_linear {
namespace {

namespace lt = megatron::cublaslt;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Python's `native_target(weight, accumulates) -> (wanted, FusionTarget | None)`, set once at
// load. Never destroyed: the interpreter may be gone when static destructors run.
py::object* target_callback = new py::object();

at::Tensor flat(const at::Tensor& tensor) {
  return tensor.dim() == 2 ? tensor : tensor.reshape({-1, tensor.size(-1)});
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
bool accumulates_in_fp16_or_carves_out_sms(const at::Context& context) {
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
// GEMMs. (Under autocast, whose casts the node would skip, `grad_accumulation.linear` does not
// run the node.)
bool uses_cublaslt(const at::Tensor& operand, int64_t m, int64_t n, int64_t k) {
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

// The rows of `tensor` flattened to 2-D (the product of all sizes but the last).
int64_t rows_of(const at::Tensor& tensor) {
  int64_t rows = 1;
  for (int64_t dim = 0; dim + 1 < tensor.dim(); ++dim) rows *= tensor.size(dim);
  return rows;
}

// `tensor`'s sizes with the last one replaced.
std::vector<int64_t> with_last(const at::Tensor& tensor, int64_t last) {
  std::vector<int64_t> sizes = tensor.sizes().vec();
  sizes.back() = last;
  return sizes;
}

// `at::linear(input, weight, bias)`. With a bias, `at::linear` adds it in the GEMM (one rounding)
// for a 2-D or contiguous input only, and after the product otherwise: those run ATen's.
at::Tensor forward_product(const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  const bool biased = bias.has_value() && bias->defined();
  if (input.dim() >= 2 && (!biased || input.dim() == 2 || input.is_contiguous()) &&
      uses_cublaslt(input, rows_of(input), weight.size(0), weight.size(1))) {
    const at::Tensor input_2d = flat(input);
    at::Tensor out = at::empty({input_2d.size(0), weight.size(0)}, input_2d.options());
    if (lt::gemm(out, /*accumulate=*/false, input_2d, weight.t(),
                 biased ? lt::Epilogue::kBias : lt::Epilogue::kNone,
                 biased ? *bias : at::Tensor())) {
      return out.view(with_last(input, weight.size(0)));
    }
  }
  return at::linear(input, weight, bias);
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

// Whether the weight gradient `grad_2d^T @ input_2d` may go through cuBLASLt.
bool weight_gemm_applies(const at::Tensor& grad_2d, const at::Tensor& input_2d) {
  return uses_cublaslt(grad_2d, grad_2d.size(1), input_2d.size(1), grad_2d.size(0));
}

// `target (+)= grad_2d^T @ input_2d` in the target's dtype, as `grad_accumulation._fuse` on CUDA.
void fuse(const at::Tensor& target, bool overwrite, const at::Tensor& grad_2d,
          const at::Tensor& input_2d) {
  if (weight_gemm_applies(grad_2d, input_2d) &&
      lt::gemm(target, /*accumulate=*/!overwrite, grad_2d.t(), input_2d)) {
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

// `weight_grad`: the weight gradient returned to autograd, or undefined where it went into the
// engine's target (or where this backward wants none).
at::Tensor weight_grad(const at::Tensor& grad_2d, const at::Tensor& input,
                       const at::Tensor& weight) {
  megatron::WeightGradTarget target;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(*target_callback, "linear_into_main_grad: set_target_callback was not called");
    target = megatron::read_target((*target_callback)(weight, megatron::accumulates(weight)));
  }
  if (!target.wanted) return at::Tensor();
  const at::Tensor input_2d = flat(input);
  if (target.tensor.defined()) {
    fuse(target.tensor, target.overwrite, grad_2d, input_2d);
    return at::Tensor();
  }
  if (weight_gemm_applies(grad_2d, input_2d)) {
    at::Tensor out = at::empty({grad_2d.size(1), input_2d.size(1)}, grad_2d.options());
    if (lt::gemm(out, /*accumulate=*/false, grad_2d.t(), input_2d)) return out;
  }
  return grad_2d.t().matmul(input_2d);
}

struct LinearIntoMainGrad : public torch::autograd::Function<LinearIntoMainGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    ctx->save_for_backward({input, weight});
    // The parameter itself: a checkpoint's recomputation saves another tensor object.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["has_bias"] = bias.has_value();
    return forward_product(input, weight, bias);
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
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_bias = grad_2d.sum(0);
    }
    return once.finish({grad_input, grad_weight, grad_bias});
  }
};

}  // namespace

at::Tensor linear_into_main_grad(const at::Tensor& input, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& bias) {
  return LinearIntoMainGrad::apply(input, weight, bias);
}

void set_target_callback(py::object callback) { *target_callback = std::move(callback); }

}  // namespace megatron_linear

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_into_main_grad", &megatron_linear::linear_into_main_grad,
        "F.linear whose weight gradient goes where the engine says (one C++ autograd node)",
        py::arg("input"), py::arg("weight"), py::arg("bias"));
  m.def("set_target_callback", &megatron_linear::set_target_callback,
        "The Python function asked where each weight gradient goes");
}
