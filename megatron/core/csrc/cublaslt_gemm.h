// cuBLASLt GEMMs whose set-up is made once per problem and thread, for the extensions' hot paths:
// the FP8 linear layers' GEMMs, and the bf16 and fp16 GEMMs of gradient-accumulation fusion's
// linear layers.
//
// PyTorch's GEMMs pay at every call for cuBLAS's dispatch or, through cuBLASLt (`addmm` with a
// bias, `torch._scaled_mm`), for creating the matmul and layout descriptors and asking the
// heuristic for an algorithm (`torch._scaled_mm` inside a training step: 52 us of host time per
// call on an H200's host, 27 with the set-up cached). A `Plan` holds one problem's descriptors and
// algorithm; only the pointers change between calls. Everything cuBLASLt's choice depends on is
// part of the problem (shapes, types, layouts, epilogue, the operands' alignments), so a call
// runs the algorithm the heuristic gives for that question, as PyTorch's cuBLASLt calls do.

#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>

namespace megatron::cublaslt {

// What the GEMM does besides the product.
enum class Epilogue : int8_t {
  kNone,
  // Adds `bias` [n] to every row of the output (a linear layer's forward).
  kBias,
};

// A 2-D operand as cuBLASLt reads it: its rows dense (row-major) or its columns, and the
// distance between consecutive rows (columns).
struct Layout {
  bool column_major = false;
  int64_t leading = 0;
};

// The layout of a 2-D `tensor`, or nullopt where neither dimension is dense. The stride of a
// dimension of size 1 is never used, whatever it is.
inline std::optional<Layout> layout_of(const at::Tensor& tensor) {
  const int64_t rows = tensor.size(0), cols = tensor.size(1);
  const int64_t row_stride = tensor.stride(0), col_stride = tensor.stride(1);
  if ((cols == 1 || col_stride == 1) && (rows == 1 || row_stride >= cols)) {
    return Layout{false, rows == 1 ? std::max<int64_t>(cols, 1) : row_stride};
  }
  if ((rows == 1 || row_stride == 1) && (cols == 1 || col_stride >= rows)) {
    return Layout{true, cols == 1 ? std::max<int64_t>(rows, 1) : col_stride};
  }
  return std::nullopt;
}

namespace detail {

// The GEMM's failures name cuBLASLt's call and status. Numbers become text before they reach
// `TORCH_CHECK`: on machines where the extension's C++ runtime and the process's differ, its
// stream formatting of numbers crashed instead of raising.
inline void check_status(cublasStatus_t status, const char* call) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt GEMM: ", call, " failed (status ",
              std::to_string(static_cast<int>(status)), ")");
}

inline std::optional<cudaDataType_t> cuda_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2:
      return CUDA_R_8F_E5M2;
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    case at::kFloat:
      return CUDA_R_32F;
    default:
      return std::nullopt;
  }
}

inline bool is_fp8(at::ScalarType dtype) {
  return dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}

// The largest power of two up to 256 that divides the address: the algorithms cuBLASLt may
// choose depend on it.
inline int alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// What an algorithm choice depends on, in the caller's row-major terms:
// `out [m, n] (+)= a [m, k] @ b [k, n]`, or `out = addend + a @ b`.
struct Problem {
  int device;
  int64_t m, n, k;
  at::ScalarType a_type, b_type, out_type, bias_type;  // bias_type Undefined: no epilogue
  Epilogue epilogue;
  bool a_column_major, b_column_major;
  int64_t a_leading, b_leading, out_leading;
  bool scaled, fast_accum, accumulate;
  int a_alignment, b_alignment, out_alignment, bias_alignment;
  int addend_alignment;  // 0: no addend (C is the output itself)
  int64_t workspace_size;

  auto fields() const {
    return std::tie(device, m, n, k, a_type, b_type, out_type, bias_type, epilogue,
                    a_column_major, b_column_major, a_leading, b_leading, out_leading, scaled,
                    fast_accum, accumulate, a_alignment, b_alignment, out_alignment,
                    bias_alignment, addend_alignment, workspace_size);
  }
  bool operator==(const Problem& other) const { return fields() == other.fields(); }
};

