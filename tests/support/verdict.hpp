// The verdict harness of the process-death cases (main in verdict_main.cpp): a case that kills
// a rank or spoils a process cannot end the usual way (its survivors cannot meet the dead rank
// in a collective, nor in MPI_Finalize), so each surviving process ends itself with a line
//   [ verdict ] rank N PASSED|FAILED: Suite.Case
// and exit code 0 or 1. mpirun --enable-recovery exits 0 whatever its ranks return: the
// entry's pass and fail patterns read these lines (tests/gpu/entries.txt, column survivors).
#pragma once

namespace meshmem::test {

// Prints this rank's verdict of the running case and ends the process at once (std::_Exit).
[[noreturn]] void end_with_verdict(bool failed);

}  // namespace meshmem::test
