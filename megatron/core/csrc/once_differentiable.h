// `once_differentiable` for this project's C++ autograd nodes: what
// `torch.autograd.function.once_differentiable` does for a Python one (`megatron.core.utils`).
// A backward that runs with grad mode on (`create_graph=True`) and receives a gradient that
// requires grad computes without a graph (`OnceDifferentiable` holds a no-grad guard), and its
// gradients raise if differentiated again (`finish`).

#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <utility>

namespace megatron {

class OnceDifferentiable {
 public:
  // Constructed first thing in a backward, with the gradients it received.
  explicit OnceDifferentiable(const torch::autograd::variable_list& grads)
      : again_(at::GradMode::is_enabled() && any_requires_grad(grads)) {}

  // The backward's gradients, made to raise if differentiated again where they would be.
  torch::autograd::variable_list finish(torch::autograd::variable_list grads) const {
    if (!again_) return grads;
    for (at::Tensor& grad : grads) {
      if (grad.defined()) grad = grad.detach().requires_grad_(true);
    }
    return torch::autograd::DelayedError(
               "trying to differentiate twice a function that was marked with "
               "@once_differentiable",
               static_cast<int64_t>(grads.size()))
        .apply(std::move(grads));
  }

 private:
  static bool any_requires_grad(const torch::autograd::variable_list& grads) {
    for (const at::Tensor& grad : grads) {
      if (grad.defined() && grad.requires_grad()) return true;
    }
    return false;
  }

  const bool again_;
  const at::NoGradGuard no_grad_;
};

}  // namespace megatron
