// The rotary embedding of a layer's queries and keys in one kernel (`rope_kernels.h`): the
// arithmetic of the Triton kernel in `fused_rope.py`. For output channel j with pair partner p(j),
//
//     forward:   y[j] = x[j]  * cos[j] + x[p(j)]  * sin[j]
//     backward: dx[j] = dy[j] * cos[j] + dy[p(j)] * sin[p(j)]
//
// in fp32, rounded once to the tensors' dtype (the multiply-add's order fixed, so every build
// rounds alike).

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "rope_kernels.h"

namespace megatron_rope {
namespace {

constexpr int kThreads = 256;
// At most this many blocks share one (position, batch entry) row's channels.
constexpr int kMaxBlocksPerRow = 16;

struct Operand {
  int64_t stride_s, stride_b, stride_n;
  int heads;
};

template <typename T>
__global__ void rotate_kernel(const T* __restrict__ query, const T* __restrict__ key,
                              T* __restrict__ query_out, T* __restrict__ key_out,
                              const float* __restrict__ cos, const float* __restrict__ sin,
                              Operand q, Operand k, int64_t batch, int dim, int rot_dim,
                              bool interleaved, bool transpose) {
  const int64_t row = blockIdx.x;  // position * batch + batch entry
  const int64_t s = row / batch;
  const int64_t b = row % batch;
  const float* cos_row = cos + s * rot_dim;
  const float* sin_row = sin + s * rot_dim;
  const int half = rot_dim / 2;
  const int query_elements = q.heads * dim;
  const int total = (q.heads + k.heads) * dim;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
    const bool in_query = i < query_elements;
    const int local = in_query ? i : i - query_elements;
    const int n = local / dim;
    const int j = local - n * dim;
    const T* x;
    T* out;
    if (in_query) {
      x = query + s * q.stride_s + b * q.stride_b + n * q.stride_n;
      out = query_out + (row * q.heads + n) * dim;
    } else {
      x = key + s * k.stride_s + b * k.stride_b + n * k.stride_n;
      out = key_out + (row * k.heads + n) * dim;
    }
    float value = static_cast<float>(x[j]);
    if (j < rot_dim) {
      const int partner = interleaved ? (j ^ 1) : (j < half ? j + half : j - half);
      const float sine = transpose ? sin_row[partner] : sin_row[j];
      value = __fmaf_rn(value, cos_row[j], __fmul_rn(static_cast<float>(x[partner]), sine));
    }
    out[j] = static_cast<T>(value);
  }
}

}  // namespace

cudaError_t launch_rotate(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                          const at::Tensor& sin, bool interleaved, bool transpose,
                          const at::Tensor& query_out, const at::Tensor& key_out,
                          cudaStream_t stream) {
  const int64_t rows = query.size(0) * query.size(1);
  if (rows == 0) return cudaSuccess;
  const int dim = static_cast<int>(query.size(3));
  const Operand q{query.stride(0), query.stride(1), query.stride(2),
                  static_cast<int>(query.size(2))};
  const Operand k{key.stride(0), key.stride(1), key.stride(2), static_cast<int>(key.size(2))};
  const int total = (q.heads + k.heads) * dim;
  const int blocks_per_row =
      std::max(1, std::min(kMaxBlocksPerRow, (total + kThreads - 1) / kThreads));
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(blocks_per_row));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, query.scalar_type(), "rotate", [&] {
        rotate_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
            query.const_data_ptr<scalar_t>(), key.const_data_ptr<scalar_t>(),
            query_out.mutable_data_ptr<scalar_t>(), key_out.mutable_data_ptr<scalar_t>(),
            cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), q, k, query.size(1), dim,
            static_cast<int>(cos.size(1)), interleaved, transpose);
      });
  return cudaGetLastError();
}

}  // namespace megatron_rope
