#include "pipeline/timeline.h"

#include "core/atomic_file.h"

#include "core/error.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <unistd.h>

namespace loom::pipeline {

std::string svg_number(double x) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.2f", x);
    std::string s = buffer;
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
    return s == "-0" ? "0" : s;
}

namespace {

std::string number(double x) { return svg_number(x); }

std::string percent(double fraction) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%.1f%%", 100.0 * fraction);
    return buffer;
}

// "interleaved 1F1B: PP=4, VPP=2, M=8, N=4"
std::string schedule_title(const ScheduleOptions & o) {
    std::ostringstream os;
    os << schedule_kind_name(schedule_kind(o)) << (o.forward_only ? " (forward only)" : "") << ": PP=" << o.pp;
    os << ", VPP=" << (o.vpp ? std::to_string(*o.vpp) : std::string("none")) << ", M=" << o.num_microbatches;
    if (schedule_kind(o) == ScheduleKind::interleaved) {
        os << ", N=" << microbatch_group_size(o);
    }
    return os.str();
}

std::string durations(const Timeline & t) {
    if (!t.unit_time) return "measured durations";
    return "unit time (forward " + number(t.forward_time) + ", backward " + number(t.backward_time) + ")";
}

// Colours per chunk: {forward, backward (darker), text on forward, text on backward}.
struct ChunkColours {
    const char * forward;
    const char * backward;
};
constexpr ChunkColours kColours[] = {
    {"#9ecae1", "#2b6ca3"},   // blue
    {"#fdae6b", "#c4510b"},   // orange
    {"#a1d99b", "#2f8a48"},   // green
    {"#bcbddc", "#5e519a"},   // purple
    {"#fcbba1", "#b8281f"},   // red
    {"#99d8c9", "#1f7a6a"},   // teal
    {"#fee391", "#9a6a00"},   // yellow
    {"#d9d9d9", "#555555"},   // grey
};
constexpr int kNumColours = sizeof(kColours) / sizeof(kColours[0]);

const ChunkColours & colours(int chunk) { return kColours[chunk % kNumColours]; }

// A tick step of 1, 2 or 5 times a power of ten that puts ticks at least min_px apart.
double tick_step(double unit_px, double min_px) {
    for (double scale = 1.0;; scale *= 10.0) {
        for (double step : {1.0, 2.0, 5.0}) {
            if (step * scale * unit_px >= min_px) return step * scale;
        }
    }
}

}  // namespace

double Timeline::total_time() const {
    double end = 0.0;
    for (const auto & rank : ranks) {
        for (const TimelineOp & op : rank) end = std::max(end, op.end);
    }
    return end;
}

double Timeline::busy_time() const {
    double busy = 0.0;
    for (const auto & rank : ranks) {
        for (const TimelineOp & op : rank) busy += op.end - op.start;
    }
    return busy;
}

double Timeline::bubble_fraction() const {
    const double total = total_time();
    if (total <= 0.0 || ranks.empty()) return 0.0;
    return 1.0 - busy_time() / (static_cast<double>(ranks.size()) * total);
}

Timeline simulate_timeline(const ScheduleOptions & o, double forward_time, double backward_time) {
    LOOM_CHECK(forward_time > 0.0 && backward_time > 0.0,
               "op durations must be positive, got forward " << forward_time << ", backward " << backward_time, "");
    Timeline t = simulate_timeline(o, [&](int, size_t, const ScheduleOp & op) { return op.forward ? forward_time : backward_time; });
    t.unit_time     = true;
    t.forward_time  = forward_time;
    t.backward_time = backward_time;
    return t;
}

