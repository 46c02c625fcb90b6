// The segment copy's CUDA kernel (`segment_copy_kernels.cu`), launched on a stream by
// `segment_copy.cpp`, which checks the arguments.

#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_segment_copy {

// target[t_i : t_i + n_i] = source[s_i : s_i + n_i], cast to `target`'s dtype, for every row
// (s_i, t_i, n_i) of `table` (int64 [segments, 3]); program p of `programs` (int32
// [programs, 2]) copies chunk programs[p, 1] of `elements_per_program` elements of segment
// programs[p, 0]. `source` and `target` are flat, contiguous, fp32, bf16 or fp16. With `align`
// 4 or 8 (16 bytes of the narrower dtype) every offset and size is a multiple of `align`
// elements and both tensors start on 16 bytes: the kernel moves 16-byte vectors.
cudaError_t launch_segment_copy(const at::Tensor& source, const at::Tensor& target,
                                const at::Tensor& table, const at::Tensor& programs,
                                int64_t elements_per_program, int64_t align,
                                cudaStream_t stream);

}  // namespace megatron_segment_copy
