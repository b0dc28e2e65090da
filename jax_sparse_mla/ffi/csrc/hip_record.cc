// A recording HIP for the CPU tests: the same handlers, launcher and FlyDSL objects as the ROCm
// library, but hipModuleLaunchKernel writes what it would launch (kernel, grid, block, stream,
// every kernel argument's bytes) to a log that jsm_record_take() returns as JSON.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "jsm_ffi.h"

namespace {

std::mutex log_mutex;
std::ostringstream log_json;  // comma-separated JSON objects
int current_device = 0;
std::vector<int> module_devices;          // module handle - 1 -> device it was loaded on
std::map<uintptr_t, std::string> names;   // function handle -> kernel name

void Emit(const std::string& event) {
  if (log_json.tellp() > 0) log_json << ",\n";
  log_json << event;
}

// The handler's packed arguments: [name, kind, value] per ABI entry but the stream; pointers,
// layouts and int32 as integers, f32 as its bit pattern (exact).
std::string Packed(const jsm::Kernel& kernel, const jsm::LaunchArgs& args) {
  std::ostringstream out;
  std::istringstream abi(kernel.abi);
  std::string entry;
  out << "[";
  for (size_t i = 0; abi >> entry; ++i) {
    const std::string name = entry.substr(0, entry.find(':'));
    const std::string kind = entry.substr(entry.find(':') + 1);
    if (kind == "s") break;
    uint64_t bits = args.slot(i);
    if (kind != "p") bits &= 0xFFFFFFFFu;
    out << (i ? ", " : "") << "[\"" << name << "\", \"" << kind << "\", " << bits << "]";
  }
  out << "]";
  return out.str();
}

// What the GPU kernel receives: each kernelParams entry's bytes as an unsigned integer.
std::string KernelArgs(const jsm::Kernel& kernel, void** params) {
  std::ostringstream out;
  std::istringstream sizes(kernel.kernel_args);
  size_t size = 0;
  out << "[";
  for (size_t i = 0; sizes >> size; ++i) {
    uint64_t bits = 0;
    std::memcpy(&bits, params[i], size);
    out << (i ? ", " : "") << bits;
  }
  out << "]";
  return out.str();
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
  std::ostringstream event;
  event << "{\"event\": \"launch\", \"kernel\": \"" << kernel->symbol << "\", \"function\": \""
        << names[reinterpret_cast<uintptr_t>(function)] << "\", \"device\": "
        << module_devices[(reinterpret_cast<uintptr_t>(function) >> 16) - 1] << ", \"grid\": ["
        << gx << ", " << gy << ", " << gz << "], \"block\": [" << bx << ", " << by << ", " << bz
        << "], \"shared\": " << shared << ", \"stream\": " << reinterpret_cast<uintptr_t>(stream)
        << ", \"packed\": " << Packed(*kernel, *jsm::launching.args)
        << ", \"kernel_args\": " << KernelArgs(*kernel, params) << "}";
  Emit(event.str());
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
  const std::string text = "[" + log_json.str() + "]";
  if (text.size() < capacity) {
    std::memcpy(buffer, text.c_str(), text.size() + 1);
    log_json.str("");
    log_json.clear();
  }
  return text.size() + 1;
}

}  // extern "C"
