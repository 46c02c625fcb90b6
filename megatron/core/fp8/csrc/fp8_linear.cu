// The host path of an FP8 linear layer's forward and backward in one C++ call each
// (`megatron/core/fp8/cpp_linear.py` builds and loads it; `linear.py` calls it).
//
// In Python each cast and each GEMM of an FP8 linear layer costs the host tens of microseconds
// (argument handling, three allocations, a Triton launch, the Fp8Tensor bookkeeping); a step of
// small layers is bound by that host time. Here the forward's cast and GEMM, and the backward's
// cast, its two GEMMs and the bias gradient, run from one call each, with the same kernels'
// arithmetic as the Triton path (`kernels.py`) and the same `torch._scaled_mm` calls, so the
// results are the same bit for bit.
//
// The cast: `q = fp8(clamp(x * scale, -max, max))` (the product in fp32, NaN kept NaN), the
// absolute maximum (NaNs skipped) max-ed into a delayed-scaling record with an atomic max, and
// the transposed copy `[cols, round_up(rows, 16)]` with zero columns past `rows`. Under current
// scaling (no scale given) a first kernel takes the absolute maximum and the cast derives the
// scale from it on the GPU (Transformer Engine's `compute_scale_from_amax`).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>
#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;
constexpr int kThreads = 256;
constexpr int kVec = 4;  // consecutive columns per thread
constexpr int kRowsPerPass = kThreads / (kTileCols / kVec);
constexpr int kAlignment = 16;  // the transposed copy's rows are padded to this
constexpr int kAmaxThreads = 512;

template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <bool E4M3>
__device__ __forceinline__ uint8_t to_fp8(float value) {
  // Saturating (the values are clamped already): Hopper's conversion instruction has no other
  // mode, and a NaN stays NaN.
  return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, E4M3 ? __NV_E4M3 : __NV_E5M2);
}

__device__ __forceinline__ float scale_from_amax(float amax, float limit) {
  if (!(amax > 0.f) || isinf(amax)) return 1.f;  // 0, NaN or inf
  const float scale = __fdiv_rn(limit, amax);
  return isinf(scale) ? FLT_MAX : scale;
}

__device__ __forceinline__ float block_max(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) shared[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < blockDim.x / 32; ++w) value = fmaxf(value, shared[w]);
  }
  return value;
}

// Non-negative floats order as their bit patterns do.
__device__ __forceinline__ void atomic_max_nonnegative(float* address, float value) {
  atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
}

// `rowwise`, `transpose` and `vector` (4-element loads and stores: the columns a multiple of 4
// and the input aligned to 4 elements) are the same for every thread: run-time arguments cost
// nothing there, and keep the instantiations few.
template <typename T, bool E4M3, bool FROM_AMAX, bool RECORD>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const T* __restrict__ x, const float* __restrict__ scale_source,
                float* __restrict__ amax_out, uint8_t* __restrict__ out,
                uint8_t* __restrict__ out_t, float* __restrict__ scale_inv, int64_t rows,
                int64_t cols, int64_t padded_rows, float limit, bool rowwise, bool transpose,
                bool vector) {
  // The tile's FP8 bytes in the transposed order, read back as 4-byte words (the first shared
  // variable, at offset 0, so word-aligned; rows of 68 bytes keep each row so). The byte stores
  // into it still meet 4-way bank conflicts (each lane holds 4 consecutive columns), a likely
  // reason this kernel is slower than the Triton one on large tensors.
  __shared__ uint8_t tile[kTileCols][kTileRows + 4];
  __shared__ float warp_max[kThreads / 32];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  float scale = *scale_source;
  if (FROM_AMAX) scale = scale_from_amax(scale, limit);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *scale_inv = __fdiv_rn(1.f, scale);
  }
  const int tile_col = (threadIdx.x % (kTileCols / kVec)) * kVec;
  const int64_t col = col0 + tile_col;
  float local_max = 0.f;
