// FP8 GEMMs through cuBLASLt (`fp8_gemm.h`).
//
// `torch._scaled_mm` creates the matmul and layout descriptors and asks cuBLASLt's heuristic
// for an algorithm at every call; here a problem's set-up is made once per thread and reused
// (`cublaslt_gemm.h`). The operands, epilogue, accumulation and alignment settings are
// `torch._scaled_mm`'s, so cuBLASLt is asked the same question: the tests find the same bytes.
// Summing into an fp32 output is the GEMM's epilogue (`alpha * AB + C`), where the Python path
// adds a separate product; the tests find those the same bytes too, but cuBLASLt does not
// promise it for every algorithm.

#include "fp8_gemm.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "cublaslt_gemm.h"
#include "error_text.h"

namespace megatron_fp8 {
namespace {

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

// `addend` (not with `accumulate`): added to the product, in the GEMM where cuBLASLt takes it.
void run(const at::Tensor& out, bool accumulate, const at::Tensor& a, const at::Tensor& b,
         const at::Tensor& a_scale_inv, const at::Tensor& b_scale_inv, const at::Tensor& bias,
         bool fast_accum, const at::Tensor& addend = at::Tensor()) {
  if (out.numel() == 0) return;
  if (a.size(1) == 0) {  // an empty sum: zero, or the bias; nothing to add
    if (accumulate) return;
    if (bias.defined()) {
      out.copy_(bias.expand_as(out));
    } else {
      out.zero_();
    }
    if (addend.defined()) out.add_(addend);
    return;
  }
  namespace lt = megatron::cublaslt;
  const lt::Epilogue epilogue = bias.defined() ? lt::Epilogue::kBias : lt::Epilogue::kNone;
  if (addend.defined() && lt::gemm(out, /*accumulate=*/false, a, b, epilogue, bias, a_scale_inv,
                                   b_scale_inv, fast_accum, addend)) {
    return;
  }
  const bool done = lt::gemm(out, accumulate, a, b, epilogue, bias, a_scale_inv, b_scale_inv,
                             fast_accum);
  TORCH_CHECK(done, "fp8 GEMM: cuBLASLt has no algorithm for [", text(a.size(0)), ", ",
              text(a.size(1)), "] x [", text(b.size(0)), ", ", text(b.size(1)), "] of ",
              text(a.scalar_type()), " and ", text(b.scalar_type()), " into ",
              text(out.scalar_type()));
  if (addend.defined()) out.add_(addend);
}

}  // namespace

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale_inv,
                     const at::Tensor& b_scale_inv, const at::Tensor& bias,
                     at::ScalarType out_dtype, bool fast_accum, const at::Tensor& addend) {
  check_operands(a, b, a_scale_inv, b_scale_inv);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "fp8 GEMM: a bf16, fp16 or fp32 output, got ", text(out_dtype));
  TORCH_CHECK(!bias.defined() || (out_dtype != at::kFloat && bias.scalar_type() == out_dtype &&
                                  bias.numel() == b.size(1) && bias.is_contiguous() &&
                                  bias.device() == a.device()),
              "fp8 GEMM: a bias is [n] contiguous on the operands' device, of the output's "
              "dtype, bf16 or fp16");
  TORCH_CHECK(!addend.defined() ||
                  (addend.dim() == 2 && addend.size(0) == a.size(0) &&
                   addend.size(1) == b.size(1) && addend.scalar_type() == out_dtype &&
                   addend.device() == a.device()),
              "fp8 GEMM: an addend is [m, n] on the operands' device, of the output's dtype");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype));
  run(out, /*accumulate=*/false, a, b, a_scale_inv, b_scale_inv, bias, fast_accum, addend);
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
