// The layout of each rank's region of the node's staging pool: the shared-memory ABI that the
// agents of the node's ranks (processes that may be built apart, but of one meshmem) read and
// write. A change here changes what every agent of the node expects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "meshmem/types.hpp"

namespace meshmem::detail {

// A window id that is none: the descriptor's address is a raw one of the reader's.
inline constexpr std::uint64_t kChannelAddress = ~std::uint64_t(0);

// The control words after the slots and the fill slots (FillSlots) in each rank's region of
// the pool (1 MiB):
//   lane counters   one per lane: transfers that ended on it (the host takes words back)
//   fill retired    one per fill slot: set for good by a fill kernel that found the slot held
//                   by a transfer that timed out (cuda::SlotFill::retired)
//   barrier flags   one per rank of the Comm, then the leaders' mark (the stream barrier's,
//                   stream_barrier.cpp)
//   posted          per node rank: descriptors this rank posted to it (written by this GPU
//                   after the copy, or by this rank's agent once the copy is done or, for
//                   a stream-filled put, at once)
//   consumed        per node rank: its descriptors this rank consumed (the same)
//   failed          per node rank: its descriptors this rank could not carry out (host)
//   rings           per node rank: kRing descriptors of kDescriptorWords words to it
//   transfer words  half the rest: one done word per transfer in flight or captured
//   ready words     the other half, one per transfer word: the caller's stream sets it to the
//                   transfer's ticket once the transfer's source is ready (the agent polls
//                   memory, not events: an event query costs the agent's thread ~0.8 us)
// Node ranks are counted by their place in Topology::node_ranks.
//
// Between each rank's slots and its control words: kSlots small slots that callers' streams
// fill themselves (StagedTransport's stream-filled puts), one per stream.
struct FillSlots {
  static constexpr std::size_t kSlotBytes = std::size_t(64) << 10;
  static constexpr std::size_t kSlots = 16;
  static constexpr std::size_t kBytes = kSlotBytes * kSlots;
};

struct ControlWords {
  static constexpr std::size_t kBytes = std::size_t(1) << 20;
  static constexpr std::size_t kWords = kBytes / sizeof(std::uint64_t);
  static constexpr std::size_t kLanes = 64;
  static constexpr std::size_t kRing = 64;  // descriptors in flight per pair
  static constexpr std::size_t kDescriptorWords = 16;
  static constexpr std::size_t kLeastTransferWords = 4096;
  std::uint64_t* base = nullptr;
  std::size_t ranks = 0;
  std::size_t node_ranks = 0;
  static std::size_t round8(std::size_t n) { return (n + 7) / 8 * 8; }
  std::uint64_t* lane_done(std::size_t lane) const { return base + lane; }
  std::uint64_t* fill_retired(std::size_t slot) const { return base + kLanes + slot; }
  std::uint64_t* barrier_flags() const { return base + kLanes + FillSlots::kSlots; }
  std::uint64_t* posted(std::size_t to) const { return barrier_flags() + round8(ranks + 1) + to; }
  std::uint64_t* consumed(std::size_t from) const { return posted(0) + round8(node_ranks) + from; }
  std::uint64_t* failed(std::size_t from) const { return consumed(0) + round8(node_ranks) + from; }
  std::uint64_t* ring(std::size_t to) const { return failed(0) + round8(node_ranks) + to * kRing * kDescriptorWords; }
  std::uint64_t* transfer(std::size_t i) const { return ring(0) + node_ranks * kRing * kDescriptorWords + i; }
  std::size_t used_words() const { return static_cast<std::size_t>(transfer(0) - base); }
  std::size_t transfer_count() const { return used_words() < kWords ? (kWords - used_words()) / 2 : 0; }
  std::uint64_t* ready(std::size_t i) const { return transfer(transfer_count()) + i; }
};

// One entry of a channel's ring (ControlWords::ring): what the reader's agent copies where.
struct ChannelDescriptor {
  static constexpr std::uint64_t kChunk = 1, kGet = 2;  // kinds (bits 0..7 of `control`)
  static constexpr std::uint64_t kLast = 1u << 8;      // the last chunk: the signal and done word follow
  // Its number on the channel: the reader refuses an entry whose number is not the one it
  // expects (stale, or overwritten: nothing should do that, as entries are reused only once
  // consumed; a mismatch breaks the channel).
  std::uint64_t sequence = 0;
  std::uint64_t control = 0;      // kind | kLast | SignalOp << 16
  std::uint64_t slot_offset = 0;  // kChunk: the chunk's place in the writer's region
  std::uint64_t width = 0, rows = 1;
  // kChunk: where it lands (a window of the reader and an offset, or kAddress and an address
  // of the reader's). kGet: the reader's window to read (window, src_offset, src_pitch) and
  // the initiator's address for the answer (dst, dst_pitch).
  std::uint64_t window = kChannelAddress, dst = 0, dst_pitch = 0;
  std::uint64_t src_offset = 0, src_pitch = 0;
  std::uint64_t signal_window = kChannelAddress, signal_index = 0, value = 0;
  std::uint64_t done_rank = 0, done_word = 0, ticket = 0;
  std::uint64_t kind() const { return control & 0xff; }
  bool last() const { return (control & kLast) != 0; }
  SignalOp op() const { return static_cast<SignalOp>((control >> 16) & 0xff); }
};

static_assert(ControlWords::kWords * sizeof(std::uint64_t) == ControlWords::kBytes, "control words fill their bytes");
static_assert(FillSlots::kBytes == FillSlots::kSlotBytes * FillSlots::kSlots, "fill slots fill their bytes");
static_assert(sizeof(ChannelDescriptor) == ControlWords::kDescriptorWords * sizeof(std::uint64_t),
              "a ring entry is kDescriptorWords words");
static_assert(std::is_standard_layout_v<ChannelDescriptor> && std::is_trivially_copyable_v<ChannelDescriptor>,
              "ring entries are copied as words between processes");

}  // namespace meshmem::detail
