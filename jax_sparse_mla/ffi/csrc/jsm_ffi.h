// jax_sparse_mla FFI library: shared declarations of the handlers, the launcher and the HIP layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jsm {

// One FlyDSL-exported kernel linked into the library (kernel_table.cc is generated from the
// build's manifest). `abi` lists the packed `void **args` entries as "name:kind" separated by
// spaces, kind one of p (data pointer), L<n> (int32 layout of n dims), i32, f32, s (stream);
// `kernel_args` the byte sizes of the GPU kernel's own arguments (the launcher may keep some
// scalars on the host, e.g. for the grid).
struct Kernel {
  const char* symbol;
  const char* abi;
  const char* kernel_args;
  int32_t (*entry)(void** args);
  int32_t (*module_init)();
  int32_t (*module_load)(int32_t device);
};
extern const Kernel kKernels[];
extern const size_t kNumKernels;
extern const char kKernelBuildDir[];  // where the objects came from, for error messages

// The packed argument list of one launch, in FlyDSL's export ABI: per tensor &data then
// &layout{int32 shape[1]}, then each scalar by pointer, then &stream. Owns the storage.
class LaunchArgs {
 public:
  static constexpr size_t kMaxArgs = 48;
  LaunchArgs& Tensor(const char* name, const void* data, size_t elements);
  LaunchArgs& I32(const char* name, int64_t value);  // the caller has range-checked value
  LaunchArgs& F32(const char* name, float value);
  LaunchArgs& Stream(void* stream);
  void** packed() { return pointers_.data(); }
  const std::string& abi() const { return abi_; }
  uint64_t slot(size_t i) const { return slots_[i]; }

 private:
  void Add(const char* name, const char* kind, uint64_t bits);
  std::vector<uint64_t> slots_ = std::vector<uint64_t>(kMaxArgs);
  std::vector<void*> pointers_ = std::vector<void*>(kMaxArgs);
  size_t count_ = 0;
  std::string abi_;
};

// Runs kernel `symbol` with `args` on `stream` of `device`: checks the HIP runtime, finds the
// kernel, checks the ABI and initializes it once, loads its code object once per device and
// calls the packed entry.
xla::ffi::Error Launch(std::string_view symbol, LaunchArgs& args, int32_t device);

// The launch whose packed entry is running on this thread (set by Launch), else nullptrs.
struct Launching {
  const Kernel* kernel = nullptr;
  const LaunchArgs* args = nullptr;
};
extern thread_local Launching launching;

// nullptr when the HIP runtime can be used, else why not (hip_shim.cc / hip_record.cc).
const char* HipUnavailable();

}  // namespace jsm
