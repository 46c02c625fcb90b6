// The rotary embedding's CUDA kernel (`rope_kernels.cu`), launched on a stream by `rope.cpp`,
// which checks the arguments and allocates the outputs.

#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

namespace megatron_rope {

// Rotates `query` [s, b, nq, d] and `key` [s, b, nk, d] (channels adjacent, any other strides;
// bf16, fp16 or fp32, the same) by the angles whose cosines and signed sines are `cos` and `sin`
// ([s, rot] fp32, contiguous; rot even, <= d) into the contiguous `query_out` and `key_out`;
// `transpose` rotates by the opposite angles (backward). Channels past rot pass through.
cudaError_t launch_rotate(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                          const at::Tensor& sin, bool interleaved, bool transpose,
                          const at::Tensor& query_out, const at::Tensor& key_out,
                          cudaStream_t stream);

}  // namespace megatron_rope
