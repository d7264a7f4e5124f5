// The fault-injection seam: LOOM_FAULT=<rank>:<iteration>:<fault> makes world rank <rank> fail at the start
// of <iteration>, so a test can check that the job ends instead of hanging. Faults: bad_alloc (a
// std::bad_alloc, as an allocation that failed), missing_file (a loom::Error from opening a file that does
// not exist), sigstop (the process stops: its peers wait in their next collective until the watchdog),
// stall (the host thread sleeps forever outside communication, as a rank stuck in compute or I/O would:
// its engine still answers the watchdog's roll call), diverge (the caller issues one collective the other
// ranks do not: a schedule that diverged), diverge_op (the caller's next all-reduce uses another reduction:
// a divergence that completes, found by the running check of comm/agreement.h), perturb_param (the caller
// adds 1 to the first element of its first parameter: a replica whose weights drifted), diverge_send (the
// caller sends one transfer on a pipeline channel it sends on, which its peer never receives: a pipeline
// schedule that diverged, found by the running check of the transfers; over MPI, whose small sends complete
// unreceived). Without LOOM_FAULT it does nothing.
#pragma once

#include <cstdint>

namespace loom {

// What the caller does for the fault (the faults that need a communicator).
enum class FaultAction { none, extra_collective, other_reduction, perturb_param, extra_transfer };

// Called by the trainer at the start of each iteration.
FaultAction inject_fault(int64_t iteration);

}  // namespace loom
