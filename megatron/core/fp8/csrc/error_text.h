// Text for the extension's error messages, made without iostreams.
//
// `TORCH_CHECK` formats its message with `std::ostringstream` inside this extension. On a GPU
// machine where the extension's compiler and the C++ runtime the process loaded differ, the
// stream's number formatting crashed the process instead of raising; strings and C strings
// pass through it safely. So every number, shape, device and dtype in a message is text first.

#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace megatron_fp8 {

inline std::string text(int64_t value) { return std::to_string(value); }

inline std::string text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

inline std::string text(const at::Device& device) { return device.str(); }

inline std::string text(at::ScalarType dtype) { return c10::toString(dtype); }

}  // namespace megatron_fp8
