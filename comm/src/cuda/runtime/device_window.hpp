// Device window memory: this rank's part of a device window is a CUDA VMM allocation that
// the ipc transport exports to node peers as a POSIX descriptor; its peer table (the
// peers' parts as mapped here) lives on the device for kernels (Window::view()).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "window_state.hpp"
#include "transport.hpp"
#include "cuda/runtime/block_pool.hpp"
#include "meshmem/ipc/vmm.hpp"

namespace meshmem::detail {

class DeviceWindowMemory final : public WindowMemory {
 public:
  ~DeviceWindowMemory() override {
    // The window releaser destroys it once the device's earlier work has ended. Anywhere
    // else (a free or ~Comm that raised before its release, an allocation that failed) that
    // work may still use it: let it finish before it is unmapped.
    if (!in_quiesced_release()) (void)cudaDeviceSynchronize();
  }
  ipc::VmmAllocation mine;
  std::size_t bytes = 0;  // as allocated (rounded to the granularity)
  PooledBlock table;      // device copy of WindowState::peer
};

// This rank's part (state.local, state.peer[rank], state.storage), zeroed and complete
// before the call returns. Local: the caller agrees on the outcome.
void create_device_part(WindowState& state, int device, std::size_t granularity, cudaStream_t zero_stream,
                        const std::string& what);
// state.peer copied to the device (state.device_peer_table). Local.
void publish_peer_table(WindowState& state, const std::string& what);

// Collective over the Comm: this rank's part of device window `state` exported, and by rank a
// descriptor of every node peer's part (empty for this rank and other nodes).
std::vector<ipc::UniqueFd> exchange_part_fds(const CommContext& ctx, const WindowState& state, const std::string& what);

}  // namespace meshmem::detail
