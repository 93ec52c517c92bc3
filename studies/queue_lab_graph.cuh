// queue_lab graph / chain / order: captured hand-offs to an agent thread, and the order of
// small pinned copies. Included once, by queue_lab.cu.
#pragma once
// Graph rounds against a copy of another stream (see the header).
__global__ void spin_to(volatile unsigned long long* w, volatile unsigned long long* target) {
  if (w == nullptr) return;
  while (*w < *target) __nanosleep(1000);
}
static std::atomic<unsigned long long> handed{0};
static unsigned long long* host_target = nullptr;
static void CUDART_CB hand_over(void*) {
  const unsigned long long v = handed.load() + 1;
  *host_target = v;
  handed.store(v);
}
static bool wait_query(cudaStream_t s, double seconds) {
  const double t0 = now();
  while (now() - t0 < seconds) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) CR(q);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return false;
}
static int graph_test(const std::string& mode, int branches, int rounds, bool probe) {
  init();
  spin_to<<<1, 1>>>(nullptr, nullptr);
  (void)cudaGetLastError();
  tiny<<<1, 1>>>();
  CR(cudaDeviceSynchronize());
  cudaStream_t agent;
  CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));  // first, as meshmem's agent's
  unsigned long long *word = nullptr, *dword = nullptr, *dtarget = nullptr;
  CR(cudaHostAlloc((void**)&word, 8, cudaHostAllocMapped));
  CR(cudaHostAlloc((void**)&host_target, 8, cudaHostAllocMapped));
  *word = 0;
  *host_target = ~0ull;
  CR(cudaHostGetDevicePointer((void**)&dword, word, 0));
  CR(cudaHostGetDevicePointer((void**)&dtarget, host_target, 0));
  void *src = nullptr, *dst = nullptr;
  CR(cudaMalloc(&src, 4096));
  CR(cudaMalloc(&dst, 4096));
  std::vector<cudaStream_t> streams(static_cast<size_t>(branches));
  for (auto& st : streams) CR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork, probe_ev;
  CR(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CR(cudaEventCreateWithFlags(&probe_ev, cudaEventDisableTiming));
  std::vector<cudaEvent_t> joins(static_cast<size_t>(branches));
  for (auto& e : joins) CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaGraphExec_t exec = nullptr;
  int stalls = 0, escaped = 0, moved = 0, made = 1;
  std::string where;
  for (int round = 1; round <= rounds; ++round) {
    if (exec == nullptr || mode == "new") {
      if (exec != nullptr) CR(cudaGraphExecDestroy(exec));
      cudaStream_t s = streams[0];
      CR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      CR(cudaLaunchHostFunc(s, hand_over, nullptr));
      CR(cudaEventRecord(fork, s));
      for (int b = 1; b < branches; ++b) CR(cudaStreamWaitEvent(streams[b], fork, 0));
      for (int b = 0; b < branches; ++b) {
        spin_to<<<1, 1, 0, streams[b]>>>(dword, dtarget);
        tiny<<<1, 1, 0, streams[b]>>>();
      }
      for (int b = 1; b < branches; ++b) {
        CR(cudaEventRecord(joins[b], streams[b]));
        CR(cudaStreamWaitEvent(s, joins[b], 0));
      }
      cudaGraph_t g = nullptr;
      CR(cudaStreamEndCapture(s, &g));
      CR(cudaGraphInstantiate(&exec, g, 0));
      CR(cudaGraphDestroy(g));
    }
    CR(cudaGraphLaunch(exec, streams[0]));
    const double t0 = now();
    while (handed.load() < (unsigned long long)round) {
      if (now() - t0 > 5) {
        printf("RESULT FAIL round %d: the host node did not run within 5 s\n", round);
        return 3;
      }
      std::this_thread::yield();
    }
    if (probe) {
      CR(cudaEventRecord(probe_ev, agent));
      const double p0 = now();
      cudaError_t q = cudaErrorNotReady;
      while (now() - p0 < 2e-3 && (q = cudaEventQuery(probe_ev)) == cudaErrorNotReady) {
      }
      if (q == cudaErrorNotReady) {  // its queue is held: leave the stream (its probe runs later) for a fresh one
        CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));
        ++moved;
        ++made;
      } else if (q != cudaSuccess) {
        CR(q);
      }
    }
    CR(cudaMemcpyAsync(dst, src, 4096, cudaMemcpyDeviceToDevice, agent));
    CK(cuStreamWriteValue64((CUstream)agent, (CUdeviceptr)dword, (cuuint64_t)round, CU_STREAM_WRITE_VALUE_DEFAULT));
    if (!wait_query(streams[0], 1.0)) {
      ++stalls;
      where += " " + std::to_string(round);
      cudaStream_t fresh;
      CR(cudaStreamCreateWithFlags(&fresh, cudaStreamNonBlocking));
      ++made;
      CK(cuStreamWriteValue64((CUstream)fresh, (CUdeviceptr)dword, (cuuint64_t)round, CU_STREAM_WRITE_VALUE_DEFAULT));
      if (wait_query(streams[0], 0.5)) {
        ++escaped;
        where += "(fresh escaped)";
      } else {
        *(volatile unsigned long long*)word = (unsigned long long)round;
        where += "(host released)";
        if (!wait_query(streams[0], 2.0)) {
          printf("RESULT FAIL round %d: not done even after the host set the word\n", round);
          return 3;
        }
      }
    }
  }
  CR(cudaDeviceSynchronize());
  const char* env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("RESULT graph connections=%s mode=%s branches=%d rounds=%d probe=%s: %d STALLED%s, %d escaped to a fresh "
         "stream, agent moved %d times, streams made by this thread %d\n",
         env ? env : "(unset)", mode.c_str(), branches, rounds, probe ? "on" : "off", stalls, where.c_str(), escaped,
         moved, made + branches);
  return 0;
}

