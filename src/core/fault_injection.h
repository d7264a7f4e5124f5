// The fault-injection seam: LOOM_FAULT=<rank>:<iteration>:<fault> makes world rank <rank> fail at the start
// of <iteration>, so a test can check that the job ends instead of hanging. Faults: bad_alloc (a
// std::bad_alloc, as an allocation that failed), missing_file (a loom::Error from opening a file that does
// not exist), sigstop (the process stops: its peers wait in their next collective until the watchdog),
// stall (the host thread sleeps forever outside communication, as a rank stuck in compute or I/O would:
// its engine still answers the watchdog's roll call), diverge (the caller issues one collective the other
// ranks do not: a schedule that diverged). Without LOOM_FAULT it does nothing.
#pragma once

#include <cstdint>

namespace loom {

// Called by the trainer at the start of each iteration; true when the fault asks the caller to diverge.
bool inject_fault(int64_t iteration);

}  // namespace loom