struct ProblemHash {
  size_t operator()(const Problem& p) const {
    size_t hash = 0;
    const auto mix = [&hash](int64_t value) {
      hash ^= std::hash<int64_t>()(value) + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
    };
    std::apply([&mix](const auto&... field) { (mix(static_cast<int64_t>(field)), ...); },
               p.fields());
    return hash;
  }
};

// The plans a thread keeps at most: a model's layers make a few dozen problems; token counts
// that change every step (packed or variable-length batches) would make new ones without end.
constexpr size_t kMaxPlans = 1024;

// One problem's cuBLASLt descriptors and algorithm. cuBLAS is column-major: the row-major
// `out [m, n] = a @ b` is its `out^T [n, m] = b^T @ a^T`, so its A is `b` and its B is `a`; a
// row-major operand is, to cuBLAS, its own transpose, read as it lies.
class Plan {
 public:
  // A plan, or nullptr where cuBLASLt has no algorithm for the problem. The pointers are those
  // of the call that makes it: the heuristic reads the bias's alignment from its pointer, and
  // whether the operands are scaled from theirs (set per call after).
  static std::unique_ptr<Plan> make(const Problem& problem, cublasLtHandle_t handle,
                                    const void* bias, const void* a_scale_inv,
                                    const void* b_scale_inv) {
    std::unique_ptr<Plan> plan(new Plan());
    if (!plan->describe(problem, handle, bias, a_scale_inv, b_scale_inv)) return nullptr;
    return plan;
  }

  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  ~Plan() {
    if (out_layout_ != nullptr) cublasLtMatrixLayoutDestroy(out_layout_);
    if (b_layout_ != nullptr) cublasLtMatrixLayoutDestroy(b_layout_);
    if (a_layout_ != nullptr) cublasLtMatrixLayoutDestroy(a_layout_);
    if (operation_ != nullptr) cublasLtMatmulDescDestroy(operation_);
  }

  // `addend`: cuBLAS's C where it is not the output (laid out as the output); nullptr: C is
  // the output, read where `accumulate`.
  void run(cublasLtHandle_t handle, const void* a, const void* b, void* out, const void* addend,
           const void* bias, const void* a_scale_inv, const void* b_scale_inv, bool accumulate,
           void* workspace, size_t workspace_size, cudaStream_t stream) {
    // The descriptor holds these pointers: set per call (a copy into the descriptor, no more).
    set_pointers(bias, a_scale_inv, b_scale_inv);
    const float alpha = 1.f, beta = accumulate || addend != nullptr ? 1.f : 0.f;
    const void* c = addend != nullptr ? addend : out;
    check_status(cublasLtMatmul(handle, operation_, &alpha, b, a_layout_, a, b_layout_, &beta, c,
                                out_layout_, out, out_layout_, &algorithm_, workspace,
                                workspace_size, stream),
                 "cublasLtMatmul");
  }

 private:
  Plan() = default;

