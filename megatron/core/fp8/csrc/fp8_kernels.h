// The CUDA kernels of the FP8 linear layers' C++ path (`fp8_kernels.cu`), launched on a stream.
// The callers (`fp8_linear.cpp`) check the arguments and allocate the outputs; each launcher
// returns the launch's error for the caller to raise.

#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace megatron_fp8 {

// The transposed copy's rows (the input's rows) are padded to a multiple of this.
constexpr int64_t kTransposedRowAlignment = 16;
// The widest input the cast takes: its grid has a tile per 128 columns in CUDA's y dimension.
constexpr int64_t kMaxCastColumns = 65535LL * 128;
// The most rows the byte transpose takes: the 64x64 kernel has a tile per 64 rows in the grid's y
// dimension (the 128x128 one, per 128 rows, would take twice as many).
constexpr int64_t kMaxTransposeRows = 65535LL * 64;

// `x` ([rows, cols], bf16, fp16 or fp32, contiguous) cast to FP8: `out` ([rows, cols]; undefined:
// not made) and `out_t` ([cols, padded rows], the padding zero; undefined: not made) by the scale
// in `scale_source` (one fp32 element), or, with `scale_from_amax`, by `limit / amax` with the
// absolute maximum in `scale_source`. `scale_inv` gets the scale's inverse; `record` (undefined:
// none) gets the absolute maximum (NaNs skipped) max-ed in.
cudaError_t launch_cast(const at::Tensor& x, const at::Tensor& scale_source, bool scale_from_amax,
                        const at::Tensor& record, bool e4m3, const at::Tensor& out,
                        const at::Tensor& out_t, const at::Tensor& scale_inv,
                        cudaStream_t stream);

// Max-es the absolute maximum of `x` (contiguous; NaNs skipped) into `amax` (one fp32 zero or
// earlier maximum).
cudaError_t launch_amax(const at::Tensor& x, const at::Tensor& amax, cudaStream_t stream);

// `out` ([cols, rows]) = the transpose of `data` ([rows, cols]), both contiguous, 1-byte
// elements.
cudaError_t launch_transpose(const at::Tensor& data, const at::Tensor& out, cudaStream_t stream);

}  // namespace megatron_fp8
