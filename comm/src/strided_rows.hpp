// Where a strided copy's rows end: shared by the halo plan's checks and the nccl transport's
// target, which both take row shapes from other ranks. CUDA-free.
#pragma once

#include <cstdint>

namespace meshmem::detail {

// One past the last byte of `height` rows of `width` bytes, `pitch` apart, from `offset`
// (`offset` itself for no rows); false where that does not fit in 64 bits.
inline bool rows_end(std::uint64_t offset, std::uint64_t width, std::uint64_t height, std::uint64_t pitch,
                     std::uint64_t* end) {
  if (height == 0) {
    *end = offset;
    return true;
  }
  std::uint64_t apart = 0, last = 0;
  return !__builtin_mul_overflow(height - 1, pitch, &apart) && !__builtin_add_overflow(offset, apart, &last) &&
         !__builtin_add_overflow(last, width, end);
}

}  // namespace meshmem::detail