Timeline simulate_timeline(const ScheduleOptions & o, const OpDuration & duration, double transfer_time) {
    validate_schedule(o);
    const int pp     = o.pp;
    const int m      = o.num_microbatches;
    const int stages = pp * num_model_chunks(o);

    Timeline t;
    t.options   = o;
    t.unit_time = false;
    std::vector<std::vector<ScheduleOp>> ops(pp);
    size_t                               num_ops = 0;
    for (int r = 0; r < pp; ++r) {
        ops[r] = schedule_ops(o, r);
        num_ops += ops[r].size();
        t.ranks.emplace_back();
        t.ranks.back().reserve(ops[r].size());
    }

    // End times of F(s, m) and B(s, m); negative: not run yet.
    std::vector<double> forward_end(static_cast<size_t>(stages) * m, -1.0);
    std::vector<double> backward_end(static_cast<size_t>(stages) * m, -1.0);
    std::vector<double> rank_free(pp, 0.0);
    std::vector<size_t> next(pp, 0);

    for (size_t done = 0; done < num_ops;) {
        bool progress = false;
        for (int r = 0; r < pp; ++r) {
            for (; next[r] < ops[r].size(); ++next[r]) {
                const ScheduleOp & op    = ops[r][next[r]];
                const int          s     = op.chunk * pp + r;
                const size_t       index = static_cast<size_t>(s) * m + op.microbatch;
                double             ready = rank_free[r];
                if (op.forward) {
                    if (s > 0) {
                        const double input = forward_end[index - m];
                        if (input < 0.0) break;
                        ready = std::max(ready, input + (pp > 1 ? transfer_time : 0.0));
                    }
                } else {
                    const double own = forward_end[index];
                    if (own < 0.0) break;
                    ready = std::max(ready, own);
                    if (s + 1 < stages) {
                        const double grad = backward_end[index + m];
                        if (grad < 0.0) break;
                        ready = std::max(ready, grad + (pp > 1 ? transfer_time : 0.0));
                    }
                }
                const double end = ready + duration(r, next[r], op);
                (op.forward ? forward_end : backward_end)[index] = end;
                rank_free[r] = end;
                t.ranks[r].push_back({op, ready, end});
                ++done;
                progress = true;
            }
        }
        if (!progress) {
            std::ostringstream waiting;
            for (int r = 0; r < pp; ++r) {
                if (next[r] < ops[r].size()) waiting << " rank " << r << " at " << op_label(ops[r][next[r]]) << ";";
            }
            LOOM_THROW("the pipeline orders deadlock for " << schedule_title(o) << ":" << waiting.str(),
                       "this is a bug in the schedule; please report the configuration");
        }
    }
    return t;
}

std::string timeline_text(const Timeline & t) {
    const ScheduleOptions & o = t.options;
    std::ostringstream      os;
    os << schedule_title(o) << "\n";
    os << durations(t) << ": total " << number(t.total_time()) << ", bubble fraction "
       << percent(t.bubble_fraction()) << "\n";
    // Columns padded to the widest rank: "rank 0  W 10  peak 11 |", "rank 3  W  4  peak  5 |".
    const int           pp = static_cast<int>(t.ranks.size());
    std::vector<int>    warmup(pp), peak(pp);
    size_t              rank_width = std::to_string(pp - 1).size(), warmup_width = 1, peak_width = 1;
    for (int r = 0; r < pp; ++r) {
        warmup[r]    = num_warmup_microbatches(o, r);
        peak[r]      = peak_in_flight(o, r);
        warmup_width = std::max(warmup_width, std::to_string(warmup[r]).size());
        peak_width   = std::max(peak_width, std::to_string(peak[r]).size());
    }
    auto padded = [](int x, size_t width) {
        std::string s = std::to_string(x);
        return std::string(width - std::min(width, s.size()), ' ') + s;
    };
    for (int r = 0; r < pp; ++r) {
        os << "rank " << padded(r, rank_width) << "  W " << padded(warmup[r], warmup_width) << "  peak "
           << padded(peak[r], peak_width) << " |";
        for (const TimelineOp & op : t.ranks[r]) os << " " << op_label(op.op);
        os << "\n";
    }
    return os.str();
}

