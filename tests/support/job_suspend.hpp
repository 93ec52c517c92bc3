// Suspends a whole job, as a scheduler's suspend or a debugger's all-stop does: a child of the
// calling rank waits `after`, stops every rank of `pids` (SIGSTOP), waits `stopped`, then
// continues them (SIGCONT) and exits. Returns the child's pid (-1 when fork failed) for
// waitpid. Only async-signal-safe calls in the child: the parent has threads.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <vector>

namespace meshmem::test {

inline pid_t suspend_job_after(const std::vector<pid_t>& pids, std::chrono::milliseconds after,
                               std::chrono::milliseconds stopped) {
  const pid_t child = fork();
  if (child != 0) return child;
  auto nap = [](std::chrono::milliseconds d) {
    timespec t{static_cast<time_t>(d.count() / 1000), static_cast<long>(d.count() % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
  };
  nap(after);
  for (pid_t p : pids) kill(p, SIGSTOP);
  nap(stopped);
  for (pid_t p : pids) kill(p, SIGCONT);
  _exit(0);
}

}  // namespace meshmem::test