  // cuBLAS's A is `b`: its scale is `b`'s.
  void set_pointers(const void* bias, const void* a_scale_inv, const void* b_scale_inv) {
    if (a_scale_inv != nullptr) {
      set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale_inv);
      set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale_inv);
    }
    if (bias != nullptr) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  }

  bool describe(const Problem& p, cublasLtHandle_t handle, const void* bias,
                const void* a_scale_inv, const void* b_scale_inv) {
    check_status(cublasLtMatmulDescCreate(&operation_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    // cuBLAS's A is `b`: read as it lies where `b` is row-major, transposed where column-major.
    const cublasOperation_t a_operation = p.b_column_major ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t b_operation = p.a_column_major ? CUBLAS_OP_T : CUBLAS_OP_N;
    set(CUBLASLT_MATMUL_DESC_TRANSA, a_operation);
    set(CUBLASLT_MATMUL_DESC_TRANSB, b_operation);
    if (p.scaled) set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(p.fast_accum));
    if (p.epilogue == Epilogue::kBias) {
      set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, *cuda_type(p.bias_type));
    }
    set_pointers(bias, a_scale_inv, b_scale_inv);
    const auto layout = [](cublasLtMatrixLayout_t* out, at::ScalarType dtype, int64_t rows,
                           int64_t cols, int64_t leading) {
      check_status(cublasLtMatrixLayoutCreate(out, *cuda_type(dtype), rows, cols, leading),
                   "cublasLtMatrixLayoutCreate");
    };
    // Each stored as it lies, column-major to cuBLAS: a row-major [r, c] is a [c, r].
    layout(&a_layout_, p.b_type, p.b_column_major ? p.k : p.n, p.b_column_major ? p.n : p.k,
           p.b_leading);
    layout(&b_layout_, p.a_type, p.a_column_major ? p.m : p.k, p.a_column_major ? p.k : p.m,
           p.a_leading);
    layout(&out_layout_, p.out_type, p.n, p.m, p.out_leading);

    cublasLtMatmulPreference_t raw_preference = nullptr;
    check_status(cublasLtMatmulPreferenceCreate(&raw_preference),
                 "cublasLtMatmulPreferenceCreate");
    const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                          decltype(&cublasLtMatmulPreferenceDestroy)>
        preference(raw_preference, &cublasLtMatmulPreferenceDestroy);
    const auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
      check_status(cublasLtMatmulPreferenceSetAttribute(preference.get(), attribute, &value,
                                                        sizeof(value)),
                   "cublasLtMatmulPreferenceSetAttribute");
    };
    const uint64_t workspace = p.workspace_size;
    // The algorithm must work at the operands' actual alignments (cuBLASLt assumes 256 bytes).
    const uint32_t a_alignment = p.b_alignment, b_alignment = p.a_alignment,
                   out_alignment = p.out_alignment,
                   c_alignment = p.addend_alignment != 0 ? p.addend_alignment : p.out_alignment;
    prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out_alignment);
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, operation_, a_layout_, b_layout_, out_layout_, out_layout_, preference.get(), 1,
        &heuristic, &found);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0) return false;
    algorithm_ = heuristic.algo;
    return true;
  }

  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    check_status(cublasLtMatmulDescSetAttribute(operation_, attribute, &value, sizeof(value)),
                 "cublasLtMatmulDescSetAttribute");
  }

  cublasLtMatmulDesc_t operation_ = nullptr;
  cublasLtMatrixLayout_t a_layout_ = nullptr, b_layout_ = nullptr, out_layout_ = nullptr;
  cublasLtMatmulAlgo_t algorithm_ = {};
};

// Whether `bias` suits `epilogue` for an [m, n] `out`: for kBias one dense vector of n elements
// of the output's dtype.
inline bool bias_suits(Epilogue epilogue, const at::Tensor& bias, const at::Tensor& out,
                       int64_t n) {
  if (epilogue == Epilogue::kNone) return true;
  return bias.defined() && bias.dim() == 1 && bias.is_contiguous() &&
         bias.device() == out.device() && bias.size(0) == n &&
         bias.scalar_type() == out.scalar_type();
}

}  // namespace detail

