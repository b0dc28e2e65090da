// The launcher: packed FlyDSL arguments, one code-object load per (kernel, device), the call.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <utility>

#include "jsm_ffi.h"

// The HIP entry points, resolved by hip_shim.cc (libamdhip64.so at first use) or hip_record.cc.
extern "C" {
int hipGetDevice(int* device);
int hipSetDevice(int device);
const char* hipGetErrorName(int error);
}

namespace jsm {
namespace ffi = xla::ffi;

thread_local Launching launching;

void LaunchArgs::Add(const char* name, const char* kind, uint64_t bits) {
  if (count_ == kMaxArgs) std::abort();  // the handlers pack at most 20 entries
  slots_[count_] = bits;
  pointers_[count_] = &slots_[count_];
  if (!abi_.empty()) abi_ += ' ';
  abi_ += std::string(name) + ":" + kind;
  ++count_;
}

LaunchArgs& LaunchArgs::Tensor(const char* name, const void* data, size_t elements) {
  Add(name, "p", reinterpret_cast<uintptr_t>(data));
  // The layout holds the flat shape as int32. The kernels address from the data pointer in
  // 64 bits and never read it, so buffers over 2^31 elements pass a clamped shape.
  const auto shape = static_cast<int32_t>(
      std::min<size_t>(elements, std::numeric_limits<int32_t>::max()));
  uint64_t bits = 0;
  std::memcpy(&bits, &shape, sizeof(shape));
  Add(name, "L1", bits);
  return *this;
}

LaunchArgs& LaunchArgs::I32(const char* name, int64_t value) {
  const auto v = static_cast<int32_t>(value);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(v));
  Add(name, "i32", bits);
  return *this;
}

LaunchArgs& LaunchArgs::F32(const char* name, float value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(value));
  Add(name, "f32", bits);
  return *this;
}

LaunchArgs& LaunchArgs::Stream(void* stream) {
  Add("stream", "s", reinterpret_cast<uintptr_t>(stream));
  return *this;
}

namespace {

std::string StatusName(int32_t status) {
  if (status == -1) return "FlyDSL module not initialized";
  if (status == -2) return "FlyDSL module not loaded on this device";
  const char* name = status > 0 ? hipGetErrorName(status) : nullptr;
  return std::string(name ? name : "error") + " (" + std::to_string(status) + ")";
}

const Kernel* FindKernel(std::string_view symbol) {
  for (size_t i = 0; i < kNumKernels; ++i) {
    if (symbol == kKernels[i].symbol) return &kKernels[i];
  }
  return nullptr;
}

// Once per kernel: checks that `args` (when given) packs the kernel's export ABI and
// initializes its module; once per (kernel, device): loads its code object.
ffi::Error EnsureLoaded(const Kernel& kernel, int32_t device, const LaunchArgs* args) {
  static std::mutex mutex;
  static std::set<const Kernel*> initialized;
  static std::set<std::pair<const Kernel*, int32_t>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (!initialized.count(&kernel)) {
    if (args != nullptr && args->abi() != kernel.abi) {
      return ffi::Error::Internal(std::string("jax_sparse_mla: ") + kernel.symbol +
                                  " was exported with the launch ABI [" + kernel.abi +
                                  "] but the handler packs [" + args->abi() +
                                  "]: rebuild the kernels and the FFI library together");
    }
    if (int32_t status = kernel.module_init()) {
      return ffi::Error::Internal(std::string("jax_sparse_mla: initializing ") + kernel.symbol +
                                  " failed: " + StatusName(status));
    }
    initialized.insert(&kernel);
  }
  if (!loaded.count({&kernel, device})) {
    if (int32_t status = kernel.module_load(device)) {
      return ffi::Error::Internal(std::string("jax_sparse_mla: loading the code object of ") +
                                  kernel.symbol + " on device " + std::to_string(device) +
                                  " failed: " + StatusName(status));
    }
    loaded.insert({&kernel, device});
  }
  return ffi::Error::Success();
}

// Clears `launching` when a launch (or its preparation) ends, however it ends.
struct LaunchingGuard {
  ~LaunchingGuard() { launching = {}; }
};

// Finds the kernel and loads it; from here until the launch returns, `launching` names it.
ffi::Error Prepare(std::string_view symbol, int32_t device, const LaunchArgs* args,
                   const Kernel** out) {
  if (const char* why = HipUnavailable()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_sparse_mla: cannot launch the gfx950 kernel " + std::string(symbol) +
                          ": the ROCm runtime is unavailable (" + why + ")");
  }
  const Kernel* kernel = FindKernel(symbol);
  if (kernel == nullptr) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "jax_sparse_mla: kernel " + std::string(symbol) +
                          " is not in this FFI library (" + std::to_string(kNumKernels) +
                          " kernels linked from '" + kKernelBuildDir +
                          "'); build the kernels and relink: python -m jax_sparse_mla.build "
                          "--arch gfx950 --link");
  }
  *out = kernel;
  launching = {kernel, args};
  return EnsureLoaded(*kernel, device, args);
}

}  // namespace

ffi::Error Launch(std::string_view symbol, LaunchArgs& args, int32_t device) {
  const LaunchingGuard guard;
  const Kernel* kernel = nullptr;
  if (ffi::Error error = Prepare(symbol, device, &args, &kernel); error.failure()) return error;
  int current = 0;
  if (int status = hipGetDevice(&current)) {
    return ffi::Error::Internal("jax_sparse_mla: hipGetDevice failed: " + StatusName(status));
  }
  if (current != device) hipSetDevice(device);
  const int32_t status = kernel->entry(args.packed());
  if (current != device) hipSetDevice(current);
  if (status != 0) {
    return ffi::Error::Internal("jax_sparse_mla: launching " + std::string(symbol) +
                                " failed: " + StatusName(status));
  }
  return ffi::Error::Success();
}

}  // namespace jsm

// The symbols of the kernels linked into this library, separated by spaces ("" for a library
// linked without a kernel build): implementation=None uses a kernel family only when it is here.
extern "C" __attribute__((visibility("default"))) const char* jsm_kernel_symbols() {
  static const std::string symbols = [] {
    std::string joined;
    for (size_t i = 0; i < jsm::kNumKernels; ++i) {
      if (!joined.empty()) joined += ' ';
      joined += jsm::kKernels[i].symbol;
    }
    return joined;
  }();
  return symbols.c_str();
}

// For the tests: the checks a launch makes before calling the kernel (HIP runtime, kernel
// lookup, code-object load on `device`). Returns 0, or 1 with the error message in `message`.
extern "C" __attribute__((visibility("default"))) int jsm_prepare_launch(const char* symbol,
                                                                         int device,
                                                                         char* message,
                                                                         size_t capacity) {
  const jsm::LaunchingGuard guard;
  const jsm::Kernel* kernel = nullptr;
  xla::ffi::Error error = jsm::Prepare(symbol, device, nullptr, &kernel);
  if (error.success()) return 0;
  std::snprintf(message, capacity, "%s", error.message().c_str());
  return 1;
}