#pragma unroll 4
  for (int r = threadIdx.x / (kTileCols / kVec); r < kTileRows; r += kRowsPerPass) {
    const int64_t row = row0 + r;
    float values[kVec];
    if (vector && row < rows && col + kVec <= cols) {
      const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(x + row * cols + col);
#pragma unroll
      for (int v = 0; v < kVec; ++v) values[v] = static_cast<float>(pack.v[v]);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const bool inside = row < rows && col + v < cols;
        values[v] = inside ? static_cast<float>(x[row * cols + col + v]) : 0.f;
      }
    }
    uint8_t bytes[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const float magnitude = fabsf(values[v]);
      if (RECORD && magnitude == magnitude) local_max = fmaxf(local_max, magnitude);
      float scaled = values[v] * scale;
      if (scaled == scaled) scaled = fminf(fmaxf(scaled, -limit), limit);
      bytes[v] = to_fp8<E4M3>(scaled);
    }
    if (rowwise && row < rows) {
      if (vector && col + kVec <= cols) {
        uint32_t word = 0;
#pragma unroll
        for (int v = 0; v < kVec; ++v) word |= static_cast<uint32_t>(bytes[v]) << (8 * v);
        *reinterpret_cast<uint32_t*>(out + row * cols + col) = word;
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          if (col + v < cols) out[row * cols + col + v] = bytes[v];
        }
      }
    }
    if (transpose) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) tile[tile_col + v][r] = bytes[v];
    }
  }
  if (RECORD) {
    const float tile_max = block_max(local_max, warp_max);
    if (threadIdx.x == 0) atomic_max_nonnegative(amax_out, tile_max);
  }
  if (transpose) {
    __syncthreads();
    // Output row `col0 + c` (an input column) gets the tile's 64 bytes (input rows row0..),
    // 4 at a time; rows past `rows` were cast from zeros, so their bytes are zero.
    constexpr int kWords = kTileRows / 4;
    for (int i = threadIdx.x; i < kTileCols * kWords; i += kThreads) {
      const int c = i / kWords;
      const int word = i % kWords;
      const int64_t out_row = col0 + c;
      const int64_t out_col = row0 + word * 4;
      if (out_row < cols && out_col < padded_rows) {
        *reinterpret_cast<uint32_t*>(out_t + out_row * padded_rows + out_col) =
            *reinterpret_cast<const uint32_t*>(&tile[c][word * 4]);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_kernel(const T* __restrict__ x, float* __restrict__ amax, int64_t numel) {
  __shared__ float warp_max[kAmaxThreads / 32];
  float local_max = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    const float magnitude = fabsf(static_cast<float>(x[i]));
    if (magnitude == magnitude) local_max = fmaxf(local_max, magnitude);
  }
  const float max_value = block_max(local_max, warp_max);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, max_value);
}

float fp8_limit(bool e4m3) { return e4m3 ? 448.f : 57344.f; }

at::ScalarType fp8_dtype(bool e4m3) {
  return e4m3 ? at::ScalarType::Float8_e4m3fn : at::ScalarType::Float8_e5m2;
}

template <typename T, bool E4M3, bool FROM_AMAX, bool RECORD>
void launch_cast_typed(const at::Tensor& x, const at::Tensor& scale_source,
                       const at::Tensor& record, const at::Tensor& out, const at::Tensor& out_t,
                       const at::Tensor& scale_inv, int64_t padded_rows, bool rowwise,
                       bool transpose, bool vector, cudaStream_t stream) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const dim3 grid((padded_rows + kTileRows - 1) / kTileRows, (cols + kTileCols - 1) / kTileCols);
  cast_kernel<T, E4M3, FROM_AMAX, RECORD><<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const T*>(x.data_ptr()), scale_source.data_ptr<float>(),
      RECORD ? record.data_ptr<float>() : nullptr,
      rowwise ? reinterpret_cast<uint8_t*>(out.data_ptr()) : nullptr,
      transpose ? reinterpret_cast<uint8_t*>(out_t.data_ptr()) : nullptr,
      scale_inv.data_ptr<float>(), rows, cols, padded_rows, fp8_limit(E4M3), rowwise,
      transpose, vector);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_cast(const at::Tensor& x, const at::Tensor& scale_source, bool from_amax,
                 const at::Tensor& record, bool e4m3, const at::Tensor& out,
                 const at::Tensor& out_t, const at::Tensor& scale_inv, int64_t padded_rows,
                 bool rowwise, bool transpose, bool vector, cudaStream_t stream) {
#define MEGATRON_TYPED(E4M3, FROM_AMAX, RECORD)                                             \
  launch_cast_typed<T, E4M3, FROM_AMAX, RECORD>(x, scale_source, record, out, out_t,        \
                                                scale_inv, padded_rows, rowwise, transpose, \
                                                vector, stream)
  if (from_amax) {
    // Current scaling's cast records nothing itself (`cast_impl` maxes its amax in after).
    if (e4m3) MEGATRON_TYPED(true, true, false); else MEGATRON_TYPED(false, true, false);
  } else if (record.defined()) {
    if (e4m3) MEGATRON_TYPED(true, false, true); else MEGATRON_TYPED(false, false, true);
  } else {
    if (e4m3) MEGATRON_TYPED(true, false, false); else MEGATRON_TYPED(false, false, false);
  }
#undef MEGATRON_TYPED
}

