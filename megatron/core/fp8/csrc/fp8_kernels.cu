// The FP8 linear layers' CUDA kernels (`fp8_kernels.h` says what each launcher does).
//
// The cast: `q = fp8(clamp(x * scale, -max, max))` (the product in fp32, NaN kept NaN), the
// absolute maximum (NaNs skipped) max-ed into a delayed-scaling record with an atomic max, and
// the transposed copy `[cols, round_up(rows, 16)]` with zero columns past `rows`, with the
// arithmetic of the Triton kernel (`kernels.py`), so the bytes are the same. Under current
// scaling a first kernel takes the absolute maximum and the cast derives the scale from it on
// the GPU (Transformer Engine's `compute_scale_from_amax`).
//
// No exception leaves this file: the launchers return the launch's error.

#include "fp8_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

namespace megatron_fp8 {
namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;
constexpr int kThreads = 256;
// Each thread casts blocks of 4 rows x 4 columns: 4-element loads and 4-byte stores along the
// rows, and, transposed in registers, 4-byte words along the columns for the transposed copy.
constexpr int kBlock = 4;
constexpr int kColBlocks = kTileCols / kBlock;  // 32: a warp spans the tile's columns
constexpr int kRowBlocks = kTileRows / kBlock;  // 16
constexpr int kWarps = kThreads / 32;
constexpr int kWordsPerColumn = kTileRows / 4;  // a tile column's FP8 bytes as 4-byte words
constexpr int kAmaxThreads = 512;

template <typename T>
struct alignas(sizeof(T) * kBlock) Pack {
  T v[kBlock];
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

// `x[i] = x[i ^ mask]` for the 4 elements (mask 0-3, the same in registers as a permutation).
__device__ __forceinline__ void xor_permute(uint32_t (&x)[4], int mask) {
  if (mask & 1) {
    uint32_t t = x[0]; x[0] = x[1]; x[1] = t;
    t = x[2]; x[2] = x[3]; x[3] = t;
  }
  if (mask & 2) {
    uint32_t t = x[0]; x[0] = x[2]; x[2] = t;
    t = x[1]; x[1] = x[3]; x[3] = t;
  }
}

// The shared tile holds the FP8 bytes in the transposed order: for each of the tile's 128
// columns, its 64 rows as 16 words. Word `w` of column `c` sits at slot `w ^ ((c / 4) % 16)`
// of the column: with that swizzle a warp's word stores (32 column blocks, one row block) and
// its 16-byte loads (8 columns' quarters at a time) each touch every bank once.
__device__ __forceinline__ int tile_slot(int column, int word) {
  return column * kWordsPerColumn + (word ^ ((column / kBlock) % kWordsPerColumn));
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
  __shared__ alignas(16) uint32_t tile[kTileCols * kWordsPerColumn];
  __shared__ float warp_max[kWarps];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  float scale = *scale_source;
  if (FROM_AMAX) scale = scale_from_amax(scale, limit);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *scale_inv = __fdiv_rn(1.f, scale);
  }
  const int col_block = threadIdx.x % kColBlocks;
  const int64_t col = col0 + col_block * kBlock;
  const bool vector_cols = vector && col + kBlock <= cols;
  float local_max = 0.f;
  // The thread's blocks: row blocks `threadIdx.x / 32`, then `+ kWarps`. (Issuing both
  // blocks' loads first took more registers, fewer resident blocks, and ran slower.)
#pragma unroll
  for (int row_block = threadIdx.x / kColBlocks; row_block < kRowBlocks; row_block += kWarps) {
    // The block's bytes, row by row: byte `v` of `words[i]` is row i, column v.
    uint32_t words[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      const int64_t row = row0 + row_block * kBlock + i;
      float values[kBlock];
      if (vector_cols && row < rows) {
        const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(x + row * cols + col);
#pragma unroll
        for (int v = 0; v < kBlock; ++v) values[v] = static_cast<float>(pack.v[v]);
      } else {
#pragma unroll
        for (int v = 0; v < kBlock; ++v) {
          const bool inside = row < rows && col + v < cols;
          values[v] = inside ? static_cast<float>(x[row * cols + col + v]) : 0.f;
        }
      }
      uint32_t word = 0;
#pragma unroll
      for (int v = 0; v < kBlock; ++v) {
        const float magnitude = fabsf(values[v]);
        if (RECORD && magnitude == magnitude) local_max = fmaxf(local_max, magnitude);
        float scaled = values[v] * scale;
        if (scaled == scaled) scaled = fminf(fmaxf(scaled, -limit), limit);
        word |= static_cast<uint32_t>(to_fp8<E4M3>(scaled)) << (8 * v);
      }
      words[i] = word;
      if (rowwise && row < rows) {
        if (vector_cols) {
          *reinterpret_cast<uint32_t*>(out + row * cols + col) = word;
        } else {
#pragma unroll
          for (int v = 0; v < kBlock; ++v) {
            if (col + v < cols) out[row * cols + col + v] = (word >> (8 * v)) & 0xffu;
          }
        }
      }
    }
    if (transpose) {
      // The 4x4 bytes transposed: byte i of `columns[v]` is row i, column v.
      uint32_t columns[kBlock];
      const uint32_t lo01 = __byte_perm(words[0], words[1], 0x5140);  // c0r0 c0r1 c1r0 c1r1
      const uint32_t hi01 = __byte_perm(words[0], words[1], 0x7362);  // c2r0 c2r1 c3r0 c3r1
      const uint32_t lo23 = __byte_perm(words[2], words[3], 0x5140);
      const uint32_t hi23 = __byte_perm(words[2], words[3], 0x7362);
      columns[0] = __byte_perm(lo01, lo23, 0x5410);
      columns[1] = __byte_perm(lo01, lo23, 0x7632);
      columns[2] = __byte_perm(hi01, hi23, 0x5410);
      columns[3] = __byte_perm(hi01, hi23, 0x7632);
      // The upper half of the warp stores its columns in the order 1, 0, 3, 2: with the
      // swizzle, the 32 lanes' words of each store fall in 32 different banks.
      const int half = col_block / (kColBlocks / 2);
      xor_permute(columns, half);
#pragma unroll
      for (int s = 0; s < kBlock; ++s) {
        tile[tile_slot(col_block * kBlock + (s ^ half), row_block)] = columns[s];
      }
    }
  }
  if (RECORD) {
    const float tile_max = block_max(local_max, warp_max);
    if (threadIdx.x == 0) atomic_max_nonnegative(amax_out, tile_max);
  }
  if (transpose) {
    __syncthreads();
    // Output row `col0 + c` (an input column) gets the tile's 64 bytes (input rows row0..),
    // 16 at a time; rows past `rows` were cast from zeros, so their bytes are zero.
    constexpr int kQuads = kWordsPerColumn / 4;
    for (int i = threadIdx.x; i < kTileCols * kQuads; i += kThreads) {
      const int c = i / kQuads;
      const int quad = i % kQuads;
      const int64_t out_row = col0 + c;
      const int64_t out_col = row0 + quad * 16;
      if (out_row < cols && out_col < padded_rows) {
        // The swizzle moves whole 16-byte quads (and permutes the words inside them).
        const int swizzle = (c / kBlock) % kWordsPerColumn;
        const uint4 stored = *reinterpret_cast<const uint4*>(
            &tile[c * kWordsPerColumn + 4 * (quad ^ (swizzle / 4))]);
        uint32_t quad_words[4] = {stored.x, stored.y, stored.z, stored.w};
        xor_permute(quad_words, swizzle % 4);
        *reinterpret_cast<uint4*>(out_t + out_row * padded_rows + out_col) =
            make_uint4(quad_words[0], quad_words[1], quad_words[2], quad_words[3]);
      }
    }
  }
}

// The absolute maximum of `x` (NaNs skipped), max-ed into `amax`; `vector`: 4-element loads
// (the input aligned to 4 elements), the last `numel % 4` elements read one by one.
template <typename T>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_kernel(const T* __restrict__ x, float* __restrict__ amax, int64_t numel, bool vector) {
  __shared__ float warp_max[kAmaxThreads / 32];
  float local_max = 0.f;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t packs = vector ? numel / kBlock : 0;
  for (int64_t p = first; p < packs; p += stride) {
    const Pack<T> pack = reinterpret_cast<const Pack<T>*>(x)[p];
#pragma unroll
    for (int v = 0; v < kBlock; ++v) {
      const float magnitude = fabsf(static_cast<float>(pack.v[v]));
      if (magnitude == magnitude) local_max = fmaxf(local_max, magnitude);
    }
  }
  for (int64_t i = packs * kBlock + first; i < numel; i += stride) {
    const float magnitude = fabsf(static_cast<float>(x[i]));
    if (magnitude == magnitude) local_max = fmaxf(local_max, magnitude);
  }
  const float max_value = block_max(local_max, warp_max);
  if (threadIdx.x == 0) atomic_max_nonnegative(amax, max_value);
}


constexpr int kTransposeTile = 64;
constexpr int kTransposeThreads = 256;

// A 64x64 tile of bytes through shared memory, 4 bytes per load and store where `vector` (rows
// and columns multiples of 4, both pointers 4-byte aligned): what `transpose_wide_kernel` does
// not take (sizes that are not multiples of 16, pointers not 16-byte aligned).
__global__ void __launch_bounds__(kTransposeThreads)
    transpose_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t rows,
                     int64_t cols, bool vector) {
  __shared__ alignas(4) uint8_t tile[kTransposeTile][kTransposeTile + 4];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
  constexpr int kWordsPerRow = kTransposeTile / 4;
  constexpr int kRowsPerPass = kTransposeThreads / kWordsPerRow;
  const int word = threadIdx.x % kWordsPerRow;
#pragma unroll
  for (int r = threadIdx.x / kWordsPerRow; r < kTransposeTile; r += kRowsPerPass) {
    const int64_t row = row0 + r, col = col0 + 4 * word;
    uint32_t bytes = 0;
    if (row < rows) {
      if (vector && col + 4 <= cols) {
        bytes = *reinterpret_cast<const uint32_t*>(in + row * cols + col);
      } else {
        for (int v = 0; v < 4; ++v) {
          if (col + v < cols) bytes |= static_cast<uint32_t>(in[row * cols + col + v]) << (8 * v);
        }
      }
    }
    *reinterpret_cast<uint32_t*>(&tile[r][4 * word]) = bytes;
  }
  __syncthreads();
#pragma unroll
  for (int c = threadIdx.x / kWordsPerRow; c < kTransposeTile; c += kRowsPerPass) {
    const int64_t out_row = col0 + c, out_col = row0 + 4 * word;
    if (out_row >= cols) continue;
    const uint32_t bytes = tile[4 * word][c] | (tile[4 * word + 1][c] << 8) |
                           (tile[4 * word + 2][c] << 16) |
                           (static_cast<uint32_t>(tile[4 * word + 3][c]) << 24);
    if (vector && out_col + 4 <= rows) {
      *reinterpret_cast<uint32_t*>(out + out_row * rows + out_col) = bytes;
    } else {
      for (int v = 0; v < 4; ++v) {
        if (out_col + v < rows) out[out_row * rows + out_col + v] = (bytes >> (8 * v)) & 0xffu;
      }
    }
  }
}

