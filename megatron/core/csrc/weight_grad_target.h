// Where the backward of a C++ linear node sends its weight gradient: into an engine's
// `main_grad` (gradient-accumulation fusion), back to autograd, or nowhere. The engines' registry
// is Python (`megatron.core.tensor_parallel.grad_accumulation`); a node asks it once per
// backward, with whether the running backward accumulates into the weight (`accumulates`), and
// reads the answer's `(wanted, FusionTarget | None)` (`read_target`).

#pragma once

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

namespace megatron {

// Whether the running backward accumulates into `weight` (a leaf): True, False (a backward whose
// inputs leave it out), or None where `torch.autograd.grad` captures it or no graph task runs
// (the gradient is then returned). The same test as `torch._C._will_engine_execute_node` on the
// weight's node, which raises in the last two cases (`grad_accumulation._accumulates`: None).
inline py::object accumulates(const at::Tensor& weight) {
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

// Where one weight gradient goes.
struct WeightGradTarget {
  // Whether this backward wants the gradient at all.
  bool wanted = false;
  // The engine's tensor it fuses into; undefined: it is returned to autograd.
  at::Tensor tensor;
  // The gradient replaces `tensor`'s contents (not read) rather than adding to them.
  bool overwrite = false;
};

// The target in the first two items of Python's answer, `(wanted, FusionTarget | None)`
// (`grad_accumulation.native_target`'s result). With the GIL held.
inline WeightGradTarget read_target(const py::tuple& answer) {
  WeightGradTarget target;
  target.wanted = answer[0].cast<bool>();
  const py::object fusion = answer[1];
  if (!fusion.is_none()) {
    const py::tuple pair = fusion;
    target.tensor = pair[0].cast<at::Tensor>();
    target.overwrite = pair[1].cast<bool>();
  }
  return target;
}

}  // namespace megatron