template <typename T>
void launch_amax(const at::Tensor& x, const at::Tensor& amax, cudaStream_t stream) {
  const int64_t numel = x.numel();
  const int blocks =
      static_cast<int>(std::min<int64_t>((numel + kAmaxThreads - 1) / kAmaxThreads, 4096));
  amax_kernel<T><<<blocks, kAmaxThreads, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()),
                                                      amax.data_ptr<float>(), numel);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The cast of a 2-D tensor (see the file's comment): {row-major FP8 or undefined, the scale's
// inverse, the transposed copy or undefined}.
std::vector<at::Tensor> cast_impl(const at::Tensor& input, const at::Tensor& scale,
                                  const at::Tensor& record, bool e4m3, bool rowwise,
                                  bool transpose) {
  TORCH_CHECK(input.dim() == 2 && input.is_cuda(), "fp8 cast: a 2-D CUDA tensor, got ",
              input.sizes());
  const at::Tensor x = input.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t padded_rows = (rows + kAlignment - 1) / kAlignment * kAlignment;
  const auto byte_options = x.options().dtype(fp8_dtype(e4m3));
  const auto float_options = x.options().dtype(at::kFloat);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool from_amax = !scale.defined();
  at::Tensor scale_source = scale;
  at::Tensor scale_inv;
  if (from_amax) {
    scale_source = at::zeros({}, float_options);
    scale_inv = at::empty({}, float_options);
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1 && scale.is_cuda(),
                "fp8 cast: the scale must be one fp32 element on the GPU");
    scale_inv = at::empty(scale.sizes(), float_options);
  }
  at::Tensor out = rowwise ? at::empty({rows, cols}, byte_options) : at::Tensor();
  at::Tensor out_t = transpose ? at::empty({cols, padded_rows}, byte_options) : at::Tensor();
  if (x.numel() == 0) {
    if (transpose) out_t.zero_();
    scale_inv.fill_(1.f);  // the scale of an empty tensor: 1, as its amax is 0
    if (!from_amax) scale_inv.copy_(scale.reciprocal().reshape(scale_inv.sizes()));
    return {out, scale_inv, out_t};
  }
  const bool vector = cols % kVec == 0 &&
                      reinterpret_cast<uintptr_t>(x.data_ptr()) % (x.element_size() * kVec) == 0;
  // bf16, fp16 and fp32 inputs (three instantiations, not torch's dispatch of every type).
#define MEGATRON_CAST(T)                                                                    \
  if (from_amax) launch_amax<T>(x, scale_source, stream);                                   \
  launch_cast<T>(x, scale_source, from_amax, record, e4m3, out, out_t, scale_inv, padded_rows, \
                 rowwise, transpose, vector, stream)
  switch (x.scalar_type()) {
    case at::kBFloat16:
      MEGATRON_CAST(at::BFloat16);
      break;
    case at::kHalf:
      MEGATRON_CAST(at::Half);
      break;
    case at::kFloat:
      MEGATRON_CAST(float);
      break;
    default:
      TORCH_CHECK(false, "fp8 cast: bf16, fp16 or fp32 input, got ", x.scalar_type());
  }
#undef MEGATRON_CAST
  if (from_amax && record.defined()) {
    // Current scaling's amax (the scale's source) max-ed into the record, as `quantize` does.
    at::Tensor destination = record;
    at::maximum_out(destination, record, scale_source.reshape(record.sizes()));
  }
  return {out, scale_inv, out_t};
}

at::Tensor optional_or_undefined(const c10::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? *tensor : at::Tensor();
}

std::vector<at::Tensor> cast(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                             const c10::optional<at::Tensor>& record, bool e4m3, bool rowwise,
                             bool transpose) {
  const c10::cuda::CUDAGuard guard(x.device());
  return cast_impl(x, optional_or_undefined(scale), optional_or_undefined(record), e4m3,
                   rowwise, transpose);
}

