// The 9 HIP entry points the FlyDSL objects call, resolved from libamdhip64.so at first use,
// so that the library loads on any Linux machine. Hidden: they never leak into the process.
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "jsm_ffi.h"

namespace {

constexpr int kHipErrorNotInitialized = 3;  // hipErrorNotInitialized

struct HipRuntime {
  void* library = nullptr;
  std::string error;  // why the runtime is unavailable, empty when it loaded
};

const HipRuntime& Runtime() {
  static HipRuntime runtime;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* path = std::getenv("JAX_SPARSE_MLA_HIP_LIBRARY");
    for (const char* name : {path, "libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"}) {
      if (name == nullptr) continue;
      if ((runtime.library = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) return;
      if (runtime.error.empty()) {  // report the first name tried
        const char* why = dlerror();
        runtime.error = std::string("dlopen(\"") + name + "\") failed: " + (why ? why : "?");
      }
    }
  });
  return runtime;
}

template <typename Fn>
Fn Resolve(const char* name) {
  const HipRuntime& runtime = Runtime();
  return runtime.library ? reinterpret_cast<Fn>(dlsym(runtime.library, name)) : nullptr;
}

}  // namespace

const char* jsm::HipUnavailable() {
  const HipRuntime& runtime = Runtime();
  return runtime.library ? nullptr : runtime.error.c_str();
}

// Each forwarder resolves its symbol once; without the runtime it returns
// hipErrorNotInitialized (the launcher checks HipUnavailable() first and says why).
#define JSM_HIP_FORWARD(ret, name, params, args, fallback)                      \
  extern "C" __attribute__((visibility("hidden"))) ret name params {          \
    static const auto fn = Resolve<ret(*) params>(#name);                     \
    return fn ? fn args : fallback;                                           \
  }

JSM_HIP_FORWARD(int, hipModuleLoadData, (void** module, const void* image), (module, image),
                kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipModuleGetFunction, (void** function, void* module, const char* name),
                (function, module, name), kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipModuleLaunchKernel,
                (void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                 unsigned bz, unsigned shared, void* stream, void** params, void** extra),
                (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra),
                kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipModuleUnload, (void* module), (module), kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipSetDevice, (int device), (device), kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipGetDevice, (int* device), (device), kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipDeviceSynchronize, (), (), kHipErrorNotInitialized)
JSM_HIP_FORWARD(int, hipGetLastError, (), (), kHipErrorNotInitialized)
JSM_HIP_FORWARD(const char*, hipGetErrorName, (int error), (error), "hipErrorNotInitialized")
