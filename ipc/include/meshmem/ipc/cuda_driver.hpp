// The CUDA driver API, reached through entry points that the runtime resolves at run time
// (cudaGetDriverEntryPointByVersion): meshmem never links libcuda, so its binaries start
// on machines without a GPU or driver and report that instead of failing to load.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

namespace meshmem::ipc {

struct CudaDriver {
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  PFN_cuStreamWriteValue64_v11070 cuStreamWriteValue64 = nullptr;
  PFN_cuStreamWaitValue64_v11070 cuStreamWaitValue64 = nullptr;
  PFN_cuStreamBatchMemOp_v11070 cuStreamBatchMemOp = nullptr;
  // A stream's device, asked in a way that is legal while the stream captures a graph
  // (cuStreamGetDevice / cudaStreamGetDevice are not).
  PFN_cuStreamGetCtx_v9020 cuStreamGetCtx = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuCtxPushCurrent_v4000 cuCtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 cuCtxPopCurrent = nullptr;
  PFN_cuCtxGetDevice_v2000 cuCtxGetDevice = nullptr;
  PFN_cuModuleGetLoadingMode_v11070 cuModuleGetLoadingMode = nullptr;
  // Null with a driver before CUDA 12.5 (callers fall back).
  PFN_cuCtxRecordEvent_v12050 cuCtxRecordEvent = nullptr;
};

// Loads the entry points once. Raises Error(Unsupported) where there is no driver.
const CudaDriver& cuda_driver();

// Raise Error(Cuda) naming the call, the context and the driver's / runtime's message.
void check_cu(CUresult rc, const char* call, const std::string& context);
void check_cuda(cudaError_t rc, const char* call, const std::string& context);

}  // namespace meshmem::ipc
