#include "cuda/agent/captured_handoff.hpp"

#include "cuda/runtime/gpu_device.hpp"

#include <system_error>
#include <thread>

namespace meshmem::detail {

TicketWait TicketWait::on(const GpuDevice& device, const std::uint64_t* done, cuda::FaultKind fault, int peer) {
  TicketWait wait;
  wait.done = done;
  wait.fault = fault;
  wait.peer = peer;
  wait.limit = device.wait_limit();
  wait.early = device.early_launch();
  wait.gated = !device.waits_with_kernel();
  wait.memop_flags = device.wait_flags();
  return wait;
}

namespace {

// One thread for the process, started at the first gated capture and never joined (it only
// sleeps and reads pinned memory; its state is never destroyed: boards may outlive static
// destruction inside graphs).
struct HandoffWatch {
  std::mutex m;
  std::vector<std::function<bool()>> checks;
  bool started = false;
};

HandoffWatch& handoff_watch() {
  static auto* watch = new HandoffWatch();
  return *watch;
}

void run_watch(HandoffWatch& w) {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::vector<std::function<bool()>> checks;
    {
      std::lock_guard<std::mutex> lock(w.m);
      checks.swap(w.checks);
    }
    // Outside w.m: a check takes its board's mutex, under which a capture may register.
    std::vector<std::function<bool()>> kept;
    for (auto& check : checks)
      if (check()) kept.push_back(std::move(check));
    std::lock_guard<std::mutex> lock(w.m);
    for (auto& check : w.checks) kept.push_back(std::move(check));  // registered meanwhile
    w.checks.swap(kept);
  }
}

}  // namespace

void watch_handoffs(std::function<bool()> check) {
  HandoffWatch& w = handoff_watch();
  std::lock_guard<std::mutex> lock(w.m);
  w.checks.push_back(std::move(check));
  if (w.started) return;
  try {
    std::thread([&w] { run_watch(w); }).detach();
    w.started = true;
  } catch (const std::system_error&) {
    // No thread now: the next gated capture tries again; meanwhile the owners' threads open
    // gates (only a stuck owner's steps would wait past their limit).
  }
}

}  // namespace meshmem::detail
