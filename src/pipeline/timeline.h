// The pipeline timeline: when each rank runs each op of its order, and how it is drawn.
//
// simulate_timeline() runs every rank's order (schedule.h) against the others in unit time: a forward
// takes forward_time, a backward backward_time (1 and 2 by default, the usual assumption that a backward
// costs two forwards), P2P is free. Virtual stage s = c * PP + r is local chunk c of rank r, so the
// model's stages run 0, 1, ..., PP*V - 1 and the last rank's chunk c feeds rank 0's chunk c + 1. An op
// starts when its rank has finished the previous op of its order and its inputs exist:
//   F(s, m)  after F(s - 1, m)                                 (stage 0: no input)
//   B(s, m)  after B(s + 1, m) and after F(s, m)               (last stage: after its own forward)
// The start times are the earliest ones these rules allow (a longest path), so the gaps are the
// schedule's bubbles. A cycle would be a deadlock of the orders; the simulation throws if it finds one.
//
//   bubble fraction = 1 - (sum of busy time over ranks) / (PP x total time)
//
// The same Timeline can hold measured start and end times (a trainer's --timeline); the renderers only
// read the ops, times and sizes.
#pragma once

#include "pipeline/schedule.h"

#include <functional>
#include <string>
#include <vector>

namespace loom::pipeline {

struct TimelineOp {
    ScheduleOp op;
    double     start;
    double     end;
};

struct Timeline {
    ScheduleOptions                      options;
    std::vector<std::vector<TimelineOp>> ranks;         // [PP][ops in execution order]
    double                               forward_time  = 1.0;
    double                               backward_time = 2.0;
    bool                                 unit_time     = true;   // false: measured durations

    double total_time() const;        // the end of the last op
    double busy_time() const;         // summed over ranks
    double bubble_fraction() const;   // 1 - busy / (PP x total)
};

Timeline simulate_timeline(const ScheduleOptions & options, double forward_time = 1.0, double backward_time = 2.0);
// The same with each op's own duration: duration(rank, k, op) for the k-th op of rank's order (a planned or
// measured stage's), and `transfer_time` on every edge between two stages (an activation or a gradient
// crossing to the next rank; with one stage there is none).
using OpDuration = std::function<double(int rank, size_t k, const ScheduleOp & op)>;
Timeline simulate_timeline(const ScheduleOptions & options, const OpDuration & duration, double transfer_time = 0.0);

// One line per rank with its ops in order ("rank 0  W 10  peak 11 | F0.0 F0.1 ..."), after a header
// naming the schedule, the total time and the bubble fraction.
std::string timeline_text(const Timeline & timeline);

// A standalone SVG document (starts with "<svg"): one row per rank, one <rect> per op (no other rect),
// labelled "Fc.m" / "Bc.m", one colour per chunk with the backward a darker shade, gaps as bubbles,
// a title with PP / VPP / M, the total time and the bubble fraction, a time axis and a legend.
std::string timeline_svg(const Timeline & timeline);
// A coordinate or label for an SVG: "12", "12.5", "0.25" (at most two decimals, no trailing zeros).
std::string svg_number(double x);

// Writes `text` to `path` atomically: <path>.tmp.<pid>, flushed, then renamed over <path>.
void write_file_atomically(const std::string & path, const std::string & text);

}  // namespace loom::pipeline
