// main() of the tests that run under mpirun: GoogleTest on every rank, failures of ranks other than 0
// printed with their rank, and one exit status for the job (non-zero if any rank failed).
#pragma once

#include "backend/cpu/cpu_device.h"
#include "comm/mpi_communicator.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace loom::testing_mpi {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
public:
    explicit RankFailurePrinter(int rank) : rank_(rank) {}
    void OnTestPartResult(const ::testing::TestPartResult & result) override {
        if (result.failed()) {
            std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                         result.line_number(), result.summary());
        }
    }

private:
    int rank_;
};

// Initialises MPI, points *context at it while the tests run, and returns the job's exit status.
inline int run_all_tests_under_mpi(int argc, char ** argv, comm::MpiContext ** context) {
    ::testing::InitGoogleTest(&argc, argv);
    comm::MpiContext mpi;
    *context = &mpi;
    if (mpi.world_rank() != 0) {
        auto & listeners = ::testing::UnitTest::GetInstance()->listeners();
        delete listeners.Release(listeners.default_result_printer());
        listeners.Append(new RankFailurePrinter(mpi.world_rank()));
    }
    int    failed = RUN_ALL_TESTS() != 0;
    Tensor flag   = Tensor::zeros({1}, DType::i32, cpu::device());
    flag.data<int32_t>()[0] = failed;
    mpi.world()->all_reduce(flag, comm::ReduceOp::max)->wait();
    if (mpi.world_rank() == 0 && flag.data<int32_t>()[0] != 0) {
        std::fprintf(stderr, "some rank failed (see the [rank N] lines above)\n");
    }
    *context = nullptr;
    return flag.data<int32_t>()[0];
}

}  // namespace loom::testing_mpi
