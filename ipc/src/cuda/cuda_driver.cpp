#include "meshmem/ipc/cuda_driver.hpp"

#include <mutex>

#include "meshmem/error.hpp"

namespace meshmem::ipc {

namespace {

template <class Fn>
void resolve(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  // 12000: the ABI of each entry point as of CUDA 12.0, which every driver since provides.
  const cudaError_t rc = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
  if (rc != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr)
    throw Error(ErrorCode::Unsupported,
                std::string("CUDA driver entry point ") + symbol + " is unavailable: " +
                    (rc != cudaSuccess ? cudaGetErrorString(rc) : "not found in this driver"));
  fn = reinterpret_cast<Fn>(p);
}

// An entry point newer than 12.0, left null where the driver lacks it.
template <class Fn>
void resolve_if_there(Fn& fn, const char* symbol, int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &status) == cudaSuccess &&
      status == cudaDriverEntryPointSuccess)
    fn = reinterpret_cast<Fn>(p);
  (void)cudaGetLastError();
}

CudaDriver load() {
  CudaDriver d;
  resolve(d.cuGetErrorString, "cuGetErrorString");
  resolve(d.cuDeviceGet, "cuDeviceGet");
  resolve(d.cuDeviceGetAttribute, "cuDeviceGetAttribute");
  resolve(d.cuMemCreate, "cuMemCreate");
  resolve(d.cuMemRelease, "cuMemRelease");
  resolve(d.cuMemAddressReserve, "cuMemAddressReserve");
  resolve(d.cuMemAddressFree, "cuMemAddressFree");
  resolve(d.cuMemMap, "cuMemMap");
  resolve(d.cuMemUnmap, "cuMemUnmap");
  resolve(d.cuMemSetAccess, "cuMemSetAccess");
  resolve(d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  resolve(d.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  resolve(d.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  resolve(d.cuStreamWriteValue64, "cuStreamWriteValue64");
  resolve(d.cuStreamWaitValue64, "cuStreamWaitValue64");
  resolve(d.cuStreamBatchMemOp, "cuStreamBatchMemOp");
  resolve(d.cuStreamGetCtx, "cuStreamGetCtx");
  resolve(d.cuCtxGetCurrent, "cuCtxGetCurrent");
  resolve(d.cuCtxPushCurrent, "cuCtxPushCurrent");
  resolve(d.cuCtxPopCurrent, "cuCtxPopCurrent");
  resolve(d.cuCtxGetDevice, "cuCtxGetDevice");
  resolve(d.cuModuleGetLoadingMode, "cuModuleGetLoadingMode");
  resolve_if_there(d.cuCtxRecordEvent, "cuCtxRecordEvent", 12050);
  return d;
}

}  // namespace

const CudaDriver& cuda_driver() {
  static std::once_flag once;
  static CudaDriver driver;
  static std::string failure;
  std::call_once(once, [] {
    try {
      driver = load();
    } catch (const Error& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw Error(ErrorCode::Unsupported, failure);
  return driver;
}

void check_cu(CUresult rc, const char* call, const std::string& context) {
  if (rc == CUDA_SUCCESS) return;
  const char* text = nullptr;
  try {
    if (cuda_driver().cuGetErrorString(rc, &text) != CUDA_SUCCESS) text = nullptr;
  } catch (const Error&) {
    text = nullptr;
  }
  throw Error(ErrorCode::Cuda, context + ": " + call + " failed: " + (text ? text : "unknown error") +
                                   " (CUresult " + std::to_string(static_cast<int>(rc)) + ")");
}

void check_cuda(cudaError_t rc, const char* call, const std::string& context) {
  if (rc == cudaSuccess) return;
  throw Error(ErrorCode::Cuda, context + ": " + call + " failed: " + cudaGetErrorString(rc) + " (" +
                                   cudaGetErrorName(rc) + ")");
}

}  // namespace meshmem::ipc
