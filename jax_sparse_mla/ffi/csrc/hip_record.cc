// A recording HIP for the CPU tests: the same handlers, launcher and FlyDSL objects as the ROCm
// library, but hipModuleLaunchKernel writes what it would launch (kernel, grid, block, stream,
// every kernel argument's bytes) to a log that jsm_record_take() returns as JSON.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "jsm_ffi.h"

namespace {

// No iostreams here: a static stream's locale set-up in this library crashed a later
// `import jax` (jaxlib 0.11.2, glibc 2.39).
std::mutex log_mutex;
std::string log_json;  // comma-separated JSON objects
int current_device = 0;
std::vector<int> module_devices;          // module handle - 1 -> device it was loaded on
std::map<uintptr_t, std::string> names;   // function handle -> kernel name

void Emit(const std::string& event) {
  if (!log_json.empty()) log_json += ",\n";
  log_json += event;
}

// The next space-separated word of `text` from `*pos` (empty at the end).
std::string NextWord(const char* text, size_t* pos) {
  const std::string s(text);
  const size_t start = s.find_first_not_of(' ', *pos);
  if (start == std::string::npos) return "";
  const size_t end = s.find(' ', start);
  *pos = end == std::string::npos ? s.size() : end;
  return s.substr(start, *pos - start);
}

// The handler's packed arguments: [name, kind, value] per ABI entry but the stream; pointers,
// layouts and int32 as integers, f32 as its bit pattern (exact).
std::string Packed(const jsm::Kernel& kernel, const jsm::LaunchArgs& args) {
  std::string out = "[";
  size_t pos = 0;
  for (size_t i = 0;; ++i) {
    const std::string entry = NextWord(kernel.abi, &pos);
    const std::string name = entry.substr(0, entry.find(':'));
    const std::string kind = entry.substr(entry.find(':') + 1);
    if (entry.empty() || kind == "s") break;
    uint64_t bits = args.slot(i);
    if (kind != "p") bits &= 0xFFFFFFFFu;
    out += (i ? ", [\"" : "[\"") + name + "\", \"" + kind + "\", " + std::to_string(bits) + "]";
  }
  return out + "]";
}

// What the GPU kernel receives: each kernelParams entry's bytes as an unsigned integer.
std::string KernelArgs(const jsm::Kernel& kernel, void** params) {
  std::string out = "[";
  size_t pos = 0;
  for (size_t i = 0;; ++i) {
    const std::string size = NextWord(kernel.kernel_args, &pos);
    if (size.empty()) break;
    uint64_t bits = 0;
    std::memcpy(&bits, params[i], std::strtoul(size.c_str(), nullptr, 10));
    out += (i ? ", " : "") + std::to_string(bits);
  }
  return out + "]";
}

}  // namespace

const char* jsm::HipUnavailable() { return nullptr; }

extern "C" {

__attribute__((visibility("hidden"))) int hipModuleLoadData(void** module, const void*) {
  std::lock_guard<std::mutex> lock(log_mutex);
  module_devices.push_back(current_device);
  *module = reinterpret_cast<void*>(module_devices.size());
  const char* kernel = jsm::launching.kernel ? jsm::launching.kernel->symbol : "";
  Emit("{\"event\": \"load\", \"kernel\": \"" + std::string(kernel) + "\", \"device\": " +
       std::to_string(current_device) + "}");
  return 0;
}

__attribute__((visibility("hidden"))) int hipModuleGetFunction(void** function, void* module,
                                                               const char* name) {
  std::lock_guard<std::mutex> lock(log_mutex);
  auto handle = reinterpret_cast<uintptr_t>(module) << 16 | (names.size() + 1);
  names[handle] = name;
  *function = reinterpret_cast<void*>(handle);
  return 0;
}

__attribute__((visibility("hidden"))) int hipModuleLaunchKernel(
    void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
    unsigned shared, void* stream, void** params, void**) {
  std::lock_guard<std::mutex> lock(log_mutex);
  const jsm::Kernel* kernel = jsm::launching.kernel;
  if (kernel == nullptr) return 1;  // hipErrorInvalidValue: not launched through jsm::Launch
  const auto u = [](uint64_t v) { return std::to_string(v); };
  const uintptr_t handle = reinterpret_cast<uintptr_t>(function);
  Emit("{\"event\": \"launch\", \"kernel\": \"" + std::string(kernel->symbol) +
       "\", \"function\": \"" + names[handle] + "\", \"device\": " +
       u(module_devices[(handle >> 16) - 1]) + ", \"grid\": [" + u(gx) + ", " + u(gy) + ", " +
       u(gz) + "], \"block\": [" + u(bx) + ", " + u(by) + ", " + u(bz) +
       "], \"shared\": " + u(shared) + ", \"stream\": " +
       u(reinterpret_cast<uintptr_t>(stream)) +
       ", \"packed\": " + Packed(*kernel, *jsm::launching.args) +
       ", \"kernel_args\": " + KernelArgs(*kernel, params) + "}");
  return 0;
}

__attribute__((visibility("hidden"))) int hipModuleUnload(void*) { return 0; }
__attribute__((visibility("hidden"))) int hipSetDevice(int device) {
  current_device = device;
  return 0;
}
__attribute__((visibility("hidden"))) int hipGetDevice(int* device) {
  *device = current_device;
  return 0;
}
__attribute__((visibility("hidden"))) int hipDeviceSynchronize() { return 0; }
__attribute__((visibility("hidden"))) int hipGetLastError() { return 0; }
__attribute__((visibility("hidden"))) const char* hipGetErrorName(int) { return "recorded"; }

// The events since the last call, as a JSON list (written to `buffer`, NUL-terminated); returns
// the length it needs, so a caller with too small a buffer can retry.
__attribute__((visibility("default"))) size_t jsm_record_take(char* buffer, size_t capacity) {
  std::lock_guard<std::mutex> lock(log_mutex);
  const std::string text = "[" + log_json + "]";
  if (text.size() < capacity) {
    std::memcpy(buffer, text.c_str(), text.size() + 1);
    log_json.clear();
  }
  return text.size() + 1;
}

}  // extern "C"
