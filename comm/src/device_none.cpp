// The device backend of builds without CUDA: device windows are unavailable.
#include "bootstrap.hpp"
#include "device_backend.hpp"

namespace meshmem::detail {

std::unique_ptr<DeviceBackend> make_device_backend(const DeviceContext&, std::string* why) {
  *why = "meshmem was built without its GPU part (no CUDA toolkit at build time)";
  return nullptr;
}

bool device_runtime_available(std::string* why) {
  if (why) *why = "meshmem was built without its GPU part (no CUDA toolkit at build time)";
  return false;
}

int set_device_modulo(int) { return -1; }

}  // namespace meshmem::detail
