// Fixed segments of one flat tensor copied, and cast, into fixed places of another, in one
// kernel (`segment_copy_kernels.h`); each element converted as `copy_` converts it (rounding to
// nearest even), so the bytes are `copy_`'s. A block copies one program's chunk: the layout of
// the Triton kernel in `megatron/core/fusions/segment_copy.py`, with 16-byte loads where the
// segments are aligned.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "segment_copy_kernels.h"

namespace megatron_segment_copy {
namespace {

constexpr int kThreads = 128;

template <typename T, int kWidth>
struct alignas(std::min<int>(16, sizeof(T) * kWidth)) Pack {
  T v[kWidth];
};

template <typename S, typename T, int kWidth>
__global__ void segment_copy_kernel(const S* __restrict__ source, T* __restrict__ target,
                                    const int64_t* __restrict__ table,
                                    const int32_t* __restrict__ programs,
                                    int64_t elements_per_program) {
  const int64_t segment = programs[2 * blockIdx.x];
  const int64_t first = programs[2 * blockIdx.x + 1] * elements_per_program;
  const S* from = source + table[3 * segment];
  T* to = target + table[3 * segment + 1];
  const int64_t numel = table[3 * segment + 2];
  const int64_t end = first + elements_per_program < numel ? first + elements_per_program : numel;
  // With kWidth > 1 the segment's size, and so `end`, are multiples of kWidth.
  for (int64_t i = first + threadIdx.x * kWidth; i < end; i += kThreads * kWidth) {
    const Pack<S, kWidth> in = *reinterpret_cast<const Pack<S, kWidth>*>(from + i);
    Pack<T, kWidth> out;
#pragma unroll
    for (int e = 0; e < kWidth; ++e) out.v[e] = static_cast<T>(in.v[e]);
    *reinterpret_cast<Pack<T, kWidth>*>(to + i) = out;
  }
}

template <typename S, typename T>
void launch(const at::Tensor& source, const at::Tensor& target, const at::Tensor& table,
            const at::Tensor& programs, int64_t elements_per_program, int64_t align,
            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(programs.size(0)));
  const auto* from = static_cast<const S*>(source.const_data_ptr());
  auto* to = static_cast<T*>(target.mutable_data_ptr());
  const auto* rows = table.const_data_ptr<int64_t>();
  const auto* chunks = programs.const_data_ptr<int32_t>();
  // `align` is 16 bytes of the narrower dtype: 8 elements with a 2-byte dtype, else 4.
  if (align == 8) {
    segment_copy_kernel<S, T, 8><<<grid, kThreads, 0, stream>>>(from, to, rows, chunks,
                                                                 elements_per_program);
  } else if (align == 4) {
    segment_copy_kernel<S, T, 4><<<grid, kThreads, 0, stream>>>(from, to, rows, chunks,
                                                                 elements_per_program);
  } else {
    segment_copy_kernel<S, T, 1><<<grid, kThreads, 0, stream>>>(from, to, rows, chunks,
                                                                 elements_per_program);
  }
}

template <typename S>
void launch_from(const at::Tensor& source, const at::Tensor& target, const at::Tensor& table,
                 const at::Tensor& programs, int64_t elements_per_program, int64_t align,
                 cudaStream_t stream) {
  switch (target.scalar_type()) {  // `segment_copy.cpp` admits these three
    case at::kBFloat16:
      return launch<S, c10::BFloat16>(source, target, table, programs, elements_per_program,
                                      align, stream);
    case at::kHalf:
      return launch<S, c10::Half>(source, target, table, programs, elements_per_program, align,
                                  stream);
    default:
      return launch<S, float>(source, target, table, programs, elements_per_program, align,
                              stream);
  }
}

}  // namespace

cudaError_t launch_segment_copy(const at::Tensor& source, const at::Tensor& target,
                                const at::Tensor& table, const at::Tensor& programs,
                                int64_t elements_per_program, int64_t align,
                                cudaStream_t stream) {
  if (programs.size(0) == 0) return cudaSuccess;
  switch (source.scalar_type()) {
    case at::kBFloat16:
      launch_from<c10::BFloat16>(source, target, table, programs, elements_per_program, align,
                                 stream);
      break;
    case at::kHalf:
      launch_from<c10::Half>(source, target, table, programs, elements_per_program, align,
                             stream);
      break;
    default:
      launch_from<float>(source, target, table, programs, elements_per_program, align, stream);
  }
  return cudaGetLastError();
}

}  // namespace megatron_segment_copy
