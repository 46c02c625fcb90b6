// FP8 GEMMs through cuBLASLt (`fp8_gemm.h`).
//
// `torch._scaled_mm` creates the matmul and layout descriptors and asks cuBLASLt's heuristic
// for an algorithm at every call: inside a training step each of those calls cost the host
// about twice a cached one (52 against 27 us on an H200's host). Here a problem's descriptors
// and algorithm are made once per thread (forward and backward run on different threads) and
// reused; only the operand pointers change between calls. The operands, epilogue, accumulation
// and alignment settings are `torch._scaled_mm`'s, so cuBLASLt is asked the same question: the
// tests find the same bytes. Summing into an fp32 output is the GEMM's epilogue
// (`alpha * AB + C`), where the Python path adds a separate product; the tests find those the
// same bytes too, but cuBLASLt does not promise it for every algorithm.

#include "fp8_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "error_text.h"

namespace megatron_fp8 {
namespace {

void check_status(cublasStatus_t status, const char* call) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "fp8 GEMM: cuBLASLt's ", call, " failed (status ",
              text(static_cast<int64_t>(status)), ")");
}

cudaDataType_t cuda_type(at::ScalarType dtype) {
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
      TORCH_CHECK(false, "fp8 GEMM: no cuBLASLt type for ", text(dtype));
  }
}

// The largest power of two up to 256 that divides the address: the algorithms cuBLASLt may
// choose depend on it.
int alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// What an algorithm choice depends on.
struct Problem {
  int device;
  int64_t m, n, k;
  at::ScalarType a_type, b_type, out_type, bias_type;  // bias_type Undefined: no bias
  bool fast_accum, accumulate;
  int a_alignment, b_alignment, out_alignment;

  auto fields() const {
    return std::tie(device, m, n, k, a_type, b_type, out_type, bias_type, fast_accum, accumulate,
                    a_alignment, b_alignment, out_alignment);
  }
  bool operator==(const Problem& other) const { return fields() == other.fields(); }
};

struct ProblemHash {
  size_t operator()(const Problem& p) const {
    size_t hash = 0;
    const auto mix = [&hash](size_t value) {
      hash ^= value + 0x9e3779b97f4a7c15ULL + (hash << 6) + (hash >> 2);
    };
    for (const int64_t value : {int64_t(p.device), p.m, p.n, p.k, int64_t(p.a_type),
                                int64_t(p.b_type), int64_t(p.out_type), int64_t(p.bias_type),
                                int64_t(p.fast_accum), int64_t(p.accumulate),
                                int64_t(p.a_alignment), int64_t(p.b_alignment),
                                int64_t(p.out_alignment)}) {
      mix(std::hash<int64_t>()(value));
    }
    return hash;
  }
};

// The plans a thread keeps at most.
constexpr size_t kMaxPlans = 1024;

// A problem's cuBLASLt descriptors and algorithm. In cuBLAS's column-major terms the product
// is `out^T [n, m] = b^T [n, k] @ a^T [k, m]`: its A is `b` (read transposed), its B is `a`.
class Plan {
 public:
  Plan(const Problem& problem, cublasLtHandle_t handle, size_t workspace_size) {
    try {
      make(problem, handle, workspace_size);
    } catch (...) {
      release();  // the destructor of an object whose constructor threw does not run
      throw;
    }
  }

  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  ~Plan() { release(); }

