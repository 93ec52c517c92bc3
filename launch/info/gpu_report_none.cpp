// The GPU half of the node report where meshmem was built without CUDA.
#include "node_report.hpp"

namespace meshmem::info {

void collect_gpu_facts(NodeReport* r, bool) {
  r->gpu_part = false;
  r->gpu_why = "meshmem-info was built without CUDA (no CUDA toolkit at build time)";
}

}  // namespace meshmem::info
