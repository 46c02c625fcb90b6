// The rotary embedding of a layer's queries and keys in one kernel (`rope_kernels.h`): the
// arithmetic of the Triton kernel in `fused_rope.py`. For output channel j with pair partner p(j),
//
//     forward:   y[j] = x[j]  * cos[j] + x[p(j)]  * sin[j]
//     backward: dx[j] = dy[j] * cos[j] + dy[p(j)] * sin[p(j)]
//
// in fp32, rounded once to the tensors' dtype (the multiply-add's order fixed, so every build
// rounds alike).
//
// A thread rotates one unit of a head: kWidth channels read with one vector load, together with
// their partners (the same load where pairs are adjacent, a second one half the rotated width
// away otherwise). The loads are as wide as the tensors' alignment allows (16 bytes when
// addresses and strides are multiples of 16 bytes, as the QKV projection's views are): loads of
// one element made the kernel bound by its instructions, several times slower than Triton's.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "rope_kernels.h"

namespace megatron_rope {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kMaxBytesPerLoad = 16;
// At most this many blocks share one (position, batch entry) row's units.
constexpr int kMaxBlocksPerRow = 16;

template <typename T, int kWidth>
struct alignas(sizeof(T) * kWidth) Pack {
  T v[kWidth];
};

struct Operand {
  int64_t stride_s, stride_b, stride_n;
  int heads;
};

// A head's channels and how they split into units of kWidth channels: `rotated_units` rotate,
// the rest pass through.
struct HeadLayout {
  int dim, rot_dim, rotated_units, units;
  bool interleaved;
};

__device__ __forceinline__ float rotate(float x, float cosine, float x_partner, float sine) {
  return __fmaf_rn(x, cosine, __fmul_rn(x_partner, sine));
}

template <typename T, int kWidth>
__device__ __forceinline__ Pack<T, kWidth> load(const T* p) {
  return *reinterpret_cast<const Pack<T, kWidth>*>(p);
}

template <typename T, int kWidth>
__device__ __forceinline__ void store(T* p, const Pack<T, kWidth>& pack) {
  *reinterpret_cast<Pack<T, kWidth>*>(p) = pack;
}

// Rotates (or passes through) unit `u` of the head at `x` into `out`; `cos` and `sin` point at
// the position's tables.
template <typename T, int kWidth>
__device__ __forceinline__ void rotate_unit(const T* __restrict__ x, T* __restrict__ out,
                                            const float* __restrict__ cos,
                                            const float* __restrict__ sin, int u,
                                            const HeadLayout& head, bool transpose) {
  if (u >= head.rotated_units) {
    const int j = head.rot_dim + (u - head.rotated_units) * kWidth;
    store<T, kWidth>(out + j, load<T, kWidth>(x + j));
    return;
  }
  const int j = u * kWidth;
  const Pack<float, kWidth> c = load<float, kWidth>(cos + j);
  const Pack<float, kWidth> s = load<float, kWidth>(sin + j);
  const Pack<T, kWidth> a = load<T, kWidth>(x + j);
  Pack<T, kWidth> y;
  if (head.interleaved) {
    if constexpr (kWidth == 1) {  // the partner outside the load
      const int p = j ^ 1;
      const float sine = transpose ? sin[p] : s.v[0];
      y.v[0] = static_cast<T>(rotate(static_cast<float>(a.v[0]), c.v[0],
                                     static_cast<float>(x[p]), sine));
    } else {
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const float sine = transpose ? s.v[e ^ 1] : s.v[e];
        y.v[e] = static_cast<T>(rotate(static_cast<float>(a.v[e]), c.v[e],
                                       static_cast<float>(a.v[e ^ 1]), sine));
      }
    }
    store<T, kWidth>(out + j, y);
    return;
  }
  // Channel j's partner is j + half: its unit is the second half's unit u.
  const int half = head.rot_dim / 2;
  const Pack<float, kWidth> c2 = load<float, kWidth>(cos + j + half);
  const Pack<float, kWidth> s2 = load<float, kWidth>(sin + j + half);
  const Pack<T, kWidth> b = load<T, kWidth>(x + j + half);
  Pack<T, kWidth> y2;
#pragma unroll
  for (int e = 0; e < kWidth; ++e) {
    const float lo = static_cast<float>(a.v[e]);
    const float hi = static_cast<float>(b.v[e]);
    y.v[e] = static_cast<T>(rotate(lo, c.v[e], hi, transpose ? s2.v[e] : s.v[e]));
    y2.v[e] = static_cast<T>(rotate(hi, c2.v[e], lo, transpose ? s.v[e] : s2.v[e]));
  }
  store<T, kWidth>(out + j, y);
  store<T, kWidth>(out + j + half, y2);
}

