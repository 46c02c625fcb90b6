// `SegmentCopy`'s launch from C++ (`megatron/core/fusions/native_segment_copy.py` builds and
// loads it; `segment_copy.py` calls it).
//
// Megatron-FSDP launches the copy twice per unit and step (the gather's cast, forward and
// backward). From Python, Triton's launcher derives each argument's specialisation and packs
// the arguments on every launch; here one call checks the tensors and launches the kernel of
// `segment_copy_kernels.cu`.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>

#include "segment_copy_kernels.h"

namespace megatron_segment_copy {
namespace {

bool copyable(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.is_cuda() && t.dim() == 1 && t.is_contiguous() &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

}  // namespace

void copy(const at::Tensor& source, const at::Tensor& target, const at::Tensor& table,
          const at::Tensor& programs, int64_t elements_per_program, int64_t align) {
  TORCH_CHECK(copyable(source) && copyable(target) && target.device() == source.device(),
              "segment_copy: flat contiguous fp32, bf16 or fp16 tensors on one CUDA device");
  TORCH_CHECK(table.device() == source.device() && table.scalar_type() == at::kLong &&
                  programs.device() == source.device() && programs.scalar_type() == at::kInt,
              "segment_copy: int64 segments and int32 programs on the tensors' device");
  TORCH_CHECK(align == 1 || align == 4 || align == 8, "segment_copy: align 1, 4 or 8, got ",
              std::to_string(align));  // text: a number streamed here crashed some builds
  // Whole 16-byte vectors only where both tensors start on 16 bytes (views may not).
  const bool starts_aligned = reinterpret_cast<uintptr_t>(source.const_data_ptr()) % 16 == 0 &&
                              reinterpret_cast<uintptr_t>(target.const_data_ptr()) % 16 == 0;
  const c10::cuda::CUDAGuard guard(source.device());
  C10_CUDA_CHECK(launch_segment_copy(source, target, table, programs, elements_per_program,
                                     starts_aligned ? align : 1,
                                     c10::cuda::getCurrentCUDAStream()));
}

}  // namespace megatron_segment_copy

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy", &megatron_segment_copy::copy,
        "Copies (and casts) the table's segments of `source` into `target`, one launch",
        py::arg("source"), py::arg("target"), py::arg("table"), py::arg("programs"),
        py::arg("elements_per_program"), py::arg("align"));
}
