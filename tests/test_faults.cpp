// No rank hangs the job: a rank that fails in any way (an allocation that throws std::bad_alloc, a missing
// file, a process stopped by SIGSTOP) ends the whole `mpirun` job with a message naming the rank, within
// 30 s. The faults come from the trainer's LOOM_FAULT seam; the watchdog's timeout from
// LOOM_DISTRIBUTED_TIMEOUT_S (--distributed-timeout-minutes counts whole minutes). The watchdog's message
// names the rank that did not arrive: a stopped one does not answer its roll call, a stalled one (sleeping
// outside communication) answers that it has not posted the operation.
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <chrono>

namespace {

struct Fault {
    const char * name;
    const char * message;   // what the output must say
};

class RankFault : public ::testing::TestWithParam<Fault> {};

TEST_P(RankFault, EndsTheWholeJobWithinThirtySeconds) {
    const Fault & f     = GetParam();
    const auto    start = std::chrono::steady_clock::now();
    CliRun r = run_loom_mpi(2, "train --mock-data --train-iters 50 --lr-warmup-iters 1 --log-interval 1",
                            std::string("LOOM_DISTRIBUTED_TIMEOUT_S=2 LOOM_FAULT=1:3:") + f.name + " timeout 120");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.status, 0) << r.out;
    EXPECT_NE(r.status, 124) << "timeout(1) had to end it: the job hung\n" << r.out;
    EXPECT_LT(seconds, 30.0) << r.out;
    EXPECT_NE(r.out.find(f.message), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("iteration        4/"), std::string::npos) << "the job went on past the fault\n" << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, RankFault,
    ::testing::Values(Fault{"bad_alloc", "[rank 1] loom train: std::bad_alloc"},
                      Fault{"missing_file", "cannot read injected fault '/nonexistent/loom-fault-injection.bin'"},
                      Fault{"sigstop", "rank 1 did not answer within 1 s: it has stopped, crashed, or is blocked "
                                       "inside MPI"},
                      Fault{"stall", "rank 1 has not arrived: it has posted"}),
    [](const ::testing::TestParamInfo<Fault> & info) { return std::string(info.param.name); });

}  // namespace
