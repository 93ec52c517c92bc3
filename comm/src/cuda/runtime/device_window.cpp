#include "cuda/runtime/device_window.hpp"

#include <chrono>
#include <cstdio>

#include "bootstrap.hpp"
#include "fd_exchange.hpp"
#include "log.hpp"
#include "meshmem/ipc/cuda_driver.hpp"

namespace meshmem::detail {

void create_device_part(WindowState& state, int device, std::size_t granularity, cudaStream_t zero_stream,
                        const std::string& what) {
  const bool timed = log_enabled(LogLevel::Debug);  // where the time of an alloc goes
  const auto t0 = std::chrono::steady_clock::now();
  auto memory = std::make_unique<DeviceWindowMemory>();
  memory->bytes = ipc::vmm_round(state.bytes, granularity);
  memory->mine = ipc::VmmAllocation::create(memory->bytes, device);
  const auto t1 = std::chrono::steady_clock::now();
  // Zeroed (signals start at 0) and complete before any peer can write into it.
  ipc::check_cuda(cudaMemsetAsync(memory->mine.data(), 0, memory->bytes, zero_stream), "cudaMemsetAsync", what);
  ipc::check_cuda(cudaStreamSynchronize(zero_stream), "cudaStreamSynchronize", what);
  if (timed) {
    const auto t2 = std::chrono::steady_clock::now();
    char buf[128];
    std::snprintf(buf, sizeof(buf), ": %zu bytes: create+map %.2f ms, zero %.2f ms", memory->bytes,
                  std::chrono::duration<double, std::milli>(t1 - t0).count(),
                  std::chrono::duration<double, std::milli>(t2 - t1).count());
    log(LogLevel::Debug, what + buf);
  }
  state.local = memory->mine.data();
  state.storage = std::move(memory);
}

std::vector<ipc::UniqueFd> exchange_part_fds(const CommContext& ctx, const WindowState& state, const std::string& what) {
  const auto& memory = static_cast<const DeviceWindowMemory&>(*state.storage);
  ipc::UniqueFd fd;
  agreed_step(ctx.boot, what, [&] { fd = memory.mine.export_fd(); });
  return ctx.fds.exchange(fd.get(), what);
}

void publish_peer_table(WindowState& state, const std::string& what) {
  auto& memory = static_cast<DeviceWindowMemory&>(*state.storage);
  state.device_peer_table = device_array(memory.table, state.peer, what);
}

}  // namespace meshmem::detail