// `out = a @ b`, or `out += a @ b` where `accumulate`, by cuBLASLt with the problem's set-up
// cached: `a` [m, k], `b` [k, n] and `out` [m, n] 2-D tensors on one GPU, `a` and `b` each with
// dense rows or columns, `out` with dense rows; `epilogue` on `bias` (above). FP8 operands take
// their scales' inverses (one fp32 element each; `fast_accum`: Hopper's faster, less exact
// accumulation); others are bf16 or fp16, both of one dtype, into that dtype or fp32. With an
// `addend` (not with `accumulate`), `out = addend + a @ b (+ bias)`, rounded once: an [m, n]
// tensor of the output's dtype and row stride (a linear layer's residual connection).
//
// Returns false, having launched nothing, where the problem is not one of those or cuBLASLt has
// no algorithm for it: the caller computes it another way.
inline bool gemm(const at::Tensor& out, bool accumulate, const at::Tensor& a, const at::Tensor& b,
                 Epilogue epilogue = Epilogue::kNone, const at::Tensor& bias = at::Tensor(),
                 const at::Tensor& a_scale_inv = at::Tensor(),
                 const at::Tensor& b_scale_inv = at::Tensor(), bool fast_accum = false,
                 const at::Tensor& addend = at::Tensor()) {
  using namespace detail;
  if (a.dim() != 2 || b.dim() != 2 || out.dim() != 2 || !a.is_cuda()) return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0 || k == 0 || b.size(0) != k || out.size(0) != m || out.size(1) != n) {
    return false;
  }
  if (b.device() != a.device() || out.device() != a.device()) return false;
  const at::ScalarType a_type = a.scalar_type(), b_type = b.scalar_type(),
                       out_type = out.scalar_type();
  const bool scaled = is_fp8(a_type);
  if (scaled) {
    if (!is_fp8(b_type) || (a_type == at::kFloat8_e5m2 && b_type == at::kFloat8_e5m2) ||
        !a_scale_inv.defined() || !b_scale_inv.defined()) {
      return false;
    }
    for (const at::Tensor* scale : {&a_scale_inv, &b_scale_inv}) {
      if (scale->scalar_type() != at::kFloat || scale->numel() != 1 ||
          scale->device() != a.device()) {
        return false;
      }
    }
  } else if ((a_type != at::kBFloat16 && a_type != at::kHalf) || b_type != a_type ||
             a_scale_inv.defined() || b_scale_inv.defined()) {
    return false;
  }
  // Out: fp32, or the operands' dtype (FP8 products: bf16 or fp16).
  const bool out_supported =
      out_type == at::kFloat ||
      (scaled ? out_type == at::kBFloat16 || out_type == at::kHalf : out_type == a_type);
  if (!out_supported) return false;
  if (!bias_suits(epilogue, bias, out, n)) return false;
  const std::optional<Layout> a_layout = layout_of(a), b_layout = layout_of(b),
                              out_layout = layout_of(out);
  if (!a_layout || !b_layout || !out_layout || out_layout->column_major) return false;
  if (addend.defined()) {
    // cuBLASLt reads C with the output's layout descriptor.
    const std::optional<Layout> addend_layout = addend.dim() == 2 ? layout_of(addend)
                                                                  : std::nullopt;
    if (accumulate || addend.sizes() != out.sizes() || addend.scalar_type() != out_type ||
        addend.device() != a.device() || !addend_layout || addend_layout->column_major ||
        addend_layout->leading != out_layout->leading) {
      return false;
    }
  }

  const void* bias_pointer = epilogue == Epilogue::kNone ? nullptr : bias.const_data_ptr();
  const void* a_scale_pointer = scaled ? a_scale_inv.const_data_ptr() : nullptr;
  const void* b_scale_pointer = scaled ? b_scale_inv.const_data_ptr() : nullptr;
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  const Problem problem{a.get_device(),
                        m,
                        n,
                        k,
                        a_type,
                        b_type,
                        out_type,
                        epilogue == Epilogue::kNone ? at::ScalarType::Undefined
                                                    : bias.scalar_type(),
                        epilogue,
                        a_layout->column_major,
                        b_layout->column_major,
                        a_layout->leading,
                        b_layout->leading,
                        out_layout->leading,
                        scaled,
                        scaled && fast_accum,
                        accumulate,
                        alignment_of(a.const_data_ptr()),
                        alignment_of(b.const_data_ptr()),
                        alignment_of(out.const_data_ptr()),
                        bias_pointer == nullptr ? 0 : alignment_of(bias_pointer),
                        addend.defined() ? alignment_of(addend.const_data_ptr()) : 0,
                        static_cast<int64_t>(workspace_size)};
  const c10::cuda::CUDAGuard guard(a.device());
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  // Forward and backward run on different threads: each keeps its own plans.
  thread_local std::unordered_map<Problem, std::unique_ptr<Plan>, ProblemHash> plans;
  auto found = plans.find(problem);
  if (found == plans.end()) {
    if (plans.size() >= kMaxPlans) plans.clear();
    found = plans
                .emplace(problem, Plan::make(problem, handle, bias_pointer, a_scale_pointer,
                                             b_scale_pointer))
                .first;
  }
  Plan* plan = found->second.get();
  if (plan == nullptr) return false;  // no algorithm: asked once, remembered
  plan->run(handle, a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(),
            addend.defined() ? addend.const_data_ptr() : nullptr, bias_pointer, a_scale_pointer,
            b_scale_pointer, accumulate,
            at::cuda::getCUDABlasLtWorkspace(), workspace_size,
            at::cuda::getCurrentCUDAStream());
  return true;
}

}  // namespace megatron::cublaslt
