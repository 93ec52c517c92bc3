// The internal transport interface. One transport object per kind and Comm; the Comm picks,
// per peer and memory kind, the first transport of MESHMEM_TRANSPORTS that reaches the peer
// (see CommImpl::select_transports). Arguments are validated before a transport sees them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "meshmem/comm.hpp"
#include "window_state.hpp"

namespace meshmem::detail {

// Where a signal update goes: word `index` of a signals window.
struct SignalUpdate {
  const WindowState* sig = nullptr;  // null: no signal
  std::size_t index = 0;
  std::uint64_t value = 0;
  SignalOp op = SignalOp::Set;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;

  // Copies `bytes` into target's part of `win`, then applies `signal` (if any) so that a
  // reader who sees the signal sees the data. Host transports (null stream) return when
  // `src` may be reused; device transports enqueue on `stream`.
  virtual void put(const WindowState& win, int target, std::size_t offset, const void* src,
                   std::size_t bytes, const SignalUpdate& signal, Stream stream) = 0;
  // Copies from target's part of `win`; complete on return (host) or when `stream` passes.
  virtual void get(void* dst, const WindowState& win, int target, std::size_t offset,
                   std::size_t bytes, Stream stream) = 0;
  // `height` rows of `width` bytes, `src_pitch` / `dst_pitch` apart (no signal). The
  // default puts row by row.
  virtual void put_strided(const WindowState& win, int target, std::size_t dst_offset, std::size_t dst_pitch,
                           const void* src, std::size_t src_pitch, std::size_t width, std::size_t height,
                           Stream stream) {
    for (std::size_t row = 0; row < height; ++row)
      put(win, target, dst_offset + row * dst_pitch, static_cast<const char*>(src) + row * src_pitch, width,
          SignalUpdate{}, stream);
  }
  // Every put and signal issued through this transport is complete at its target.
  virtual void quiet() = 0;
};

// Applies a signal update to a word of local or mapped memory, with release ordering so
// that the data written before it is visible to whoever acquires the new value.
inline void apply_signal(std::uint64_t* word, std::uint64_t value, SignalOp op) {
  if (op == SignalOp::Set)
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
  else
    __atomic_fetch_add(word, value, __ATOMIC_RELEASE);
}

}  // namespace meshmem::detail
