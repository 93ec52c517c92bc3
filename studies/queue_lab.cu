// queue_lab: the study behind cuda/gpu_queues.hpp. Does a stream that waits hold back the
// work of another stream of the same process, and does a second context escape it?
//   queue_lab all            every case below, each in a child process (a held-back case can
//                            leave its process stuck: the child is killed after 15 s)
//   queue_lab queue BLOCKER VICTIM WORK
//     BLOCKER: memop (cuStreamWaitValue64 on a pinned word), kernel (a polling kernel), and
//              either followed by a tiny kernel on the same stream (memop+tail, kernel+tail),
//              on N streams (N = CUDA_DEVICE_MAX_CONNECTIONS, or BLOCKERS=N)
//     VICTIM:  a stream made before the blockers: same (primary context), hiprio (greatest
//              priority), green (a green context of all SMs), ctx (a context of cuCtxCreate)
//     WORK:    copy (64 MiB device to device; VMM=1: VMM memory) or kernel (a copy kernel), or
//              what a staged transfer enqueues: memop-write (a stream write of a pinned word),
//              h2h8 / h2d8 / d2h8 (8-byte copies, pinned host memory), d2h / h2d / d2d (4 MiB
//              with pinned host memory, or within the GPU), h2d-batch / h2d8-batch / d2d-batch
//              (cudaMemcpyBatchAsync, cudaMemcpyFlagPreferOverlapWithCompute)
//     -> "ran in X ms" or "HELD BACK" (not done after 2 s; then the blockers are released)
//   queue_lab access green|ctx   a kernel of that context copies primary-context memory
//   queue_lab cost               device memory a green context and a cuCtxCreate context take
//   queue_lab nccl primary|green|ctx   a one-rank NCCL send/recv with that context current
//   queue_lab blocking       which releasing calls (cudaFree, ...) wait for a running kernel
//   queue_lab contention HOLDER   while another thread is inside HOLDER (devsync, free,
//                            freehost, streamsync, eventsync), held there by a running kernel,
//                            which calls of this thread wait too
//   queue_lab capture CAPTURE SYNCER CALL   this thread captures a kernel on a stream of
//                            its own in mode CAPTURE (global, thread, relaxed); meanwhile
//                            another thread in mode SYNCER calls CALL (devsync, ctxsync,
//                            streamsync and eventsync of a stream of its own, unmap of a VMM
//                            chunk, free): that call's result, the capture's end, and whether
//                            the graph then replays
//   queue_lab order          is an 8-byte pinned-to-pinned cudaMemcpyAsync stream-ordered?
//   queue_lab chain BRANCHES STEPS ROUNDS WORK   does cudaGraphLaunch return before the graph
//                            runs, and can another thread enqueue meanwhile? A graph of
//                            BRANCHES branches of STEPS steps each: a host node hands the step to
//                            an "agent" thread (as meshmem's captured hand-off does), then a
//                            polling kernel waits for the agent's word. WORK is what the agent
//                            does for a step: host (stores the word, no CUDA call), memop
//                            (cuStreamWriteValue64 on its stream), kernel (a kernel writes it),
//                            copy / d2h / h2d (a 4 KiB device-to-device / to pinned host / from
//                            pinned host copy, then the memop), event (an event recorded, waited
//                            for on the stream and queried, then the memop). Prints the longest
//                            cudaGraphLaunch call and the agent's longest CUDA call; a launch
//                            still inside after 3 s is released from the host (DEADLOCK).
//                            CHAIN_HOST=all|first|none: where the host nodes are (see the code);
//                            doorbell: no host node, a kernel writes the step into a word the
//                            agent polls.
//   queue_lab graph MODE BRANCHES N [probe]   N rounds of a graph captured from BRANCHES
//                            streams (fork and join): a host node hands a round number to this
//                            thread (as meshmem's captured hand-off does), then each branch
//                            waits for a pinned word (polling kernel, a tiny kernel behind it);
//                            this thread copies 4 KiB on an "agent" stream made first and sets
//                            the word after the copy. MODE new: instantiated each round; reuse:
//                            once. A round not done after 1 s is STALLED: a fresh stream then
//                            sets the word (does it escape?), else the host does. probe: before
//                            each round's copy an event on the agent stream must complete within
//                            2 ms, else the agent moves to a fresh stream (the mitigation tried).
// No meshmem: the lab is about CUDA. Results: bench/results/*-queue-lab-*.txt.
#include "queue_lab_common.cuh"
#include "queue_lab_queue.cuh"
#include "queue_lab_release.cuh"
#include "queue_lab_graph.cuh"

