// The fused rotary embedding of a layer's queries and keys as one C++ autograd node
// (`megatron/core/fusions/native_rope.py` builds and loads it; `fused_rope.py` calls it).
//
// The Triton path (`fused_rope.py`) costs the host a Python autograd function, its argument
// handling and Triton's launcher per layer and direction: inside a step about as much as the
// eight PyTorch operators it replaces. Here forward and backward are C++ and launch the kernel of
// `rope_kernels.cu` (the Triton kernel's arithmetic) directly.

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>

#include "once_differentiable.h"
#include "rope_kernels.h"

namespace megatron_rope {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The kernel addresses channels as adjacent.
at::Tensor kernel_input(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

variable_list rotate(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                     const at::Tensor& sin, bool interleaved, bool transpose) {
  const at::Tensor q = kernel_input(query);
  const at::Tensor k = kernel_input(key);
  const int64_t seq = q.size(0);
  const int64_t rot_dim = cos.size(-1);
  const at::Tensor cos_2d = cos.reshape({seq, rot_dim}).contiguous();
  const at::Tensor sin_2d = sin.reshape({seq, rot_dim}).contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  const c10::cuda::CUDAGuard guard(q.device());
  C10_CUDA_CHECK(launch_rotate(q, k, cos_2d, sin_2d, interleaved, transpose, q_out, k_out,
                               c10::cuda::getCurrentCUDAStream()));
  return {q_out, k_out};
}

void check(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
           const at::Tensor& sin) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(query.is_cuda() && key.device() == query.device() &&
                  cos.device() == query.device() && sin.device() == query.device(),
              "rotary: query, key and tables on one CUDA device");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "rotary: bf16, fp16 or fp32 queries, got ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype, "rotary: keys of the queries' dtype");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && query.size(0) == key.size(0) &&
                  query.size(1) == key.size(1) && query.size(3) == key.size(3),
              "rotary: query [s, b, nq, d] and key [s, b, nk, d], got ", query.sizes(), " and ",
              key.sizes());
  TORCH_CHECK(query.size(0) * query.size(1) <= std::numeric_limits<int32_t>::max(),
              "rotary: at most 2^31 - 1 positions x batch entries, got ", query.size(0), " x ",
              query.size(1));
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.sizes() == sin.sizes() && cos.dim() == 4 &&
                  cos.size(0) == query.size(0) && cos.numel() == cos.size(0) * cos.size(3) &&
                  cos.size(3) % 2 == 0 && cos.size(3) <= query.size(3),
              "rotary: fp32 tables [s, 1, 1, rot] (rot even, <= d), got ", cos.sizes());
}

struct Rotary : public torch::autograd::Function<Rotary> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& cos,
                               const at::Tensor& sin, bool interleaved) {
    check(query, key, cos, sin);
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    return rotate(query, key, cos, sin, interleaved, /*transpose=*/false);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    // Differentiable once, as the Triton path.
    const megatron::OnceDifferentiable once(grads);
    const variable_list rotated =
        once.finish(rotate(grads[0], grads[1], saved[0], saved[1],
                           ctx->saved_data["interleaved"].toBool(), /*transpose=*/true));
    return {rotated[0], rotated[1], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

variable_list rotary(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                     const at::Tensor& sin, bool interleaved) {
  return Rotary::apply(query, key, cos, sin, interleaved);
}

}  // namespace megatron_rope

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary", &megatron_rope::rotary,
        "The rotated queries and keys, contiguous (one C++ autograd node, one kernel each way)",
        py::arg("query"), py::arg("key"), py::arg("cos"), py::arg("sin"),
        py::arg("interleaved"));
}