template <typename T, int kWidth>
__global__ void rotate_kernel(const T* __restrict__ query, const T* __restrict__ key,
                              T* __restrict__ query_out, T* __restrict__ key_out,
                              const float* __restrict__ cos, const float* __restrict__ sin,
                              Operand q, Operand k, int batch, HeadLayout head, bool transpose) {
  const int row = blockIdx.x;  // position * batch + batch entry
  const int s = row / batch;
  const int b = row - s * batch;
  const float* cos_row = cos + static_cast<int64_t>(s) * head.rot_dim;
  const float* sin_row = sin + static_cast<int64_t>(s) * head.rot_dim;
  const int query_units = q.heads * head.units;
  const int total = (q.heads + k.heads) * head.units;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < total; i += gridDim.y * blockDim.x) {
    const bool in_query = i < query_units;
    const int local = in_query ? i : i - query_units;
    const int n = local / head.units;
    const int u = local - n * head.units;
    const Operand& op = in_query ? q : k;
    const T* x = (in_query ? query : key) + s * op.stride_s + b * op.stride_b + n * op.stride_n;
    T* out = (in_query ? query_out : key_out) +
             (static_cast<int64_t>(row) * op.heads + n) * head.dim;
    rotate_unit<T, kWidth>(x, out, cos_row, sin_row, u, head, transpose);
  }
}

bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// The widest unit (channels per load) that every address and stride allows.
template <typename T>
int unit_width(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
               const at::Tensor& sin, bool interleaved) {
  const int64_t dim = query.size(3);
  const int64_t rot_dim = cos.size(1);
  // A non-interleaved unit and its partners' unit split the rotated channels in two halves.
  const int64_t rotated_span = interleaved ? rot_dim : rot_dim / 2;
  for (int width = kMaxBytesPerLoad / static_cast<int>(sizeof(T)); width > 1; width /= 2) {
    bool fits = dim % width == 0 && rotated_span % width == 0 &&
                aligned(cos.const_data_ptr(), width * 4) &&
                aligned(sin.const_data_ptr(), width * 4);
    for (const at::Tensor* t : {&query, &key}) {
      fits = fits && aligned(t->const_data_ptr(), width * sizeof(T)) &&
             t->stride(0) % width == 0 && t->stride(1) % width == 0 && t->stride(2) % width == 0;
    }
    if (fits) return width;
  }
  return 1;
}

template <typename T, int kWidth>
void launch(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
            const at::Tensor& sin, bool interleaved, bool transpose, const at::Tensor& query_out,
            const at::Tensor& key_out, cudaStream_t stream) {
  const int dim = static_cast<int>(query.size(3));
  const int rot_dim = static_cast<int>(cos.size(1));
  const int rotated_units = (interleaved ? rot_dim : rot_dim / 2) / kWidth;
  const HeadLayout head{dim, rot_dim, rotated_units, rotated_units + (dim - rot_dim) / kWidth,
                        interleaved};
  const Operand q{query.stride(0), query.stride(1), query.stride(2),
                  static_cast<int>(query.size(2))};
  const Operand k{key.stride(0), key.stride(1), key.stride(2), static_cast<int>(key.size(2))};
  const int total = (q.heads + k.heads) * head.units;
  if (total == 0) return;  // no heads, or heads without channels
  const int threads = std::min(kMaxThreads, (total + 31) / 32 * 32);
  const int blocks_per_row = std::min(kMaxBlocksPerRow, (total + threads - 1) / threads);
  const dim3 grid(static_cast<unsigned>(query.size(0) * query.size(1)),
                  static_cast<unsigned>(blocks_per_row));
  rotate_kernel<T, kWidth><<<grid, threads, 0, stream>>>(
      query.const_data_ptr<T>(), key.const_data_ptr<T>(), query_out.mutable_data_ptr<T>(),
      key_out.mutable_data_ptr<T>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), q,
      k, static_cast<int>(query.size(1)), head, transpose);
}

}  // namespace

cudaError_t launch_rotate(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                          const at::Tensor& sin, bool interleaved, bool transpose,
                          const at::Tensor& query_out, const at::Tensor& key_out,
                          cudaStream_t stream) {
  if (query.size(0) * query.size(1) == 0) return cudaSuccess;
  const auto dispatch = [&](auto zero) {
    using T = decltype(zero);
    switch (unit_width<T>(query, key, cos, sin, interleaved)) {
      case 8:
        return launch<T, 8>(query, key, cos, sin, interleaved, transpose, query_out, key_out,
                            stream);
      case 4:
        return launch<T, 4>(query, key, cos, sin, interleaved, transpose, query_out, key_out,
                            stream);
      case 2:
        return launch<T, 2>(query, key, cos, sin, interleaved, transpose, query_out, key_out,
                            stream);
      default:
        return launch<T, 1>(query, key, cos, sin, interleaved, transpose, query_out, key_out,
                            stream);
    }
  };
  switch (query.scalar_type()) {  // `rope.cpp` admits these three
    case at::kBFloat16:
      dispatch(c10::BFloat16(0.0f));
      break;
    case at::kHalf:
      dispatch(c10::Half(0.0f));
      break;
    default:
      dispatch(0.0f);
  }
  return cudaGetLastError();
}

}  // namespace megatron_rope