constexpr int kWideTile = 128;
constexpr int kWideChunks = kWideTile / 16;  // a tile row's 16-byte chunks
constexpr int kWideThreads = 256;

// A 128x128 tile of bytes through shared memory with 16-byte loads and stores, for rows and
// columns that are multiples of 16 and pointers 16-byte aligned (every weight of a model whose
// sizes are multiples of 16): 3.5 TB/s on an H200 against the 64x64 kernel's 2.1, near a copy's
// 3.8. A thread loads a chunk (16 bytes of a row); a thread then reads 16 rows' 4-byte words
// of 4 columns, transposes the 16x4 bytes in registers, and stores 16 bytes of each of the 4
// output rows, so a warp writes whole 128-byte output lines. Chunk `m` of tile row `r` sits at
// chunk `m ^ (r / 16) % 8` of its shared row: the loads' stores (a quarter warp: one row's 8
// chunks) and the word reads (a warp: 8 groups of 16 rows, 4 words each) touch every bank once.
__global__ void __launch_bounds__(kWideThreads)
    transpose_wide_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out,
                          int64_t rows, int64_t cols) {
  __shared__ alignas(16) uint32_t tile[kWideTile][kWideTile / 4];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kWideTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kWideTile;
  constexpr int kRowsPerPass = kWideThreads / kWideChunks;
  const int chunk = threadIdx.x % kWideChunks;
#pragma unroll
  for (int r = threadIdx.x / kWideChunks; r < kWideTile; r += kRowsPerPass) {
    const int64_t row = row0 + r, col = col0 + 16 * chunk;
    uint4 bytes = make_uint4(0, 0, 0, 0);
    if (row < rows && col < cols) bytes = *reinterpret_cast<const uint4*>(in + row * cols + col);
    const int slot = chunk ^ ((r / 16) % kWideChunks);
    *reinterpret_cast<uint4*>(&tile[r][4 * slot]) = bytes;
  }
  __syncthreads();
  // Rows 16 * `group`.. of the tile (16 output bytes), columns 4 * `word`.. (4 output rows).
  const int group = threadIdx.x % kWideChunks, word = threadIdx.x / kWideChunks;
  const int64_t out_col = row0 + 16 * group;
  if (out_col >= rows) return;
  uint32_t w[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) w[k] = tile[16 * group + k][word ^ (4 * group)];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t out_row = col0 + 4 * word + j;
    if (out_row >= cols) break;
    // Byte j of w[i], w[i + 1] in the low half-word, then two such pairs into one word.
    const uint32_t pick = j | ((j + 4) << 4);
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __byte_perm(__byte_perm(w[4 * i], w[4 * i + 1], pick),
                         __byte_perm(w[4 * i + 2], w[4 * i + 3], pick), 0x5410);
    }
    *reinterpret_cast<uint4*>(out + out_row * rows + out_col) = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

