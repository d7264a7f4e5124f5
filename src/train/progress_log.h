// --log-progress: Megatron's DIR/progress.txt in the --save folder, one line per event, appended by rank 0:
//
//   2026-11-27 14:30:00\tJob ID: <SLURM_JOB_ID>\t# GPUs: <world>\tStarting job
//   ...\tSaved checkpoint\tIteration: 10\tJob throughput: 1.2 TFLOP/s/GPU\tCumulative throughput: 1.1 TFLOP/s/GPU\t
//        Floating-point operations: 3.10e+13\tTokens (in billions): 0.00
//   ...\tDeleted checkpoint\tIteration: 5                    (--save-retain-interval)
//
// With --async-save the save line says "Saving async checkpoint" and is written when the save begins, as
// Megatron's. Job throughput counts this job's operations over its time; cumulative throughput counts from
// the first "Starting job" of the latest run of jobs with this world size (and the operations saved before
// it), read back from the file.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace loom::train {

// Appends "<time>\tJob ID: ...\t# GPUs: <world>\t<message>" to <save>/progress.txt (creating it); throws
// naming the file when it cannot be written.
void append_progress(const std::string & save, int world, const std::string & message);

// The save line's message: `flops` the training operations so far (every job of the run), `job_flops` and
// `job_seconds` this job's.
std::string saved_checkpoint_message(const std::string & save, int world, int64_t iteration, double flops,
                                     double job_flops, double job_seconds, double tokens, bool async);

}  // namespace loom::train
