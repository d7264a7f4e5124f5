// Pipeline-parallel schedules as pure functions: which schedule runs, how many forwards each rank runs
// before its first backward (the warm-up), the interleaved schedule table, the per-rank compute order
// and the number of microbatches each rank keeps in flight. The executor, graph capture, `loom
// schedule` and the tests all compute them here (docs/design/schedules_and_graphs.md section 1; the section
// numbers below refer to that document).
//
// Symbols: PP pipeline size, r this rank's stage (0 = first), V virtual stages (model chunks) per rank,
// M microbatches per iteration, N microbatch group size, W warm-up forwards, k step of the schedule.
//
// Which schedule (section 1.1):
//   PP == 1               no pipelining: F(m) B(m) for every m, W = 0
//   PP > 1, V unset       1F1B (non-interleaved), one model chunk
//   PP > 1, V set         interleaved 1F1B with V chunks; an explicit V = 1 runs the interleaved code path
//                         too (W = 2(PP - r - 1), the interleaved validation), unlike V unset
//
// Warm-up forwards (Megatron's get_pp_rank_microbatches, sections 1.3, 1.4):
//   forward-only          W = M * V                        (all microbatches "in warm-up")
//   PP == 1               W = 0
//   1F1B                  W = min(PP - r - 1, M)
//   interleaved           W = min(2 (PP - r - 1) + (V - 1) N, M * V)
//
// Schedule table (get_schedule_table, section 1.4): microbatches cut into groups of N consecutive ids (the
// last group takes the remainder); for each group, for each chunk c = 0..V-1, for each m of the group:
// (m, c). M * V entries; every rank sees the same table. Non-interleaved schedules use V = 1.
//
// Order (convert_schedule_table_to_order, section 1.6): signed 1-based chunk ids, +c = forward of chunk
// c - 1, -c = backward of chunk c - 1. With fwd[k] = table[k].c + 1 and bwd[k] = table[k].c - V (the
// backward at step k runs the mirrored chunk V - 1 - table[k].c):
//   order = fwd[0:W], then (fwd[k], bwd[k - W]) for k = W..M*V-1, then bwd[M*V - W:]
// 1F1B is the same with V = 1: [+1]*W + [+1, -1]*(M - W) + [-1]*W. Forward-only orders hold the M * V
// forwards and no backward. The microbatch of each entry is per-chunk FIFO: the i-th +c (or -c) of an
// order is microbatch i of chunk c - 1.
//
// Validation of the interleaved schedule (Megatron's schedules.py, section 1.4): PP <= N <= M, and M mod N
// must be 0 or >= PP (a last group smaller than PP leaves dependency bubbles). Virtual stages need PP > 1.
//
// Peak in flight (sections 1.3, 1.4 and 6.5): the most chunk-microbatches whose forward is done and backward not,
// i.e. the activation contexts a rank keeps: min(PP - r, M) for 1F1B, 1 without pipelining, and
// min(2 (PP - r - 1) + (V - 1) N + 1, M * V) interleaved. Forward-only keeps no context past its forward.
//
// Worked example (Megatron's docstring, section 1.4): PP 2, N 3, M 5, V 2, rank 0.
//   table  k 0..9: m 0 1 2 0 1 2 3 4 3 4, c 0 0 0 1 1 1 0 0 1 1
//   W = 2 (2 - 0 - 1) + (2 - 1) 3 = 5
//   order  1 1 1 2 2 | 2 -2 1 -2 1 -2 2 -1 2 -1 | -1 -2 -2 -1 -1       peak in flight 6
//   ops    F0.0 F0.1 F0.2 F1.0 F1.1 | F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1 | B0.2 B1.3 ...
// (Fc.m / Bc.m: forward / backward of local chunk c, microbatch m, both 0-based.)
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace loom::pipeline {

enum class ScheduleKind { no_pipelining, one_f_one_b, interleaved };
const char * schedule_kind_name(ScheduleKind kind);   // "no pipelining", "1F1B", "interleaved 1F1B"

struct ScheduleOptions {
    int                pp               = 1;   // --pipeline-model-parallel-size
    std::optional<int> vpp;                    // --num-virtual-stages-per-pipeline-rank (unset: no interleaving)
    int                num_microbatches = 1;   // M = --global-batch-size / (--micro-batch-size x dp)
    std::optional<int> microbatch_group_size;  // N, --microbatch-group-size-per-virtual-pipeline-stage (default PP)
    bool               forward_only     = false;
};

// Throws loom::Error naming the flags at fault and the valid values.
void validate_schedule(const ScheduleOptions & options);

ScheduleKind schedule_kind(const ScheduleOptions & options);
int          num_model_chunks(const ScheduleOptions & options);        // V, 1 when unset
int          microbatch_group_size(const ScheduleOptions & options);   // N, PP when unset

// All of the following validate `options` and `rank` (0 <= rank < PP) first.
int num_warmup_microbatches(const ScheduleOptions & options, int rank);

struct ScheduleEntry {
    int microbatch;   // 0-based
    int chunk;        // 0-based local model chunk
};
bool operator==(const ScheduleEntry & a, const ScheduleEntry & b);

// The schedule table for M microbatches, V chunks and group size N (>= 1); M * V entries.
std::vector<ScheduleEntry> schedule_table(int num_microbatches, int num_chunks, int group_size);
// The table the options' schedule walks (V = 1 unless interleaved).
std::vector<ScheduleEntry> schedule_table(const ScheduleOptions & options);

// The reference's conversion: warm-up count, chunk count and table to the signed 1-based order.
std::vector<int> convert_schedule_table_to_order(int num_warmup, int num_chunks,
                                                 const std::vector<ScheduleEntry> & table);

// This rank's compute order, signed 1-based chunk ids (2 M V entries; M V when forward-only).
std::vector<int> schedule_order(const ScheduleOptions & options, int rank);

// One entry of an order resolved to its microbatch (per-chunk FIFO).
struct ScheduleOp {
    bool forward;
    int  chunk;        // 0-based
    int  microbatch;   // 0-based
};
bool operator==(const ScheduleOp & a, const ScheduleOp & b);
std::string op_label(const ScheduleOp & op);   // "F1.3": forward of chunk 1, microbatch 3

std::vector<ScheduleOp> order_ops(const std::vector<int> & order);
std::vector<ScheduleOp> schedule_ops(const ScheduleOptions & options, int rank);

// The peak number of chunk-microbatches in flight when a rank runs `order` (simulated); with
// forward_only every context is released when its forward ends.
int peak_in_flight(const std::vector<int> & order, bool forward_only = false);
int peak_in_flight(const ScheduleOptions & options, int rank);
// The closed form the simulation must equal (see the top of this file).
int expected_peak_in_flight(const ScheduleOptions & options, int rank);

}  // namespace loom::pipeline
