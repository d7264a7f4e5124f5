// Pipeline schedule options in one call, for the schedule tests (test_schedule, test_p2p_plan).
#pragma once

#include "pipeline/schedule.h"

#include <optional>

namespace loom::testing {

inline pipeline::ScheduleOptions schedule(int pp, std::optional<int> vpp, int m, std::optional<int> n = std::nullopt,
                                          bool forward_only = false) {
    pipeline::ScheduleOptions o;
    o.pp                    = pp;
    o.vpp                   = vpp;
    o.num_microbatches      = m;
    o.microbatch_group_size = n;
    o.forward_only          = forward_only;
    return o;
}

}  // namespace loom::testing
