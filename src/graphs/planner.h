// The per-layer CUDA-graph plan of one pipeline rank, as a pure function: which graphs exist, the order
// in which they are captured and replayed, which static input set each forward graph reads, which
// grad-output buffer each backward graph reads, and how long each pool tensor lives
// (docs/design/schedules_and_graphs.md sections 2.3, 6.1-6.3, 6.5; the section numbers below refer to that document).
// Nothing here touches a device: the capture code allocates what the plan says, `loom schedule --graph-plan` prints it,
// the tests check it against the golden tables of section 6.5.
//
// Symbols: PP pipeline size, r this rank, V model chunks per rank, M microbatches, N microbatch group
// size, L_c graphed layers of local chunk c, prefix(c) = L_0 + ... + L_{c-1}, W warm-up forwards.
//
// Inputs: the schedule (PP, V, M, N: pipeline::ScheduleOptions, training only), r, L_c per chunk (may
// differ between chunks, may be 0), and per layer an input signature (the names, shapes and dtypes of its
// static inputs) and an output signature (its outputs that need a gradient), as opaque strings; layers
// with equal strings can share buffers. By default every layer has the signature "hidden".
//
// Captured microbatches: Mc = M when PP > 1, else 1. With PP = 1 the order is [+1, -1] of one
// microbatch, and every microbatch m replays the graphs of m mod Mc = 0.
//
// Chunk-level order: pipeline::schedule_order() for (PP, V, Mc, N) and rank r, the very order the runtime
// executes (section 1.6): +c = forward of chunk c - 1, -c = backward of chunk c - 1, per-chunk FIFO
// microbatches.
//
// Timeline T (section 6.2): +c -> FWD(c, f[c]++, l) for l = 0..L_c-1; -c -> BWD(c, b[c]++, l) for
// l = L_c-1..0. Graphs are captured and replayed in T order; T has 2 Mc sum(L_c) steps.
//
// Graph ids (sections 2.3, 6.1): FWD(c, m, l) = prefix(c) Mc + m L_c + l, BWD(c, m, l) = the same + Mc sum(L_c).
//
// P1, static input sets (sections 2.3, 6.3): per input signature a FIFO free list of set ids. At FWD(c, m, l)
// pop the head of its signature's list, or create set id = number of sets so far (ids count over all
// signatures, in creation order). At the chunk-backward event B(c, m), i.e. when its first layer graph
// BWD(c, m, L_c - 1) is reached, push the L_c sets of F(c, m, .) to the back of their lists, l ascending.
// A set is never released earlier: BWD(c, m, l) reads X(c, m, l). Sets per signature = the peak number of
// its layer-forwards outstanding, L P_r for uniform L and one signature, independent of M.
// P2, grad-output buffers: one per output signature, shared by every BWD graph (ids in first-use order).
// P3, pool tensors, live over steps [first, last] of T, inclusive:
//   Y(c, m, l), Saved(c, m, l)   [FWD(c, m, l), BWD(c, m, l)]
//   dX(c, m, l), l > 0           [BWD(c, m, l), BWD(c, m, l - 1)]
//   dX(c, m, 0)                  [BWD(c, m, 0), the next chunk-backward's layer-0 graph (the last step of T
//                                 if none)]
// P_r (section 6.5): the peak number of chunk-microbatches whose forward is done and backward not,
// min(2 (PP - r - 1) + (V - 1) N + 1, M V) interleaved, min(PP - r, M) for 1F1B, 1 for PP = 1.
//
// Worked example: PP 2, no virtual stages (1F1B), M 3, rank 0, L_0 = 2; Mc = 3, W = 1, P_r = 2.
//   order  +1 +1 -1 +1 -1 -1
//   T      F0.0.0 F0.0.1 F0.1.0 F0.1.1 B0.0.1 B0.0.0 F0.2.0 F0.2.1 B0.1.1 B0.1.0 B0.2.1 B0.2.0
//   ids    0      1      2      3      7      6      4      5      9      8      11     10
//   sets   S0     S1     S2     S3     S1     S0     S0     S1     S3     S2     S1     S0
//   (Fc.m.l / Bc.m.l: chunk, microbatch, layer.) B0.0's event frees S0, S1 for F0.2: 4 sets = L P_r.
//   dX(0,0,1) lives over steps [4, 5]; dX(0,0,0) over [5, 9] (B0.1.0 is the next layer-0 graph).
// The golden example of section 6.5, L = 1, PP 4, V 2, M 8, rank 3 (order +1 +1 +1 +1 +2 -2 +2 -2 ...):
//   chunk 0, m 0..7 -> S0 S1 S2 S3 S4 S0 S1 S2;  chunk 1 -> S4 S4 S4 S4 S3 S3 S3 S3;  5 sets = P_3.
//
// validate_graph_plan() asserts what a plan promises (section 6.3) and throws loom::Error otherwise: every
// graph exactly once with its formula id; every BWD after its FWD and each chunk-backward contiguous in
// descending layers; no set handed out while owned and every BWD reads the set of its FWD; no more sets
// than the peak outstanding layer-forwards of their signature; dX(c, m, l > 0) consumed by
// BWD(c, m, l - 1); every interval as above; the counts. plan_graphs() runs it on every plan it returns.
#pragma once