float fp8_limit(bool e4m3) { return e4m3 ? 448.f : 57344.f; }

bool aligned_to(const at::Tensor& x, int64_t elements) {
  return reinterpret_cast<uintptr_t>(x.data_ptr()) % (x.element_size() * elements) == 0;
}

template <typename T, bool E4M3, bool FROM_AMAX, bool RECORD>
void launch_cast_typed(const at::Tensor& x, const at::Tensor& scale_source,
                       const at::Tensor& record, const at::Tensor& out, const at::Tensor& out_t,
                       const at::Tensor& scale_inv, cudaStream_t stream) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const int64_t padded_rows =
      (rows + kTransposedRowAlignment - 1) / kTransposedRowAlignment * kTransposedRowAlignment;
  const bool rowwise = out.defined(), transpose = out_t.defined();
  const bool vector = cols % kBlock == 0 && aligned_to(x, kBlock);
  const dim3 grid((padded_rows + kTileRows - 1) / kTileRows, (cols + kTileCols - 1) / kTileCols);
  cast_kernel<T, E4M3, FROM_AMAX, RECORD><<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const T*>(x.data_ptr()), scale_source.data_ptr<float>(),
      RECORD ? record.data_ptr<float>() : nullptr,
      rowwise ? reinterpret_cast<uint8_t*>(out.data_ptr()) : nullptr,
      transpose ? reinterpret_cast<uint8_t*>(out_t.data_ptr()) : nullptr,
      scale_inv.data_ptr<float>(), rows, cols, padded_rows, fp8_limit(E4M3), rowwise,
      transpose, vector);
}

