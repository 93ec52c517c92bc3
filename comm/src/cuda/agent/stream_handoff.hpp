// What the callers' side of every host-agent transport (staged; nccl and mpi-device through
// ProxyTransport) does first with a stream-ordered call: raise the failure its agent kept
// since the last call, and learn whether the stream is being captured (the call then goes to
// CapturedHandoff instead of lending a word and enqueueing a wait). And which windows such a
// transport reaches.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "transport.hpp"
#include "meshmem/error.hpp"
#include "meshmem/types.hpp"

namespace meshmem::detail {

// Raises, once, what `agent` (take_error(ErrorCode*)) kept since the last call; `where`
// begins the message.
template <class Agent>
void raise_kept_error(Agent& agent, const std::string& where) {
  ErrorCode code = ErrorCode::Cuda;
  const std::string error = agent.take_error(&code);
  if (!error.empty()) throw Error(code, where + ": an earlier transfer failed: " + error);
}

struct StreamCapture {
  bool active = false;
  cudaGraph_t graph = nullptr;  // the graph being captured, when active
};
// Whether `stream` is being captured now; `what` names the call in the error.
StreamCapture capture_of(cudaStream_t stream, const std::string& what);

// A host-agent transport reaches device windows of ranks it has a route to: `device` (the
// GPU part of this Comm) present, `no_route` "" (else why not).
Reach agent_reach(Memory memory, bool device, const std::string& no_route);

}  // namespace meshmem::detail