  void run(cublasLtHandle_t handle, const at::Tensor& a, const at::Tensor& b,
           const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv, const at::Tensor& bias,
           const at::Tensor& out, bool accumulate, void* workspace, size_t workspace_size,
           cudaStream_t stream) {
    // The descriptor holds the pointers: set per call (a copy into the descriptor, no more).
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale_inv.const_data_ptr());
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale_inv.const_data_ptr());
    if (bias.defined()) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias.const_data_ptr());
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    check_status(cublasLtMatmul(handle, operation_, &alpha, b.const_data_ptr(), a_layout_,
                                a.const_data_ptr(), b_layout_, &beta, out.data_ptr(),
                                out_layout_, out.data_ptr(), out_layout_, &algorithm_,
                                workspace, workspace_size, stream),
                 "cublasLtMatmul");
  }

 private:
  void make(const Problem& problem, cublasLtHandle_t handle, size_t workspace_size) {
    check_status(cublasLtMatmulDescCreate(&operation_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    set(CUBLASLT_MATMUL_DESC_TRANSA, transpose);
    set(CUBLASLT_MATMUL_DESC_TRANSB, keep);
    set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(problem.fast_accum));
    if (problem.bias_type != at::ScalarType::Undefined) {
      set(CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(problem.bias_type));
    }
    check_status(cublasLtMatrixLayoutCreate(&a_layout_, cuda_type(problem.b_type), problem.k,
                                            problem.n, problem.k),
                 "cublasLtMatrixLayoutCreate");
    check_status(cublasLtMatrixLayoutCreate(&b_layout_, cuda_type(problem.a_type), problem.k,
                                            problem.m, problem.k),
                 "cublasLtMatrixLayoutCreate");
    check_status(cublasLtMatrixLayoutCreate(&out_layout_, cuda_type(problem.out_type), problem.n,
                                            problem.m, problem.n),
                 "cublasLtMatrixLayoutCreate");
    cublasLtMatmulPreference_t raw_preference = nullptr;
    check_status(cublasLtMatmulPreferenceCreate(&raw_preference),
                 "cublasLtMatmulPreferenceCreate");
    const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                          decltype(&cublasLtMatmulPreferenceDestroy)>
        preference(raw_preference, &cublasLtMatmulPreferenceDestroy);
    const uint64_t workspace = workspace_size;
    // The algorithm must work at the operands' actual alignments (cuBLASLt assumes 256 bytes).
    const uint32_t a_alignment = problem.b_alignment, b_alignment = problem.a_alignment,
                   out_alignment = problem.out_alignment;
    const auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
      check_status(cublasLtMatmulPreferenceSetAttribute(preference.get(), attribute, &value,
                                                        sizeof(value)),
                   "cublasLtMatmulPreferenceSetAttribute");
    };
    prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, out_alignment);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out_alignment);
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        handle, operation_, a_layout_, b_layout_, out_layout_, out_layout_, preference.get(), 1,
        &heuristic, &found);
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0,
                "fp8 GEMM: cuBLASLt has no algorithm for [", text(problem.m), ", ",
                text(problem.k), "] x [", text(problem.k), ", ", text(problem.n), "] of ",
                text(problem.a_type), " and ", text(problem.b_type), " into ",
                text(problem.out_type), " (status ", text(static_cast<int64_t>(status)), ")");
    algorithm_ = heuristic.algo;
  }

  void release() {
    if (out_layout_ != nullptr) cublasLtMatrixLayoutDestroy(out_layout_);
    if (b_layout_ != nullptr) cublasLtMatrixLayoutDestroy(b_layout_);
    if (a_layout_ != nullptr) cublasLtMatrixLayoutDestroy(a_layout_);
    if (operation_ != nullptr) cublasLtMatmulDescDestroy(operation_);
    out_layout_ = b_layout_ = a_layout_ = nullptr;
    operation_ = nullptr;
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

bool is_fp8(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat8_e4m3fn || x.scalar_type() == at::kFloat8_e5m2;
}

void check_operands(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                    const at::Tensor& b_scale_inv) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && is_fp8(a) && is_fp8(b),
              "fp8 GEMM: two 2-D FP8 operands, got ", text(a.scalar_type()), " ",
              text(a.sizes()), " and ", text(b.scalar_type()), " ", text(b.sizes()));
  TORCH_CHECK(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
              "fp8 GEMM: at most one E5M2 operand");
  TORCH_CHECK(a.size(1) == b.size(0), "fp8 GEMM: ", text(a.sizes()), " x ", text(b.sizes()),
              " do not multiply");
  // (An empty operand has no layout to check: its product is empty, or zero when k is.)
  TORCH_CHECK(a.numel() == 0 || b.numel() == 0 ||
                  (a.stride(1) == 1 && a.stride(0) == a.size(1) && b.stride(0) == 1 &&
                   b.stride(1) == b.size(0)),
              "fp8 GEMM: the first operand must be row-major and the second column-major");
  TORCH_CHECK(a.size(1) % 16 == 0 && b.size(1) % 16 == 0,
              "fp8 GEMM: the inner and output dimensions must be multiples of 16, got ",
              text(a.size(1)), " and ", text(b.size(1)));
  for (const at::Tensor* scale : {&a_scale_inv, &b_scale_inv}) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1 &&
                    scale->device() == a.device(),
                "fp8 GEMM: each scale is one fp32 element on the operands' device");
  }
  TORCH_CHECK(a.device() == b.device() && a.is_cuda(), "fp8 GEMM: operands on one GPU");
}