template <typename T>
void launch_cast_of(const at::Tensor& x, const at::Tensor& scale_source, bool from_amax,
                    const at::Tensor& record, bool e4m3, const at::Tensor& out,
                    const at::Tensor& out_t, const at::Tensor& scale_inv, cudaStream_t stream) {
#define MEGATRON_TYPED(E4M3, FROM_AMAX, RECORD) \
  launch_cast_typed<T, E4M3, FROM_AMAX, RECORD>(x, scale_source, record, out, out_t, scale_inv, \
                                                stream)
  if (from_amax) {
    // Current scaling's cast records nothing itself (the caller maxes its amax in after).
    if (e4m3) MEGATRON_TYPED(true, true, false); else MEGATRON_TYPED(false, true, false);
  } else if (record.defined()) {
    if (e4m3) MEGATRON_TYPED(true, false, true); else MEGATRON_TYPED(false, false, true);
  } else {
    if (e4m3) MEGATRON_TYPED(true, false, false); else MEGATRON_TYPED(false, false, false);
  }
#undef MEGATRON_TYPED
}

template <typename T>
void launch_amax_of(const at::Tensor& x, const at::Tensor& amax, cudaStream_t stream) {
  const int64_t numel = x.numel();
  const bool vector = aligned_to(x, kBlock);
  const int64_t per_thread = vector ? kBlock : 1;
  const int64_t threads_needed = (numel + per_thread - 1) / per_thread;
  const int blocks = static_cast<int>(
      std::min<int64_t>((threads_needed + kAmaxThreads - 1) / kAmaxThreads, 4096));
  amax_kernel<T><<<blocks, kAmaxThreads, 0, stream>>>(reinterpret_cast<const T*>(x.data_ptr()),
                                                      amax.data_ptr<float>(), numel, vector);
}

}  // namespace

