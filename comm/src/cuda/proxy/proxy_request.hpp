// What the callers hand a transfer proxy (ProxyRequest) and what two proxies tell each other
// over MPI (Message): the protocol of the nccl and mpi-device transports' proxy threads.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "strided_rows.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

inline constexpr int kTagMessage = 1;
inline constexpr std::size_t kDoneWords = 65536;  // transfers in flight per rank

enum class MessageKind : std::uint32_t { Put = 1, GetRequest, GetData, Ack, Refused };

// A header between two proxies (over MPI, 80 bytes). `id` numbers the initiator's transfers
// to that peer. A strided put (width > 0) sends its rows packed: `bytes` / `width` rows of
// `width` bytes, which land `pitch` apart from `offset`.
struct Message {
  MessageKind kind;
  std::uint32_t flags;  // bit 0: has a signal; bits 8..15: its SignalOp
  std::uint64_t id;
  std::uint64_t window, offset, bytes;
  std::uint64_t signal_window, signal_index, value;
  std::uint64_t pitch = 0, width = 0;
};
static_assert(sizeof(Message) == 80, "one header is 80 bytes");

// The bytes a put's rows span in the target's window, or false if its shape is malformed
// (a strided put's rows are whole, not wider than their pitch, and the span fits 64 bits).
inline bool put_span(const Message& m, std::uint64_t* span) {
  if (m.width == 0) {
    *span = m.bytes;
    return true;
  }
  if (m.bytes == 0 || m.bytes % m.width != 0 || m.pitch < m.width) return false;
  return rows_end(0, m.width, m.bytes / m.width, m.pitch, span);
}

// One transfer, as the caller hands it to the proxy.
struct ProxyRequest {
  bool is_get = false;
  int peer = -1;
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream: the source (or dst) is ready
  cudaStream_t stream = nullptr;  // that stream: its transfers become ready in order
  const void* src = nullptr;    // put: here
  void* dst = nullptr;          // get: here
  std::size_t bytes = 0;
  std::uint64_t window = 0, offset = 0;  // the peer's window
  // A strided put (width > 0): `bytes` / `width` rows of `width` bytes, `src_pitch` apart
  // here (packed into device memory before the transfer) and `dst_pitch` apart there.
  std::size_t width = 0, src_pitch = 0, dst_pitch = 0;
  bool has_signal = false;
  std::uint64_t signal_window = 0, signal_index = 0, value = 0;
  SignalOp op = SignalOp::Set;
  std::size_t word = 0;  // its done word reaches `ticket` at its end
  std::uint64_t ticket = 0;
  // An eager put's device copy of its source (pageable, or strided rows packed): freed by the
  // proxy in its out-stream's order once the wire has read it. The caller cannot free it on
  // its own stream: its cudaFreeAsync returns at once, and a wire's later copy from memory
  // freed that way is refused (cudaErrorInvalidValue, seen on the mpi-device wire).
  void* bounce = nullptr;
  std::chrono::steady_clock::time_point started{};  // when the proxy started it (the watchdog's clock)
};

}  // namespace meshmem::detail