void run(const at::Tensor& out, bool accumulate, const at::Tensor& a, const at::Tensor& b,
         const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv, const at::Tensor& bias,
         bool fast_accum) {
  const Problem problem{a.get_device(),
                        a.size(0),
                        b.size(1),
                        a.size(1),
                        a.scalar_type(),
                        b.scalar_type(),
                        out.scalar_type(),
                        bias.defined() ? bias.scalar_type() : at::ScalarType::Undefined,
                        fast_accum,
                        accumulate,
                        alignment_of(a.const_data_ptr()),
                        alignment_of(b.const_data_ptr()),
                        alignment_of(out.const_data_ptr())};
  if (problem.m == 0 || problem.n == 0) return;
  if (problem.k == 0) {  // an empty sum: zero, or the bias; nothing to add
    if (accumulate) return;
    if (bias.defined()) {
      out.copy_(bias.expand_as(out));
    } else {
      out.zero_();
    }
    return;
  }
  thread_local std::unordered_map<Problem, std::unique_ptr<Plan>, ProblemHash> plans;
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  auto found = plans.find(problem);
  if (found == plans.end()) {
    // A model's layers make a few dozen problems; token counts that change every step (packed
    // or variable-length batches) would make new ones without end: start over past a bound.
    if (plans.size() >= kMaxPlans) plans.clear();
    found = plans.emplace(problem, std::make_unique<Plan>(problem, handle, workspace_size)).first;
  }
  found->second->run(handle, a, b, a_scale_inv, b_scale_inv, bias, out, accumulate,
                     at::cuda::getCUDABlasLtWorkspace(), workspace_size,
                     at::cuda::getCurrentCUDAStream());
}

}  // namespace

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                     const at::Tensor& b_scale_inv, const at::Tensor& bias,
                     at::ScalarType out_dtype, bool fast_accum) {
  check_operands(a, b, a_scale_inv, b_scale_inv);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "fp8 GEMM: a bf16, fp16 or fp32 output, got ", text(out_dtype));
  TORCH_CHECK(!bias.defined() || (out_dtype != at::kFloat && bias.scalar_type() == out_dtype &&
                                  bias.numel() == b.size(1) && bias.is_contiguous() &&
                                  bias.device() == a.device()),
              "fp8 GEMM: a bias is [n] contiguous on the operands' device, of the output's "
              "dtype, bf16 or fp16");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  run(out, /*accumulate=*/false, a, b, a_scale_inv, b_scale_inv, bias, fast_accum);
  return out;
}

void scaled_mm_into(const at::Tensor& out, bool accumulate, const at::Tensor& a,
                    const at::Tensor& b, const at::Tensor& a_scale_inv,
                    const at::Tensor& b_scale_inv) {
  check_operands(a, b, a_scale_inv, b_scale_inv);
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(out.dim() == 2 && out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
                  out.is_contiguous() && out.device() == a.device(),
              "fp8 GEMM: the output must be [", text(a.size(0)), ", ", text(b.size(1)),
              "] contiguous on the operands' device, got ", text(out.sizes()));
  TORCH_CHECK(accumulate ? dtype == at::kFloat
                         : (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat),
              "fp8 GEMM: writes bf16, fp16 or fp32 and adds into fp32, got ", text(dtype));
  const c10::cuda::CUDAGuard guard(a.device());
  run(out, accumulate, a, b, a_scale_inv, b_scale_inv, at::Tensor(), /*fast_accum=*/false);
}

}  // namespace megatron_fp8
