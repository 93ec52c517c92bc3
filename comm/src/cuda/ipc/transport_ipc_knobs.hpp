// The ipc transport's knobs (transport_ipc.cpp reads them). CUDA-free: knobs.cpp includes this
// file too, so that every build checks their values (knobs.hpp).
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "knobs.hpp"

namespace meshmem::detail {

inline const TuningKnob<std::size_t> kSmCopyMax{
    Tier::Tuning, "ipc", {"MESHMEM_IPC_SM_COPY_MAX", "MESHMEM_SM_COPY_MAX"}, 0, parse_bytes, print_number,
    "ipc transport: device puts/gets up to this many bytes run as a copy kernel on the SMs, larger ones on the copy "
    "engine",
    "Measured: the copy engine is faster at every size on H200, hence 0"};
inline const TuningKnob<std::size_t> kFusedSignalMax{
    Tier::Tuning, "ipc", {"MESHMEM_IPC_FUSED_SIGNAL_MAX", "MESHMEM_FUSED_SIGNAL_MAX"}, 65536, parse_bytes,
    print_number, "ipc transport: a device `put_signal` up to this size is one kernel that copies then signals",
    "Larger ones: the copy engine, then a stream write of the signal (measured on H200, one way: 5.8 against 9.1 us "
    "at 32 KiB, 6.6 against 8.6 at 64 KiB, 11.6 against 9.6 at 256 KiB)"};

// Both ipc checks below: `auto` (ask the driver, probe) or `off`.
enum class AutoOff { Auto, Off };
inline constexpr std::pair<const char*, AutoOff> kAutoOffChoices[] = {{"auto", AutoOff::Auto}, {"off", AutoOff::Off}};
inline const TuningKnob<AutoOff> kPeerAtomics{
    Tier::Testing, "ipc", {"MESHMEM_IPC_PEER_ATOMICS", "MESHMEM_PEER_ATOMICS"}, AutoOff::Auto,
    parse_named<kAutoOffChoices>, print_named<kAutoOffChoices>,
    "`off`: treat every other GPU as lacking native peer atomics, so that signal `Add` into it is refused (a test)",
    "Signal `Add` into another GPU is a remote atomic, which can lose updates between GPUs without native peer "
    "atomics (PCIe): `auto` asks the driver per pair (CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED) and refuses "
    "`Add` with Error(Unsupported) where they are absent (where the peer's GPU is hidden from this process it "
    "cannot be asked: allowed, logged at info); `off` treats every other GPU as lacking them, to test the refusal"};

inline const TuningKnob<AutoOff> kPeerAccess{
    Tier::User, "ipc", {"MESHMEM_IPC_PEER_ACCESS", "MESHMEM_PEER_ACCESS"}, AutoOff::Auto, parse_named<kAutoOffChoices>,
    print_named<kAutoOffChoices>,
    "`off`: ipc maps no other GPU's memory (pairs of GPUs go through `staged`), for peer access that the driver "
    "grants but that does not work",
    "`auto`: ipc maps a node peer's GPU memory where the driver grants peer access (cudaDeviceCanAccessPeer, where "
    "the peer's GPU is visible) and a probe mapping works; `off`: ipc reaches only ranks sharing this GPU, so pairs "
    "of different GPUs go through `staged` as on a node without peer access (for peer access that the driver grants "
    "but that does not work, and to test the staged route beside ipc in one job)"};

// The write-and-verify check of every mapped pair. `Corrupt` is MESHMEM_IPC_PEER_VERIFY_CORRUPT's
// (a test), not a value of MESHMEM_IPC_PEER_VERIFY.
enum class PeerVerify { On, Off, Corrupt };
inline constexpr std::pair<const char*, PeerVerify> kPeerVerifyChoices[] = {{"on", PeerVerify::On},
                                                                            {"off", PeerVerify::Off}};
inline PeerVerify parse_peer_verify(const char* name, const std::string& raw) {
  if (lower_trimmed(raw) == "corrupt")
    bad_knob_value(name, raw, "`on` or `off` (`corrupt` is now MESHMEM_IPC_PEER_VERIFY_CORRUPT=on, a test knob)");
  return parse_choice(name, raw, kPeerVerifyChoices);
}
inline const TuningKnob<PeerVerify> kPeerVerify{
    Tier::User, "ipc", {"MESHMEM_IPC_PEER_VERIFY", "MESHMEM_PEER_VERIFY"}, PeerVerify::On, parse_peer_verify,
    print_named<kPeerVerifyChoices>,
    "`on`: every peer mapping is written and read back when a Comm is made; a broken pair goes through `staged`; "
    "`off`: no check",
    "`on`: when a Comm is made, every rank writes a pattern through each peer mapping and reads it back, and the "
    "peer checks in its own memory that it arrived; a pair where it did not (peer access granted but broken: some "
    "IOMMU/ACS and virtualised setups) is not reached by ipc and goes through `staged`; `off`: no check"};

enum class OffOn { Off, On };
inline constexpr std::pair<const char*, OffOn> kOffOnChoices[] = {{"off", OffOn::Off}, {"on", OffOn::On}};
inline const TuningKnob<OffOn> kPeerVerifyCorrupt{
    Tier::Testing, "ipc", "MESHMEM_IPC_PEER_VERIFY_CORRUPT", OffOn::Off, parse_named<kOffOnChoices>,
    print_named<kOffOnChoices>,
    "`on`: this rank's peer-verify writes carry a wrong byte, as a broken peer path would (to test the fallback)",
    "Formerly the value `corrupt` of MESHMEM_PEER_VERIFY. The check runs (whatever MESHMEM_IPC_PEER_VERIFY says) "
    "and finds every pair of this rank broken: they go through `staged`",
    /*must_agree=*/true};

// What the check of the mapped pairs does.
inline PeerVerify peer_verify(const Options& o) {
  return kPeerVerifyCorrupt.get(o) == OffOn::On ? PeerVerify::Corrupt : kPeerVerify.get(o);
}

}  // namespace meshmem::detail
