// The staged transport's knobs (transport_staged.cpp reads them), all MESHMEM_STAGED_*.
// CUDA-free: knobs.cpp includes this file too, so that every build checks their values
// (knobs.hpp).
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "knobs.hpp"
#include "piece_cursor.hpp"

namespace meshmem::detail {

inline std::size_t parse_staged_slots(const char* name, const std::string& raw) {
  const std::size_t n = parse_bytes(name, raw);
  if (n < 2 || n > 64) bad_knob_value(name, raw, "a slot count from 2 to 64");
  return n;
}
inline std::size_t parse_staged_chunk(const char* name, const std::string& raw) {
  const std::size_t n = parse_bytes(name, raw);
  if (n < 4096 || n > (std::size_t(1) << 30) || n % 4096 != 0)
    bad_knob_value(name, raw, "a byte count from 4096 to 2^30, a multiple of 4096");
  return n;
}

inline const TuningKnob<std::size_t> kStagingChunk{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_CHUNK", "MESHMEM_STAGING_CHUNK"}, std::size_t(4) << 20,
    parse_staged_chunk, print_number, "staged transport (GPU pairs without peer access): bytes per pipeline chunk",
    "A chunk goes device-to-host on the source GPU's copy engine while the previous one goes host-to-device on the "
    "target's"};
inline const TuningKnob<std::size_t> kStagingSlots{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_SLOTS", "MESHMEM_STAGING_SLOTS"}, 4, parse_staged_slots, print_number,
    "staged transport: chunks in flight per rank",
    "Each rank's share of the node's pinned staging pool is slots x chunk plus 1 MiB of small slots for "
    "stream-filled puts (MESHMEM_STAGED_STREAM_FILL) and 1 MiB of control words (rounded up to 2 MiB pages; "
    "meshmem-info prints it), made when some pair of the Comm routes through `staged`"};

// PieceCursor's ramp, off by default: see transport_staged.cpp.
inline std::size_t parse_staged_first_piece(const char* name, const std::string& raw) {
  if (raw == "off") return 0;
  const std::size_t n = parse_bytes(name, raw);
  if (n < PieceCursor::kRampAlign || n > (std::size_t(1) << 30) || n % PieceCursor::kRampAlign != 0)
    bad_knob_value(name, raw, "`off` or a byte count from 64 KiB to 2^30, a multiple of 64 KiB");
  return n;
}
inline std::string print_staged_first_piece(const std::size_t& n) { return n == 0 ? "off" : print_number(n); }
inline const TuningKnob<std::size_t> kStagingFirstPiece{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_FIRST_PIECE", "MESHMEM_STAGING_FIRST_PIECE"}, 0,
    parse_staged_first_piece, print_staged_first_piece,
    "staged transport: a large transfer's first and last pieces this size, doubling up to a chunk in between; `off`: "
    "every piece a chunk",
    "A contiguous transfer of more than twice this many bytes starts with a piece of this size, the pieces doubling "
    "up to MESHMEM_STAGED_CHUNK, and ends with pieces halving down to between once and twice it, so that the "
    "target's copies start and end sooner (the pipeline's fill and drain); `off` (or a size over half a chunk): "
    "every piece a chunk. Off by default: on 1 x H200 shared by 2 ranks, 256 KiB made a 4 MiB put 14% faster, a "
    "64 MiB one no faster, and cost source completion and two streams their overlap (bench/results/"
    "2026-11-29-nvidia-h200-staged-first-piece-c3f85f6.txt); not yet measured with one GPU per rank"};

// "" (off) or a file prefix; "off" reads as "".
inline std::string parse_staged_trace_prefix(const char*, const std::string& raw) { return raw == "off" ? "" : raw; }
inline std::string print_staged_trace_prefix(const std::string& p) { return p.empty() ? "off" : p; }
inline const TuningKnob<std::string> kTraceStaged{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_TRACE", "MESHMEM_TRACE_STAGED"}, "", parse_staged_trace_prefix,
    print_staged_trace_prefix,
    "staged transport: a file prefix: each rank's staging agent writes the timestamps of its transfers' steps to "
    "`<prefix>.<rank>`; `off`: none",
    "For tests and tuning: each rank's staging agent keeps a timestamp of every step of its transfers (handed over, "
    "source seen ready, copy enqueued, posted; a peer's chunk seen, carried out) and writes them to "
    "`<prefix>.<rank>` when it ends (up to 2^20 steps, 32 MiB per rank while on); `bench/agent_trace.py <prefix>` "
    "prints where the time went",
    false};

// Small puts to hidden peers whose slot the caller's stream fills: see transport_staged.cpp.
enum class StreamFill { Auto, On, Off };
inline constexpr std::pair<const char*, StreamFill> kStreamFillChoices[] = {
    {"auto", StreamFill::Auto}, {"on", StreamFill::On}, {"off", StreamFill::Off}};
inline const TuningKnob<StreamFill> kStagingStreamFill{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_STREAM_FILL", "MESHMEM_STAGING_STREAM_FILL"}, StreamFill::Auto,
    parse_named<kStreamFillChoices>, print_named<kStreamFillChoices>,
    "staged transport: `on`: a small put to a rank whose GPU is hidden is copied into the pool by a kernel on the "
    "caller's stream; `off`; `auto`",
    "`on`: a put, put_signal or halo send (strided rows are packed) of at most 64 KiB from this rank's GPU (its rows "
    "4-byte aligned: others, which a kernel would copy bytewise, take the agent's copy) to a rank whose GPU is hidden "
    "here goes into a small slot of the pool by a kernel on the caller's stream (the kernel that waits for the "
    "put's end anyway), so the agent only posts it; 16 slots, one per stream, a slot passing to another stream once "
    "its stream's last put there ended (other streams then, captured puts and the per-thread default stream go "
    "through the agent's copy), and a slot found held by a put that timed out never filled again (its reader may "
    "still copy out of it); `off`: every put through the agent's copy; `auto`: `on` unless this rank shares its GPU "
    "(MESHMEM_STREAM_WAIT resolves to memop: the kernel would wait for its process's time slice, a copy engine does "
    "not)"};

// When a staged put's stream goes on: see transport_staged.cpp.
enum class Completion { Target, Source };
inline constexpr std::pair<const char*, Completion> kCompletionChoices[] = {{"target", Completion::Target},
                                                                           {"source", Completion::Source}};
inline const TuningKnob<Completion> kStagedCompletion{
    Tier::User, "staged", "MESHMEM_STAGED_COMPLETION", Completion::Target, parse_named<kCompletionChoices>,
    print_named<kCompletionChoices>,
    "staged transport: a put's stream goes on once its bytes landed (`target`) or once its source was read "
    "(`source`, as in OpenSHMEM)",
    "When the stream of a put, put_signal or strided put to a rank whose GPU is reached through the channel "
    "(MESHMEM_STAGED_CHANNELS; not a stream-filled put, nor one captured into a graph) goes on: `target`: once its "
    "bytes and signal landed there; `source`: once its source is copied into the staging pool (the put of OpenSHMEM "
    "and NVSHMEM: the source may be reused), its copy to the target going on meanwhile; `quiet(stream)` and "
    "`barrier(stream)` then make the stream wait for the landing of its puts, a `get` for that of its stream's puts "
    "to the same rank, and `Window::free`, `barrier()` and `~Comm` wait on the host. Puts to one rank land in order, "
    "each signal after its data; puts to different ranks are ordered only by a quiet"};

// Small transfers between GPUs this process both sees, as the caller's stream work: see
// transport_staged.cpp.
inline std::size_t parse_staged_stream_path(const char* name, const std::string& raw) {
  if (raw == "off") return 0;
  const std::size_t n = parse_bytes(name, raw);
  if (n < 1 || n > (std::size_t(1) << 20)) bad_knob_value(name, raw, "`off` or a byte count from 1 to 1 MiB");
  return n;
}
inline std::string print_staged_stream_path(const std::size_t& n) { return n == 0 ? "off" : print_number(n); }
inline const TuningKnob<std::size_t> kStagedStreamPath{
    Tier::Tuning, "staged", "MESHMEM_STAGED_STREAM_PATH", 0, parse_staged_stream_path,
    print_staged_stream_path,
    "staged transport: transfers of at most this many bytes with a GPU this process sees go as the caller's stream "
    "work, not through the agents; `off`",
    "A transfer of at most this many bytes (width x rows) with a rank of the node whose GPU this process sees (every "
    "placement but CUDA_VISIBLE_DEVICES isolation), outside graph capture, is copied by the caller's stream into one "
    "of 16 pinned slots of this process and out of it into the target (on this process's stream of the target's "
    "GPU where that is another), its signal after it: no host thread between the copies, and the caller's stream "
    "goes on once it landed, whatever MESHMEM_STAGED_CHANNELS and MESHMEM_STAGED_COMPLETION say. Larger "
    "transfers, captured ones, those from or into pageable memory, those with hidden GPUs and those that find no "
    "slot free of other streams' unfinished transfers go through the agents. Each rank keeps 16 x this many "
    "bytes of pinned memory while some pair routes through `staged`. Off by default until the measurement against "
    "the agents' path chooses the sizes (docs/transports/staged.md)"};
enum class StreamPathSplit { Off, On };
inline constexpr std::pair<const char*, StreamPathSplit> kStreamPathSplitChoices[] = {{"off", StreamPathSplit::Off},
                                                                                     {"on", StreamPathSplit::On}};
inline const TuningKnob<StreamPathSplit> kStagedStreamPathSplit{
    Tier::Testing, "staged", "MESHMEM_STAGED_STREAM_PATH_SPLIT", StreamPathSplit::Off,
    parse_named<kStreamPathSplitChoices>, print_named<kStreamPathSplitChoices>,
    "staged transport, for tests: the stream path's step on the peer's GPU on a stream of its own even where that "
    "GPU is this rank's",
    "For tests on one GPU: the stream path (MESHMEM_STAGED_STREAM_PATH) runs the target's copy and signal on this "
    "process's own stream of the target's GPU, joined to the caller's stream by events, as it does where the two "
    "GPUs differ, also where ranks share the GPU"};

// Who drives the target GPU of a pair whose GPUs are both visible here: see transport_staged.cpp.
enum class Channels { Always, WhenHidden };
inline constexpr std::pair<const char*, Channels> kChannelChoices[] = {{"always", Channels::Always},
                                                                      {"when-hidden", Channels::WhenHidden}};
inline const TuningKnob<Channels> kStagingChannels{
    Tier::Tuning, "staged", {"MESHMEM_STAGED_CHANNELS", "MESHMEM_STAGING_CHANNELS"}, Channels::Always,
    parse_named<kChannelChoices>, print_named<kChannelChoices>,
    "staged transport: `always`: each rank's agent drives only its own GPU; `when-hidden`: an agent that sees both "
    "GPUs drives both copies",
    "`always`: each rank's agent drives only its own GPU, and the two ranks' agents share every transfer through a "
    "channel in the pool (the device-to-host copy on the source's GPU, the host-to-device copy, signal and done word "
    "by the target's agent); `when-hidden`: where this process sees both GPUs its agent drives both copies (to an "
    "idle GPU about as fast as the channel; but its work on a GPU busy with the peer's kernels waits for the "
    "driver's time slice between processes, milliseconds per transfer), and the channel only where the peer's GPU "
    "is hidden (CUDA_VISIBLE_DEVICES isolation)"};

}  // namespace meshmem::detail