// Forward: `x` cast (and, with `transpose`, its transposed copy for the weight gradient), then
// `x_fp8 @ weight + bias` by `torch._scaled_mm`, the bias in the GEMM where cuBLASLt takes it
// (a bf16 / fp16 output of the bias's dtype), else added after. Returns {out, the transposed
// copy or undefined, its scale's inverse}.
std::vector<at::Tensor> linear_forward(const at::Tensor& x, const c10::optional<at::Tensor>& scale,
                                       const c10::optional<at::Tensor>& record, bool e4m3,
                                       bool transpose, const at::Tensor& weight,
                                       const at::Tensor& weight_scale_inv,
                                       const c10::optional<at::Tensor>& bias, bool fast_accum) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto cast_out = cast_impl(x, optional_or_undefined(scale), optional_or_undefined(record), e4m3,
                            /*rowwise=*/true, transpose);
  const at::ScalarType out_dtype = x.scalar_type();
  const bool fused_bias = bias.has_value() && out_dtype != at::kFloat &&
                          bias->scalar_type() == out_dtype;
  at::Tensor out = at::_scaled_mm(cast_out[0], weight, cast_out[1], weight_scale_inv,
                                  fused_bias ? bias : c10::optional<at::Tensor>(),
                                  c10::nullopt, out_dtype, fast_accum);
  if (bias.has_value() && !fused_bias) out = out + *bias;
  return {out, cast_out[2], cast_out[1]};
}

enum WgradMode : int64_t { kReturn = 0, kOverwrite = 1, kCopy = 2, kAccumulate = 3 };

// Backward: the output gradient cast (with its transposed copy where the weight gradient is
// wanted), the input gradient `grad_fp8 @ weight_t` in `input_dtype`, the weight gradient
// `grad_t @ input_t^T` (returned in `wgrad_dtype`, or written, copied or added into `target`
// by `wgrad_mode`), and the bias gradient (the high-precision gradient's column sums). Returns
// {input gradient, weight gradient (kReturn only), bias gradient}, each undefined where not
// asked for.
std::vector<at::Tensor> linear_backward(
    const at::Tensor& grad, const c10::optional<at::Tensor>& scale,
    const c10::optional<at::Tensor>& record, bool e4m3, bool need_input,
    const c10::optional<at::Tensor>& weight_t, const c10::optional<at::Tensor>& weight_scale_inv,
    at::ScalarType input_dtype, bool need_wgrad, const c10::optional<at::Tensor>& input_t,
    const c10::optional<at::Tensor>& input_scale_inv, int64_t wgrad_mode,
    const c10::optional<at::Tensor>& target, at::ScalarType wgrad_dtype, bool need_bias) {
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor grad_input, grad_weight, grad_bias;
  if (need_input || need_wgrad) {
    auto cast_out = cast_impl(grad, optional_or_undefined(scale), optional_or_undefined(record),
                              e4m3, /*rowwise=*/need_input, /*transpose=*/need_wgrad);
    if (need_input) {
      grad_input = at::_scaled_mm(cast_out[0], *weight_t, cast_out[1], *weight_scale_inv,
                                  c10::nullopt, c10::nullopt, input_dtype, false);
    }
    if (need_wgrad) {
      const at::Tensor a = cast_out[2];
      const at::Tensor b = input_t->t();
      switch (wgrad_mode) {
        case kReturn:
          grad_weight = at::_scaled_mm(a, b, cast_out[1], *input_scale_inv, c10::nullopt,
                                       c10::nullopt, wgrad_dtype, false);
          break;
        case kOverwrite: {
          at::Tensor out = *target;
          at::_scaled_mm_out(out, a, b, cast_out[1], *input_scale_inv, c10::nullopt,
                             c10::nullopt, out.scalar_type(), false);
          break;
        }
        case kCopy:
          target->copy_(at::_scaled_mm(a, b, cast_out[1], *input_scale_inv, c10::nullopt,
                                       c10::nullopt, target->scalar_type(), false));
          break;
        case kAccumulate:
          target->add_(at::_scaled_mm(a, b, cast_out[1], *input_scale_inv, c10::nullopt,
                                      c10::nullopt, target->scalar_type(), false));
          break;
        default:
          TORCH_CHECK(false, "fp8 linear backward: unknown weight-gradient mode ", wgrad_mode);
      }
    }
  }
  if (need_bias) grad_bias = grad.sum(0);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cast", &cast, "FP8 cast of a 2-D CUDA tensor (and its padded transposed copy)",
        py::arg("x"), py::arg("scale"), py::arg("record"), py::arg("e4m3"),
        py::arg("rowwise") = true, py::arg("transpose") = true);
  m.def("linear_forward", &linear_forward, "An FP8 linear layer's forward: cast, then GEMM");
  m.def("linear_backward", &linear_backward,
        "An FP8 linear layer's backward: cast, input- and weight-gradient GEMMs, bias gradient");
}