// bf16, fp16 and fp32 inputs (three instantiations, not torch's dispatch of every type); the
// caller has checked the dtype.
cudaError_t launch_cast(const at::Tensor& x, const at::Tensor& scale_source, bool scale_from_amax,
                        const at::Tensor& record, bool e4m3, const at::Tensor& out,
                        const at::Tensor& out_t, const at::Tensor& scale_inv,
                        cudaStream_t stream) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      launch_cast_of<c10::BFloat16>(x, scale_source, scale_from_amax, record, e4m3, out, out_t,
                                    scale_inv, stream);
      break;
    case at::kHalf:
      launch_cast_of<c10::Half>(x, scale_source, scale_from_amax, record, e4m3, out, out_t,
                                scale_inv, stream);
      break;
    default:
      launch_cast_of<float>(x, scale_source, scale_from_amax, record, e4m3, out, out_t,
                            scale_inv, stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_amax(const at::Tensor& x, const at::Tensor& amax, cudaStream_t stream) {
  switch (x.scalar_type()) {
    case at::kBFloat16:
      launch_amax_of<c10::BFloat16>(x, amax, stream);
      break;
    case at::kHalf:
      launch_amax_of<c10::Half>(x, amax, stream);
      break;
    default:
      launch_amax_of<float>(x, amax, stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_transpose(const at::Tensor& data, const at::Tensor& out, cudaStream_t stream) {
  const int64_t rows = data.size(0), cols = data.size(1);
  if (rows % 16 == 0 && cols % 16 == 0 && aligned_to(data, 16) && aligned_to(out, 16)) {
    const dim3 grid((cols + kWideTile - 1) / kWideTile, (rows + kWideTile - 1) / kWideTile);
    transpose_wide_kernel<<<grid, kWideThreads, 0, stream>>>(
        reinterpret_cast<const uint8_t*>(data.data_ptr()),
        reinterpret_cast<uint8_t*>(out.data_ptr()), rows, cols);
    return cudaGetLastError();
  }
  const bool vector = rows % 4 == 0 && cols % 4 == 0 && aligned_to(data, 4) && aligned_to(out, 4);
  const dim3 grid((cols + kTransposeTile - 1) / kTransposeTile,
                  (rows + kTransposeTile - 1) / kTransposeTile);
  transpose_kernel<<<grid, kTransposeThreads, 0, stream>>>(
      reinterpret_cast<const uint8_t*>(data.data_ptr()), reinterpret_cast<uint8_t*>(out.data_ptr()),
      rows, cols, vector);
  return cudaGetLastError();
}

}  // namespace megatron_fp8
