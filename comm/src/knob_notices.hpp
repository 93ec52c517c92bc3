// The notices of reading MESHMEM_* (Options::notices: old names, variables that are no setting,
// settings this program does not use), gathered from every rank of a Comm and logged once per
// process by its rank 0, each naming the ranks it came from.
#pragma once

#include <string>
#include <vector>

#include "meshmem/config.hpp"

namespace meshmem::detail {

class Bootstrap;

// One line per distinct notice, in first-seen order, with "; on rank 1" / "; on ranks 0, 2" /
// "; on every rank" (by_rank: each rank's notices). MPI-free, for the unit tests.
std::vector<std::string> merge_notices(const std::vector<std::vector<std::string>>& by_rank);

// Collective over the Comm's ranks: rank 0 logs (warn) each merged line it has not logged
// before in this process. Nothing is sent where no rank has a notice but the lengths.
void report_knob_notices(Bootstrap& boot, const Options& options, const std::string& what);

}  // namespace meshmem::detail
