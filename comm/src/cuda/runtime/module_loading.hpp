// ModuleLoading: whether CUDA loads every kernel of the process when it starts (eager) or
// each module at the first launch of one of its kernels (lazy, CUDA's default), and why
// meshmem asks for eager loading when the program starts.
//
// Loading a module at a first launch waits for the GPU to be idle. The staged, nccl and
// mpi-device transfers are ended by threads of this process (the staging agent, the proxy),
// and a stream that waits for such a transfer keeps the GPU busy: an application kernel
// launched for the first time meanwhile waits for the transfer, and holds the driver calls
// that would end it, until MESHMEM_TIMEOUT. On 1 x H100 with lazy loading all three routes
// took the full 10 s and a timeout error (RealUse.AKernelFirstLaunchedWhileATransferIsInFlight
// DoesNotStallIt); ipc passed (its copy kernels were queued before the launch), and so did
// staged with eager loading. meshmem preloads its own kernels (kernels.hpp); the
// application's it cannot name.
//
// So at static initialisation this sets CUDA_MODULE_LOADING=EAGER, with the rules of
// startup_env.hpp (not where the user set it, MESHMEM_MODULE_LOADING=keep, or other threads
// already run), in every program linked with meshmem (and the processes it starts inherit
// it). CUDA reads it when it starts: where CUDA started before meshmem was loaded the
// request comes too late. Code loaded later (a library opened with dlopen, cuModuleLoad,
// cuLibraryLoad) is loaded when it is opened. The price is the GPU memory and start-up time
// of every module's code in the process (README, MESHMEM_MODULE_LOADING).
//
// CUDA-free: the mode CUDA reports is given by the device runtime (note_module_loading).
#pragma once

#include <string>

namespace meshmem::detail {

struct ModuleLoadingRequest {
  bool eager;           // CUDA_MODULE_LOADING is EAGER as meshmem left it at load
  bool set_by_meshmem;  // meshmem set it
  const char* how;      // "requested by meshmem at load", "the user's", ... (a literal)
  char users[48];       // the user's value (truncated), else ""
};
const ModuleLoadingRequest& module_loading_request();

// The mode CUDA reports once it has started (cuModuleGetLoadingMode; Unknown where that call
// failed): remembered for the description, hints and warnings below.
enum class LoadingMode { Eager, Lazy, Unknown };
void note_module_loading(LoadingMode mode);

// "module loading eager (CUDA_MODULE_LOADING, requested by meshmem at load)"; "lazy" where
// CUDA loads lazily, with why ("the user's 'LAZY'", "..., too late: CUDA had started").
std::string describe_module_loading();

// Where `rank` reaches `route` ("rank 3 through staged") through a transport whose transfers
// are ended by threads of this process and CUDA loads lazily: the warning to log; else "".
std::string lazy_loading_warning(int rank, const std::string& route);

// For the message of a transfer on meshmem's own streams that did not end: where CUDA loads
// lazily, "; module loading lazy (...): an application kernel launched for the first time
// ... may have held it"; else "".
std::string lazy_loading_hint();

}  // namespace meshmem::detail