std::string timeline_svg(const Timeline & t) {
    const ScheduleOptions & o      = t.options;
    const double            total  = std::max(t.total_time(), 1e-9);
    const double            unit   = std::clamp(1400.0 / total, 30.0, 44.0);   // px per time unit
    const double            left   = 70.0, right = 20.0, top = 62.0;
    const double            row_h  = 30.0, row_gap = 8.0;
    const int               pp     = static_cast<int>(t.ranks.size());
    const int               chunks = num_model_chunks(o);
    const double            rows_bottom = top + pp * (row_h + row_gap) - row_gap;
    const double            axis_y      = rows_bottom + 8.0;
    const double            legend_y    = axis_y + 40.0;
    const double            width       = left + total * unit + right;
    const double            height      = legend_y + 22.0 * (chunks + 2);

    std::ostringstream os;
    os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << number(width) << "\" height=\"" << number(height)
       << "\" viewBox=\"0 0 " << number(width) << " " << number(height)
       << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" style=\"background:#ffffff\">\n";
    os << "<text x=\"" << number(left) << "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">Pipeline schedule, "
       << schedule_title(o) << "</text>\n";
    os << "<text x=\"" << number(left) << "\" y=\"46\" font-size=\"13\">total time " << number(t.total_time())
       << (t.unit_time ? " units" : "") << ", bubble fraction " << percent(t.bubble_fraction()) << "; "
       << durations(t) << "</text>\n";

    // Time axis: a baseline and ticks, light grid lines behind the rows.
    const double step = tick_step(unit, 40.0);
    os << "<g stroke=\"#dddddd\" stroke-width=\"1\">\n";
    for (double x = 0.0; x <= total + 1e-9; x += step) {
        os << "<line x1=\"" << number(left + x * unit) << "\" y1=\"" << number(top - 4.0) << "\" x2=\""
           << number(left + x * unit) << "\" y2=\"" << number(axis_y) << "\"/>\n";
    }
    os << "</g>\n";
    os << "<line x1=\"" << number(left) << "\" y1=\"" << number(axis_y) << "\" x2=\"" << number(left + total * unit)
       << "\" y2=\"" << number(axis_y) << "\" stroke=\"#333333\" stroke-width=\"1\"/>\n";
    os << "<g font-size=\"11\" text-anchor=\"middle\" fill=\"#333333\">\n";
    for (double x = 0.0; x <= total + 1e-9; x += step) {
        os << "<text x=\"" << number(left + x * unit) << "\" y=\"" << number(axis_y + 16.0) << "\">" << number(x)
           << "</text>\n";
    }
    os << "<text x=\"" << number(left + total * unit / 2.0) << "\" y=\"" << number(axis_y + 32.0) << "\">time"
       << (t.unit_time ? " (units)" : "") << "</text>\n";
    os << "</g>\n";

    // One row per rank: the label, then one box per op.
    for (int r = 0; r < pp; ++r) {
        const double y = top + r * (row_h + row_gap);
        os << "<text x=\"" << number(left - 10.0) << "\" y=\"" << number(y + row_h / 2.0)
           << "\" font-size=\"13\" text-anchor=\"end\" dominant-baseline=\"central\">rank " << r << "</text>\n";
        for (const TimelineOp & op : t.ranks[r]) {
            const ChunkColours & c     = colours(op.op.chunk);
            const double         x     = left + op.start * unit;
            const double         w     = (op.end - op.start) * unit;
            const std::string    label = op_label(op.op);
            const double font = std::min(12.0, 0.9 * w / (0.62 * static_cast<double>(label.size())));
            os << "<rect x=\"" << number(x) << "\" y=\"" << number(y) << "\" width=\"" << number(w) << "\" height=\""
               << number(row_h) << "\" fill=\"" << (op.op.forward ? c.forward : c.backward)
               << "\" stroke=\"#333333\" stroke-width=\"0.6\"><title>rank " << r << " " << label << " ["
               << number(op.start) << ", " << number(op.end) << ")</title></rect>\n";
            os << "<text x=\"" << number(x + w / 2.0) << "\" y=\"" << number(y + row_h / 2.0) << "\" font-size=\""
               << number(font) << "\" text-anchor=\"middle\" dominant-baseline=\"central\" fill=\""
               << (op.op.forward ? "#111111" : "#ffffff") << "\">" << label << "</text>\n";
        }
    }

    // Legend: swatches are paths, so every <rect> of the document is an op.
    os << "<g font-size=\"12\">\n";
    double y = legend_y;
    for (int c = 0; c < chunks; ++c, y += 22.0) {
        os << "<path d=\"M" << number(left) << " " << number(y) << "h14v14h-14z\" fill=\"" << colours(c).forward
           << "\" stroke=\"#333333\" stroke-width=\"0.6\"/>\n";
        os << "<path d=\"M" << number(left + 18.0) << " " << number(y) << "h14v14h-14z\" fill=\""
           << colours(c).backward << "\" stroke=\"#333333\" stroke-width=\"0.6\"/>\n";
        os << "<text x=\"" << number(left + 40.0) << "\" y=\"" << number(y + 7.0)
           << "\" dominant-baseline=\"central\">model chunk " << c << " (order id " << c + 1
           << "): forward, backward (darker)</text>\n";
    }
    os << "<text x=\"" << number(left) << "\" y=\"" << number(y + 7.0) << "\" dominant-baseline=\"central\">"
       << "Fc.m / Bc.m: forward / backward of local model chunk c, microbatch m (0-based). ";
    if (t.unit_time) {
        os << "Unit time: a forward takes " << number(t.forward_time) << " unit, a backward " << number(t.backward_time)
           << " units (backward = 2 x forward, as is conventional); P2P is free.";
    } else {
        os << "Measured durations.";
    }
    os << "</text>\n";
    os << "<text x=\"" << number(left) << "\" y=\"" << number(y + 29.0) << "\" dominant-baseline=\"central\">"
       << "Each rank runs its order in sequence; an op starts once its input (previous stage's forward, next "
          "stage's backward) is done. Gaps are pipeline bubbles.</text>\n";
    os << "</g>\n";
    os << "</svg>\n";
    return os.str();
}

void write_file_atomically(const std::string & path, const std::string & text) {
    loom::write_file_atomically(path, std::string_view(text));
}

}  // namespace loom::pipeline