__global__ void spin_step(volatile unsigned long long* word, const volatile unsigned long long* base,
                          unsigned long long step, unsigned long long* gave_up) {
  const unsigned long long target = *base + step;
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*word < target) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 10000000000ull) {  // 10 s: the lab never hangs for good
      atomicAdd(gave_up, 1ull);
      return;
    }
    __nanosleep(500);
  }
}
// The hand-off without a host node: the step's number, this round's, into a word the agent polls.
__global__ void ring_step(unsigned long long* door, const volatile unsigned long long* base, unsigned long long step) {
  *(volatile unsigned long long*)door = *base + step;
  __threadfence_system();
}
__global__ void set_word(unsigned long long* w, unsigned long long v) {
  *(volatile unsigned long long*)w = v;
  __threadfence_system();
}
namespace chain {
struct Step {
  int branch;
  unsigned long long step;
};
std::mutex m;
std::condition_variable cv;
std::deque<Step> asked;
bool stop = false;
void CUDART_CB hand(void* p) {
  std::lock_guard<std::mutex> lock(m);
  asked.push_back(*static_cast<Step*>(p));
  cv.notify_one();
}
}  // namespace chain
static int chain_test(int branches, int steps, int rounds, const std::string& work) {
  init();
  // CHAIN_HOST=all (a host node before every step), first (before each branch's first step
  // only: the agent then releases all its steps at once, 20 ms later), none (no host node:
  // the agent releases every branch 20 ms after the launch call returned).
  const std::string host_nodes = getenv("CHAIN_HOST") ? getenv("CHAIN_HOST") : "all";
  unsigned long long *words = nullptr, *dwords = nullptr, *base = nullptr, *dbase = nullptr, *gave = nullptr;
  CR(cudaHostAlloc((void**)&words, 8 * branches, cudaHostAllocMapped));
  CR(cudaHostAlloc((void**)&base, 8, cudaHostAllocMapped));
  CR(cudaHostGetDevicePointer((void**)&dwords, words, 0));
  CR(cudaHostGetDevicePointer((void**)&dbase, base, 0));
  unsigned long long *doors = nullptr, *ddoors = nullptr;
  CR(cudaHostAlloc((void**)&doors, 8 * branches, cudaHostAllocMapped));
  CR(cudaHostGetDevicePointer((void**)&ddoors, doors, 0));
  for (int b = 0; b < branches; ++b) doors[b] = 0;
  CR(cudaMallocManaged((void**)&gave, 8));
  *gave = 0;
  for (int b = 0; b < branches; ++b) words[b] = 0;
  *base = 0;
  void *src = nullptr, *dst = nullptr;
  CR(cudaMalloc(&src, 4096));
  CR(cudaMalloc(&dst, 4096));
  set_word<<<1, 1>>>(dst == nullptr ? nullptr : (unsigned long long*)dst, 0);  // loaded before any graph runs
  spin_step<<<1, 1>>>(dwords, dbase, 0, gave);
  CR(cudaDeviceSynchronize());
  cudaStream_t agent;
  CR(cudaStreamCreateWithFlags(&agent, cudaStreamNonBlocking));
  void* pinned = nullptr;
  CR(cudaHostAlloc(&pinned, 4096, cudaHostAllocDefault));
  cudaEvent_t agent_event;
  CR(cudaEventCreateWithFlags(&agent_event, cudaEventDisableTiming));
  std::vector<cudaStream_t> streams(static_cast<size_t>(branches));
  for (auto& st : streams) CR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork;
  CR(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  std::vector<cudaEvent_t> joins(static_cast<size_t>(branches));
  for (auto& e : joins) CR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  std::vector<chain::Step> payload(static_cast<size_t>(branches * steps));
  cudaStream_t s = streams[0];
  CR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CR(cudaEventRecord(fork, s));
  for (int b = 1; b < branches; ++b) CR(cudaStreamWaitEvent(streams[b], fork, 0));
  for (int k = 0; k < steps; ++k)
    for (int b = 0; b < branches; ++b) {
      chain::Step& p = payload[static_cast<size_t>(b * steps + k)];
      p = chain::Step{b, static_cast<unsigned long long>(k + 1)};
      if (host_nodes == "all" || (host_nodes == "first" && k == 0)) CR(cudaLaunchHostFunc(streams[b], chain::hand, &p));
      if (host_nodes == "doorbell") ring_step<<<1, 1, 0, streams[b]>>>(ddoors + b, dbase, p.step);
      spin_step<<<1, 1, 0, streams[b]>>>(dwords + b, dbase, p.step, gave);
    }
  for (int b = 1; b < branches; ++b) {
    CR(cudaEventRecord(joins[b], streams[b]));
    CR(cudaStreamWaitEvent(s, joins[b], 0));
  }
  cudaGraph_t g = nullptr;
  CR(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t exec = nullptr;
  CR(cudaGraphInstantiate(&exec, g, 0));
  CR(cudaGraphDestroy(g));
  std::atomic<double> longest_call{0};
  std::thread agent_thread([&] {
    for (;;) {
      chain::Step st;
      if (host_nodes == "doorbell") {  // polls the doorbells (no host node, no CUDA call)
        static std::vector<unsigned long long> seen(static_cast<size_t>(branches), 0);
        bool found = false;
        while (!found) {
          {
            std::lock_guard<std::mutex> lock(chain::m);
            if (chain::stop) return;
          }
          for (int b = 0; b < branches && !found; ++b) {
            const unsigned long long d = *(volatile unsigned long long*)(doors + b);
            if (d > seen[static_cast<size_t>(b)]) {
              seen[static_cast<size_t>(b)] = d;
              st = chain::Step{b, d - *(volatile unsigned long long*)base};
              found = true;
            }
          }
          if (!found) std::this_thread::yield();
        }
      } else {
        std::unique_lock<std::mutex> lock(chain::m);
        chain::cv.wait(lock, [] { return chain::stop || !chain::asked.empty(); });
        if (chain::stop) return;
        st = chain::asked.front();
        chain::asked.pop_front();
      }
      unsigned long long v = *(volatile unsigned long long*)base + st.step;
      if (host_nodes == "first" || host_nodes == "none") {  // release the whole branch, a while after its hand-over
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        v = *(volatile unsigned long long*)base + static_cast<unsigned long long>(steps);
      }
      const double t0 = now();
      if (work == "host") {
        *(volatile unsigned long long*)(words + st.branch) = v;
      } else if (work == "kernel") {
        set_word<<<1, 1, 0, agent>>>(dwords + st.branch, v);
        CR(cudaGetLastError());
      } else {
        if (work == "copy") CR(cudaMemcpyAsync(dst, src, 4096, cudaMemcpyDeviceToDevice, agent));
        if (work == "d2h") CR(cudaMemcpyAsync(pinned, src, 4096, cudaMemcpyDeviceToHost, agent));
        if (work == "h2d") CR(cudaMemcpyAsync(dst, pinned, 4096, cudaMemcpyHostToDevice, agent));
        if (work == "event") {
          CR(cudaEventRecord(agent_event, agent));
          CR(cudaStreamWaitEvent(agent, agent_event, 0));
          (void)cudaEventQuery(agent_event);
        }
        CK(cuStreamWriteValue64((CUstream)agent, (CUdeviceptr)(dwords + st.branch), (cuuint64_t)v,
                                CU_STREAM_WRITE_VALUE_DEFAULT));
      }
      const double took = now() - t0;
      if (took > longest_call.load()) longest_call.store(took);
    }
  });
  double longest_launch = 0, longest_round = 0;
  int deadlocks = 0, stalls = 0;
  for (int round = 1; round <= rounds; ++round) {
    *(volatile unsigned long long*)base = static_cast<unsigned long long>(round) * 1000000ull;
    std::atomic<bool> launched{false};
    std::atomic<bool> released{false};
    std::thread watchdog([&] {
      const double w0 = now();
      while (!launched.load() && now() - w0 < 3.0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (launched.load()) return;
      released.store(true);  // still inside cudaGraphLaunch: release every step from the host
      for (int b = 0; b < branches; ++b) *(volatile unsigned long long*)(words + b) = ~0ull >> 1;
    });
    const double t0 = now();
    CR(cudaGraphLaunch(exec, s));
    const double took = now() - t0;
    launched.store(true);
    if (host_nodes == "none") {  // no hand-over: the agent is asked for every branch now
      std::lock_guard<std::mutex> lock(chain::m);
      for (int b = 0; b < branches; ++b) chain::asked.push_back(chain::Step{b, 1});
      chain::cv.notify_one();
    }
    watchdog.join();
    longest_launch = std::max(longest_launch, took);
    if (released.load()) ++deadlocks;
    if (!wait_query(s, 15.0)) {
      ++stalls;
      for (int b = 0; b < branches; ++b) *(volatile unsigned long long*)(words + b) = ~0ull >> 1;
      if (!wait_query(s, 15.0)) {
        printf("RESULT FAIL round %d: not done even after the host set the words\n", round);
        return 3;
      }
    }
    longest_round = std::max(longest_round, now() - t0);
    if (released.load()) {  // the words are far ahead now: start the next round past them
      CR(cudaStreamSynchronize(agent));
      for (int b = 0; b < branches; ++b) words[b] = 0;
    }
  }
  {
    std::lock_guard<std::mutex> lock(chain::m);
    chain::stop = true;
  }
  chain::cv.notify_one();
  agent_thread.join();
  CR(cudaDeviceSynchronize());
  const char* env = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("RESULT chain connections=%s host-nodes=%s branches=%d steps=%d rounds=%d work=%s: longest cudaGraphLaunch %.3f ms, "
         "longest round %.1f ms, agent's longest call %.3f ms, %d DEADLOCK (launch still inside after 3 s), %d "
         "stalled, %llu spins gave up\n",
         env ? env : "(unset)", host_nodes.c_str(), branches, steps, rounds, work.c_str(), longest_launch * 1e3, longest_round * 1e3,
         longest_call.load() * 1e3, deadlocks, stalls, *gave);
  return 0;
}

// Is an 8-byte pinned-to-pinned cudaMemcpyAsync stream-ordered (done by the GPU after the
// stream's earlier work), or done by the calling thread at once? Behind a 200 ms kernel.
static int order_test() {
  init();
  spin<<<1, 1>>>(nullptr, 0);
  CR(cudaDeviceSynchronize());
  cudaStream_t s;
  CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long* cells = nullptr;
  CR(cudaHostAlloc((void**)&cells, 64, cudaHostAllocMapped));
  unsigned long long* dcells = nullptr;
  CR(cudaHostGetDevicePointer((void**)&dcells, cells, 0));
  cells[0] = 0;  // the spin's release word
  cells[1] = 42;
  cells[2] = 0;
  spin<<<1, 1, 0, s>>>(dcells, 1);
  // Released after 3 s from another thread, in case the copy's call waits for the kernel.
  std::thread release([cells] {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    *(volatile unsigned long long*)cells = 1;
  });
  const double c0 = now();
  CR(cudaMemcpyAsync(cells + 2, cells + 1, 8, cudaMemcpyHostToHost, s));
  const double call_s = now() - c0;
  const volatile unsigned long long* out = cells + 2;
  const unsigned long long right_after = *out;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const unsigned long long while_held = *out;
  release.join();
  CR(cudaStreamSynchronize(s));
  const unsigned long long after = *out;
  printf("RESULT order h2h8 behind a kernel that waits 3 s: the call took %.3f s; the word right after the call %llu, "
         "200 ms later %llu, after the kernel %llu\n",
         call_s, right_after, while_held, after);
  return 0;
}
