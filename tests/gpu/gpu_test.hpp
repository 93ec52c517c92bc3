// Helpers shared by the GPU suites (CUDA headers: only the GPU tests include this).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

// Fails the test (and returns from it) when a CUDA runtime call does not succeed, with the
// call and CUDA's message.
#define CUDA_OK(call)                                                        \
  do {                                                                       \
    cudaError_t rc_ = (call);                                                \
    ASSERT_EQ(rc_, cudaSuccess) << #call << ": " << cudaGetErrorString(rc_); \
  } while (0)
