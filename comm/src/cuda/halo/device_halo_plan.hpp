// The device halo exchange plan (DeviceHaloPlan of device_interface.hpp): one kernel launch per
// exchange for the copies into mapped neighbours, the signals and the waits, with lanes for the
// neighbours a transport carries.
#pragma once

#include <memory>

#include "device_interface.hpp"

namespace meshmem::detail {

class GpuDevice;

// MESHMEM_HALO_SENDS=concurrent: halo plans send to their transport neighbours on lanes.
bool halo_sends_at_once(const Options& options);
// `sends_at_once`: halo_sends_at_once() of the Comm's options.
std::unique_ptr<DeviceHaloPlan> make_device_halo_plan(const DeviceHaloSpec& spec, const GpuDevice& device,
                                                      bool sends_at_once);

}  // namespace meshmem::detail
