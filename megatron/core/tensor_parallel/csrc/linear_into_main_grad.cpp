// Gradient-accumulation fusion's linear layer with its autograd node in C++
// (`megatron/core/tensor_parallel/native_linear.py` builds and loads it; `grad_accumulation.py`
// calls it).
//
// The Python autograd function `_LinearIntoMainGrad` costs the host tens of microseconds per
// linear layer and step more than `F.linear`'s C++ node: the function's Python frames forward
// and backward, its context object, and the backward holding the GIL through its three GEMM
// launches. Here forward and backward are C++; the backward asks Python only where the weight
// gradient goes (the engine's registry and state, `native_target`), with the GIL taken for that
// call alone. The operators are the Python path's (`linear`, `matmul`, `addmm` into the target,
// `sum`), so the results are the same bit for bit.

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include "once_differentiable.h"

namespace megatron_linear {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Python's `native_target(weight, accumulates) -> (wanted, FusionTarget | None)`, set once at
// load. Never destroyed: the interpreter may be gone when static destructors run.
py::object* target_callback = new py::object();

at::Tensor flat(const at::Tensor& tensor) {
  return tensor.dim() == 2 ? tensor : tensor.reshape({-1, tensor.size(-1)});
}

// Whether the running backward accumulates into `weight` (a leaf): True, False (a backward whose
// inputs leave it out), or None where `torch.autograd.grad` captures it or no graph task runs
// (the gradient is then returned). The same test as `torch._C._will_engine_execute_node` on the
// weight's node, which raises in the last two cases (`grad_accumulation._accumulates`: None).
py::object accumulates(const at::Tensor& weight) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* nodes_in_graph = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (exec_info == nullptr || nodes_in_graph == nullptr) return py::none();
  const auto function = torch::autograd::impl::gradient_edge(weight).function;
  torch::autograd::Node* node = function.get();
  if (nodes_in_graph->find(node) == nodes_in_graph->end()) return py::bool_(false);
  if (!exec_info->empty()) {
    const auto it = exec_info->find(node);
    if (it == exec_info->end() || !it->second.should_execute()) return py::bool_(false);
    if (node->topological_nr() == 0 && it->second.captures_) return py::none();
  }
  return py::bool_(true);
}

// `target (+)= grad_2d^T @ input_2d` in the target's dtype, as `grad_accumulation._fuse` on CUDA.
void fuse(const at::Tensor& target, bool overwrite, const at::Tensor& grad_2d,
          const at::Tensor& input_2d) {
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
  bool wanted;
  bool fused = false;
  at::Tensor target;
  bool overwrite = false;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(*target_callback, "linear_into_main_grad: set_target_callback was not called");
    const py::tuple decision = (*target_callback)(weight, accumulates(weight));
    wanted = decision[0].cast<bool>();
    const py::object fusion = decision[1];
    if (!fusion.is_none()) {
      const py::tuple pair = fusion;
      target = pair[0].cast<at::Tensor>();
      overwrite = pair[1].cast<bool>();
      fused = true;
    }
  }
  if (!wanted) return at::Tensor();
  if (fused) {
    fuse(target, overwrite, grad_2d, flat(input));
    return at::Tensor();
  }
  return grad_2d.t().matmul(flat(input));
}

struct LinearIntoMainGrad : public torch::autograd::Function<LinearIntoMainGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    ctx->save_for_backward({input, weight});
    // The parameter itself: a checkpoint's recomputation saves another tensor object.
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["has_bias"] = bias.has_value();
    return at::linear(input, weight, bias);
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
    if (ctx->needs_input_grad(0)) grad_input = grad_output.matmul(weight);
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