// Runs `args` of this program in a child with `env` added; kills it after `limit_s`.
static void run_case(const char* self, const std::vector<std::string>& env, const std::vector<std::string>& args,
                     int limit_s = 15) {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv{const_cast<char*>(self)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(self, argv.data());
    _exit(127);
  }
  int status = 0;
  for (int i = 0; i < limit_s * 100; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  std::string line;
  for (const auto& e : env) line += e + " ";
  for (const auto& a : args) line += a + " ";
  printf("RESULT %s: process stuck after %d s (killed): HELD BACK\n", line.c_str(), limit_s);
}

static int all(const char* self) {
  const std::vector<std::string> c8{"CUDA_DEVICE_MAX_CONNECTIONS=8"};
  for (const char* work : {"copy", "kernel"})
    for (const char* blocker : {"memop", "memop+tail", "kernel", "kernel+tail"})
      for (const char* victim : {"same", "hiprio", "green", "ctx"}) run_case(self, c8, {"queue", blocker, victim, work});
  for (const char* victim : {"same", "green", "ctx"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=8", "VMM=1"}, {"queue", "memop", victim, "copy"});
  for (const char* victim : {"same", "ctx"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=1"}, {"queue", "memop", victim, "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=8", "BLOCKERS=1"}, {"queue", blocker, "same", "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=32"}, {"queue", blocker, "same", "copy"});
  for (const char* blocker : {"memop+tail", "kernel+tail"})
    run_case(self, {"CUDA_DEVICE_MAX_CONNECTIONS=32", "BLOCKERS=8"}, {"queue", blocker, "same", "copy"});
  run_case(self, {}, {"access", "green"});
  run_case(self, {}, {"access", "ctx"});
  run_case(self, {}, {"cost"});
  run_case(self, {}, {"blocking"}, 120);
  for (const char* holder : {"devsync", "free", "freehost", "streamsync", "eventsync"})
    run_case(self, {}, {"contention", holder}, 120);
  for (const char* k : {"primary", "green", "ctx"}) run_case(self, {}, {"nccl", k});
  for (const char* capture : {"global", "thread", "relaxed"})
    for (const char* syncer : {"global", "thread", "relaxed"})
      for (const char* call : {"devsync", "ctxsync", "streamsync", "eventsync", "unmap", "free"})
        run_case(self, {}, {"capture", capture, syncer, call}, 20);
  return 0;
}

int main(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "";
  if (what == "all") return all(argv[0]);
  if (what == "queue" && argc == 5) return queue_test(argv[2], argv[3], argv[4]);
  if (what == "access" && argc == 3) return access_test(argv[2]);
  if (what == "cost") return cost_test();
  if (what == "blocking") return blocking_test();
  if (what == "contention" && argc == 3) return contention_test(argv[2]);
  if (what == "nccl" && argc == 3) return nccl_test(argv[2]);
  if (what == "capture" && argc == 5) return capture_test(argv[2], argv[3], argv[4]);
  if (what == "order") return order_test();
  if (what == "chain" && argc == 6) return chain_test(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), argv[5]);
  if (what == "graph" && (argc == 5 || argc == 6))
    return graph_test(argv[2], atoi(argv[3]), atoi(argv[4]), argc == 6 && std::string(argv[5]) == "probe");
  printf("usage: queue_lab all | queue BLOCKER VICTIM WORK | access green|ctx | cost | blocking | contention HOLDER | nccl primary|green|ctx | capture MODE MODE CALL | graph new|reuse BRANCHES N [probe] | chain BRANCHES STEPS ROUNDS host|memop|kernel|copy|d2h|h2d|event\n");
  return 2;
}
