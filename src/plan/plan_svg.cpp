#include "plan/plan_svg.h"

#include "core/error.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace loom::plan {

namespace {

std::string number(double x) { return pipeline::svg_number(x); }

std::string mib(int64_t bytes) {
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
    return buffer;
}

// A pool's fill colour; a pool without one of its own in grey.
const char * fill(const std::string & pool) {
    if (pool == "weights") return "#4e79a7";
    if (pool == "grads") return "#f28e2b";
    if (pool == "optimizer") return "#59a14f";
    if (pool == "activations") return "#e15759";
    if (pool == "comm") return "#76b7b2";
    if (pool == "graphs") return "#b07aa1";
    if (pool == "data") return "#9c755f";
    return "#bab0ac";
}

constexpr const char * kPeakFill = "#f4c7c7";   // the iteration's peak above what is held

}  // namespace

std::string plan_svg(const std::vector<RankMemory> & ranks, int64_t usable_bytes, const pipeline::Timeline * timeline) {
    LOOM_CHECK(!ranks.empty(), "a plan picture of no ranks", "");
    int64_t largest = 0;
    std::vector<std::string> pools;   // in the order first seen, for one legend
    for (const RankMemory & r : ranks) {
        largest = std::max(largest, r.device_peak_total());
        for (const auto & [pool, bytes] : r.device) {
            if (std::find(pools.begin(), pools.end(), pool) == pools.end()) pools.push_back(pool);
        }
    }
    // The usable memory is on the scale (a dashed line) when it is near the peaks; far above them, the bars
    // would be slivers, and it is only named.
    const bool usable_drawn = usable_bytes > 0 && usable_bytes <= largest + largest / 4;
    if (usable_drawn) largest = std::max(largest, usable_bytes);
    const double left = 80.0, right = 160.0, top = 62.0, bar_h = 22.0, gap = 6.0, scale_w = 900.0;
    const double px_per_byte = scale_w / static_cast<double>(std::max<int64_t>(largest, 1));
    const double bars_bottom = top + static_cast<double>(ranks.size()) * (bar_h + gap);
    const double legend_y    = bars_bottom + 24.0;
    const double memory_h    = legend_y + 22.0;
    const double width       = left + scale_w + right;

    std::ostringstream body;
    body << "<text x=\"" << number(left) << "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">Device memory per rank</text>\n";
    body << "<text x=\"" << number(left) << "\" y=\"46\" font-size=\"13\">held between iterations by pool, then the "
            "iteration's peak above it"
         << (usable_drawn ? "; the dashed line: the GPU's usable memory, " + mib(usable_bytes)
             : usable_bytes > 0 ? "; the GPU's usable memory, " + mib(usable_bytes) + ", is off the scale" : std::string())
         << "</text>\n";
    for (size_t i = 0; i < ranks.size(); ++i) {
        const RankMemory & r = ranks[i];
        const double       y = top + static_cast<double>(i) * (bar_h + gap);
        body << "<text x=\"" << number(left - 10.0) << "\" y=\"" << number(y + bar_h / 2.0)
             << "\" font-size=\"13\" text-anchor=\"end\" dominant-baseline=\"central\">rank " << r.rank << "</text>\n";
        double x = left;
        for (const std::string & pool : pools) {   // the legend's order, so the same pool sits in the same place
            const auto it = r.device.find(pool);
            if (it == r.device.end() || it->second <= 0) continue;
            const double w = static_cast<double>(it->second) * px_per_byte;
            body << "<rect x=\"" << number(x) << "\" y=\"" << number(y) << "\" width=\"" << number(w) << "\" height=\""
                 << number(bar_h) << "\" fill=\"" << fill(pool) << "\"><title>rank " << r.rank << " " << pool << " "
                 << mib(it->second) << "</title></rect>\n";
            x += w;
        }
        if (r.iteration_planned && r.iteration_peak > 0) {
            const double w = static_cast<double>(r.iteration_peak) * px_per_byte;
            body << "<rect x=\"" << number(x) << "\" y=\"" << number(y) << "\" width=\"" << number(w) << "\" height=\""
                 << number(bar_h) << "\" fill=\"" << kPeakFill << "\"><title>rank " << r.rank << " iteration peak "
                 << mib(r.iteration_peak) << "</title></rect>\n";
            x += w;
        }
        body << "<text x=\"" << number(x + 6.0) << "\" y=\"" << number(y + bar_h / 2.0)
             << "\" font-size=\"12\" dominant-baseline=\"central\">" << mib(r.device_peak_total()) << "</text>\n";
    }
    if (usable_drawn) {
        const double x = left + static_cast<double>(usable_bytes) * px_per_byte;
        body << "<line x1=\"" << number(x) << "\" y1=\"" << number(top - 6.0) << "\" x2=\"" << number(x) << "\" y2=\""
             << number(bars_bottom) << "\" stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/>\n";
    }
    double lx = left;
    auto   legend = [&](const std::string & name, const char * colour) {
        body << "<rect x=\"" << number(lx) << "\" y=\"" << number(legend_y - 10.0) << "\" width=\"14\" height=\"14\" fill=\""
             << colour << "\"/>\n<text x=\"" << number(lx + 20.0) << "\" y=\"" << number(legend_y + 1.0)
             << "\" font-size=\"12\">" << name << "</text>\n";
        lx += 30.0 + 7.0 * static_cast<double>(name.size());
    };
    for (const std::string & pool : pools) legend(pool, fill(pool));
    legend("iteration peak", kPeakFill);

    // The timeline below, as its own picture nested at its place.
    std::string timeline_part;
    double      height = memory_h, total_width = width;
    if (timeline) {
        timeline_part       = pipeline::timeline_svg(*timeline);
        const size_t h_at   = timeline_part.find("height=\"");
        const size_t w_at   = timeline_part.find("width=\"");
        LOOM_CHECK(h_at != std::string::npos && w_at != std::string::npos, "the timeline picture without its size", "");
        const double t_height = std::strtod(timeline_part.c_str() + h_at + 8, nullptr);
        const double t_width  = std::strtod(timeline_part.c_str() + w_at + 7, nullptr);
        timeline_part.insert(4, " x=\"0\" y=\"" + number(memory_h + 10.0) + "\"");   // after "<svg"
        height += 10.0 + t_height;
        total_width = std::max(total_width, t_width);
    }
    std::ostringstream os;
    os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << number(total_width) << "\" height=\"" << number(height)
       << "\" viewBox=\"0 0 " << number(total_width) << " " << number(height)
       << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" style=\"background:#ffffff\">\n"
       << body.str() << timeline_part << "</svg>\n";
    return os.str();
}

}  // namespace loom::plan