#include "pipeline/schedule.h"

#include <string>
#include <vector>

namespace loom::graphs {

constexpr const char * kDefaultSignature = "hidden";

struct GraphPlanOptions {
    pipeline::ScheduleOptions              schedule;            // PP, V, M, N; forward_only is refused
    int                                    rank = 0;            // r, 0 <= r < PP
    std::vector<int>                       layers_per_chunk;    // L_c, V entries; empty: 1 layer per chunk
    std::vector<std::vector<std::string>>  input_signatures;    // [V][L_c]; empty: all kDefaultSignature
    std::vector<std::vector<std::string>>  output_signatures;   // [V][L_c]; empty: all kDefaultSignature
};

enum class GraphKind { forward, backward };
const char * graph_kind_name(GraphKind kind);   // "FWD", "BWD"

// One step of T: the graph captured (and later replayed) at this position.
struct GraphStep {
    GraphKind kind;
    int       chunk;                // c, 0-based
    int       microbatch;           // m < Mc
    int       layer;                // l < L_c
    int       graph_id;
    int       input_set;            // the P1 set holding X(c, m, l): read by FWD, still owned at BWD
    int       grad_output_buffer;   // BWD: the P2 buffer of its output signature; FWD: -1
};
std::string step_label(const GraphStep & step);   // "F1.3.0": FWD of chunk 1, microbatch 3, layer 0

enum class PoolTensor { output, saved, grad_input };   // Y, Saved, dX
const char * pool_tensor_name(PoolTensor tensor);      // "Y", "Saved", "dX"

struct PoolInterval {
    PoolTensor tensor;
    int        chunk, microbatch, layer;
    int        first, last;   // steps of T, inclusive
};

struct GraphPlan {
    pipeline::ScheduleOptions              schedule;                 // as given (M, not Mc)
    int                                    rank = 0;
    int                                    num_chunks = 0;           // V (1 unless interleaved)
    int                                    captured_microbatches = 0;   // Mc
    int                                    num_warmup = 0;           // W of the captured order
    std::vector<int>                       layers_per_chunk;         // L_c
    std::vector<std::vector<std::string>>  input_signatures;         // [V][L_c]
    std::vector<std::vector<std::string>>  output_signatures;        // [V][L_c]
    std::vector<int>                       order;                    // chunk-level order for Mc microbatches
    std::vector<GraphStep>                 timeline;                 // T
    std::vector<std::vector<std::vector<int>>> input_sets;           // [V][Mc][L_c] -> P1 set id
    std::vector<std::string>               set_signatures;           // [P1 set id] -> input signature
    std::vector<std::string>               grad_output_signatures;   // [P2 buffer id] -> output signature
    std::vector<PoolInterval>              pool_intervals;           // Y, Saved per (c, m, l) in T order, then dX

    // Counts.
    int num_graphs          = 0;   // 2 Mc sum(L_c)
    int peak_in_flight      = 0;   // P_r, chunk-microbatches
    int peak_layer_forwards = 0;   // layer-forwards outstanding at once (L P_r for uniform L)
    int peak_live_outputs   = 0;   // the most Y intervals live at one step (= peak_layer_forwards)
    int peak_live_saved     = 0;   // the same for Saved
    int peak_live_grad_inputs = 0; // the same for dX (<= 3, <= 2 when every L_c = 1)

    int num_input_sets() const { return static_cast<int>(set_signatures.size()); }
    int num_grad_output_buffers() const { return static_cast<int>(grad_output_signatures.size()); }
    int total_layers() const;   // sum(L_c)
    int layer_prefix(int chunk) const;   // prefix(c)
};

// The plan of one rank; validates the options (loom::Error naming the flag at fault) and the plan.
GraphPlan plan_graphs(const GraphPlanOptions & options);

// Throws loom::Error naming the first broken promise (see the top of this file).
void validate_graph_plan(const GraphPlan & plan);

// The graph that microbatch m (any m < M) replays for layer l of chunk c: the id of (c, m mod Mc, l).
int graph_id(const GraphPlan & plan, GraphKind kind, int chunk, int microbatch, int layer);

// A readable table: a header, one row per step of T (graph id, set, grad-output buffer, the pool tensors
// released after the step), then the counts.
std::string graph_plan_text(const GraphPlan & plan);

}  // namespace loom::graphs
