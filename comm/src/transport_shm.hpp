// ShmTransport: host windows of peers on this node, mapped here (memfd passed between the
// ranks). Puts and gets are memcpy through the mapping; signals are atomics on the mapped word.
#pragma once

#include "transport.hpp"

namespace meshmem::detail {

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const CommContext& ctx) : ctx_(ctx) {}
  TransportKind kind() const override { return TransportKind::Shm; }
  Capabilities capabilities() const override { return Capabilities{false, true, true, false}; }
  bool serves(Memory memory) const override { return memory == Memory::Host; }
  Reach reach(int rank, Memory memory) const override;
  std::unique_ptr<WindowAttachment> attach(WindowState& win, const std::vector<bool>& routed,
                                           const std::string& what) override;
  void put(const WindowState& win, int target, std::size_t offset, const void* src,
           std::size_t bytes, const SignalUpdate& signal, Stream stream) override;
  void get(void* dst, const WindowState& win, int target, std::size_t offset,
           std::size_t bytes, Stream stream) override;
  void quiet(Stream stream) override;

 private:
  CommContext ctx_;
};

std::unique_ptr<Transport> make_shm_transport(const CommContext& ctx);

}  // namespace meshmem::detail
