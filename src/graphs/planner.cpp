#include "graphs/planner.h"

#include "core/error.h"

#include <algorithm>
#include <deque>
#include <iomanip>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

namespace loom::graphs {

namespace {

using Key = std::tuple<int, int, int>;   // (chunk, microbatch, layer)

// Resolves the [V][L_c] signatures: empty means every layer has the default; otherwise the shape must match.
std::vector<std::vector<std::string>> resolve_signatures(const std::vector<std::vector<std::string>> & given,
                                                         const std::vector<int> & layers, const char * what) {
    if (given.empty()) {
        std::vector<std::vector<std::string>> all;
        for (int n : layers) all.emplace_back(n, kDefaultSignature);
        return all;
    }
    LOOM_CHECK(given.size() == layers.size(),
               what << " signatures are given for " << given.size() << " chunks, the rank has " << layers.size(),
               "give one list of signatures per model chunk");
    for (size_t c = 0; c < layers.size(); ++c) {
        LOOM_CHECK(static_cast<int>(given[c].size()) == layers[c],
                   what << " signatures of chunk " << c << " name " << given[c].size() << " layers, the chunk has "
                        << layers[c],
                   "give one signature per graphed layer of the chunk");
    }
    return given;
}

// The most intervals of `tensor` live at one step.
int peak_live(const std::vector<PoolInterval> & intervals, PoolTensor tensor, int steps) {
    std::vector<int> delta(steps + 1, 0);
    for (const PoolInterval & i : intervals) {
        if (i.tensor != tensor) continue;
        ++delta[i.first];
        --delta[i.last + 1];
    }
    int live = 0, peak = 0;
    for (int d : delta) {
        live += d;
        peak = std::max(peak, live);
    }
    return peak;
}

// The pool intervals of docs/design/schedules_and_graphs.md 6.3 for a timeline whose steps are valid: Y and Saved of
// every forward in T order, then dX of every backward in T order.
std::vector<PoolInterval> pool_intervals_of(const std::vector<GraphStep> & timeline) {
    std::map<Key, int> backward_at;
    for (size_t i = 0; i < timeline.size(); ++i) {
        const GraphStep & s = timeline[i];
        if (s.kind == GraphKind::backward) backward_at[{s.chunk, s.microbatch, s.layer}] = static_cast<int>(i);
    }
    std::vector<PoolInterval> intervals;
    for (size_t i = 0; i < timeline.size(); ++i) {
        const GraphStep & s = timeline[i];
        if (s.kind != GraphKind::forward) continue;
        auto b = backward_at.find({s.chunk, s.microbatch, s.layer});
        const int last = b == backward_at.end() ? static_cast<int>(timeline.size()) - 1 : b->second;
        intervals.push_back({PoolTensor::output, s.chunk, s.microbatch, s.layer, static_cast<int>(i), last});
        intervals.push_back({PoolTensor::saved, s.chunk, s.microbatch, s.layer, static_cast<int>(i), last});
    }
    for (size_t i = 0; i < timeline.size(); ++i) {
        const GraphStep & s = timeline[i];
        if (s.kind != GraphKind::backward) continue;
        int last = static_cast<int>(timeline.size()) - 1;
        if (s.layer > 0) {
            auto b = backward_at.find({s.chunk, s.microbatch, s.layer - 1});
            if (b != backward_at.end()) last = b->second;
        } else {
            for (size_t j = i + 1; j < timeline.size(); ++j) {
                if (timeline[j].kind == GraphKind::backward && timeline[j].layer == 0) {
                    last = static_cast<int>(j);
                    break;
                }
            }
        }
        intervals.push_back({PoolTensor::grad_input, s.chunk, s.microbatch, s.layer, static_cast<int>(i), last});
    }
    return intervals;
}

std::string set_label(int set) {
    std::ostringstream os;
    os << "S" << set;
    return os.str();
}

std::string key_label(char kind, int c, int m, int l) {
    return std::string(1, kind) + std::to_string(c) + "." + std::to_string(m) + "." + std::to_string(l);
}

}  // namespace

const char * graph_kind_name(GraphKind kind) { return kind == GraphKind::forward ? "FWD" : "BWD"; }

const char * pool_tensor_name(PoolTensor tensor) {
    switch (tensor) {
        case PoolTensor::output:     return "Y";
        case PoolTensor::saved:      return "Saved";
        case PoolTensor::grad_input: return "dX";
    }
    return "?";
}

std::string step_label(const GraphStep & s) {
    return key_label(s.kind == GraphKind::forward ? 'F' : 'B', s.chunk, s.microbatch, s.layer);
}

int GraphPlan::total_layers() const { return std::accumulate(layers_per_chunk.begin(), layers_per_chunk.end(), 0); }

int GraphPlan::layer_prefix(int chunk) const {
    return std::accumulate(layers_per_chunk.begin(), layers_per_chunk.begin() + chunk, 0);
}

int graph_id(const GraphPlan & plan, GraphKind kind, int chunk, int microbatch, int layer) {
    LOOM_CHECK(chunk >= 0 && chunk < plan.num_chunks, "graph of chunk " << chunk << " asked for, the rank has "
                                                                          << plan.num_chunks << " chunks", "");
    LOOM_CHECK(layer >= 0 && layer < plan.layers_per_chunk[chunk],
               "graph of layer " << layer << " of chunk " << chunk << " asked for, the chunk has "
                                 << plan.layers_per_chunk[chunk] << " graphed layers",
               "");
    LOOM_CHECK(microbatch >= 0, "graph of microbatch " << microbatch << " asked for", "");
    const int mc = plan.captured_microbatches;
    const int id = plan.layer_prefix(chunk) * mc + (microbatch % mc) * plan.layers_per_chunk[chunk] + layer;
    return kind == GraphKind::forward ? id : id + mc * plan.total_layers();
}

GraphPlan plan_graphs(const GraphPlanOptions & options) {
    const pipeline::ScheduleOptions & schedule = options.schedule;
    pipeline::validate_schedule(schedule);
    LOOM_CHECK(!schedule.forward_only, "a graph plan is for training; forward-only schedules capture no backward",
               "drop --forward-only");
    LOOM_CHECK(options.rank >= 0 && options.rank < schedule.pp,
               "pipeline rank " << options.rank << " is out of range for --pipeline-model-parallel-size "
                                << schedule.pp,
               "use a rank in 0.." << schedule.pp - 1);

    GraphPlan plan;
    plan.schedule   = schedule;
    plan.rank       = options.rank;
    plan.num_chunks = pipeline::num_model_chunks(schedule);
    plan.layers_per_chunk =
        options.layers_per_chunk.empty() ? std::vector<int>(plan.num_chunks, 1) : options.layers_per_chunk;
    LOOM_CHECK(static_cast<int>(plan.layers_per_chunk.size()) == plan.num_chunks,
               "layers are given for " << plan.layers_per_chunk.size() << " chunks, the rank has " << plan.num_chunks
                                       << " (--num-virtual-stages-per-pipeline-rank)",
               "give one layer count per model chunk");
    for (int n : plan.layers_per_chunk) {
        LOOM_CHECK(n >= 0, "a chunk cannot have " << n << " graphed layers", "give counts >= 0");
    }
    LOOM_CHECK(plan.total_layers() > 0, "the rank has no graphed layer, so nothing to capture",
               "give at least one chunk a graphed layer");
    plan.input_signatures  = resolve_signatures(options.input_signatures, plan.layers_per_chunk, "input");
    plan.output_signatures = resolve_signatures(options.output_signatures, plan.layers_per_chunk, "output");

    // The order the runtime runs, for the microbatches that get their own graphs.
    plan.captured_microbatches         = schedule.pp > 1 ? schedule.num_microbatches : 1;
    pipeline::ScheduleOptions captured = schedule;
    captured.num_microbatches          = plan.captured_microbatches;
    plan.order                         = pipeline::schedule_order(captured, options.rank);
    plan.num_warmup                    = pipeline::num_warmup_microbatches(captured, options.rank);
    plan.peak_in_flight                = pipeline::peak_in_flight(plan.order);

    const int v  = plan.num_chunks;
    const int mc = plan.captured_microbatches;
    plan.input_sets.assign(v, std::vector<std::vector<int>>(mc));
    for (int c = 0; c < v; ++c) {
        for (int m = 0; m < mc; ++m) plan.input_sets[c][m].assign(plan.layers_per_chunk[c], -1);
    }

    // Walk the order: P1 by the FIFO rule, P2 by first use.
    std::map<std::string, std::deque<int>> free_sets;   // input signature -> free set ids, FIFO
    std::map<std::string, int>             grad_output_buffer;
    for (const pipeline::ScheduleOp & op : pipeline::order_ops(plan.order)) {
        const int c = op.chunk, m = op.microbatch, layers = plan.layers_per_chunk[c];
        if (op.forward) {
            for (int l = 0; l < layers; ++l) {
                const std::string &  signature = plan.input_signatures[c][l];
                std::deque<int> &    free      = free_sets[signature];
                int                  set;
                if (free.empty()) {
                    set = plan.num_input_sets();
                    plan.set_signatures.push_back(signature);
                } else {
                    set = free.front();
                    free.pop_front();
                }
                plan.input_sets[c][m][l] = set;
                plan.timeline.push_back({GraphKind::forward, c, m, l, graph_id(plan, GraphKind::forward, c, m, l), set, -1});
            }
        } else {
            // The chunk-backward event B(c, m): F(c, m, .)'s sets go back, l ascending.
            for (int l = 0; l < layers; ++l) free_sets[plan.input_signatures[c][l]].push_back(plan.input_sets[c][m][l]);
            for (int l = layers - 1; l >= 0; --l) {
                const std::string & signature = plan.output_signatures[c][l];
                auto [it, created] = grad_output_buffer.emplace(signature, plan.num_grad_output_buffers());
                if (created) plan.grad_output_signatures.push_back(signature);
                plan.timeline.push_back({GraphKind::backward, c, m, l, graph_id(plan, GraphKind::backward, c, m, l),
                                         plan.input_sets[c][m][l], it->second});
            }
        }
    }

    plan.pool_intervals        = pool_intervals_of(plan.timeline);
    const int steps            = static_cast<int>(plan.timeline.size());
    plan.num_graphs            = steps;
    plan.peak_live_outputs     = peak_live(plan.pool_intervals, PoolTensor::output, steps);
    plan.peak_live_saved       = peak_live(plan.pool_intervals, PoolTensor::saved, steps);
    plan.peak_live_grad_inputs = peak_live(plan.pool_intervals, PoolTensor::grad_input, steps);
    plan.peak_layer_forwards   = plan.peak_live_outputs;
    validate_graph_plan(plan);
    return plan;
}

void validate_graph_plan(const GraphPlan & plan) {
    constexpr const char * kHint = "the plan was changed after plan_graphs(), or the planner has a bug";
    const int v = plan.num_chunks, mc = plan.captured_microbatches;
    LOOM_CHECK(v >= 1 && mc >= 1 && static_cast<int>(plan.layers_per_chunk.size()) == v &&
                   static_cast<int>(plan.input_sets.size()) == v,
               "graph plan has inconsistent sizes: " << v << " chunks, " << plan.layers_per_chunk.size()
                                                     << " layer counts, " << mc << " captured microbatches",
               kHint);
    const int total = plan.total_layers();
    const int steps = static_cast<int>(plan.timeline.size());
    LOOM_CHECK(steps == 2 * mc * total && plan.num_graphs == steps,
               "graph plan has " << steps << " steps and counts " << plan.num_graphs << " graphs, expected 2 x Mc "
                                 << mc << " x " << total << " layers = " << 2 * mc * total,
               kHint);

    // Every graph exactly once, with its formula id; every BWD after its FWD; chunk-backwards contiguous.
    std::set<int>      ids;
    std::map<Key, int> forward_at, backward_at;
    for (int i = 0; i < steps; ++i) {
        const GraphStep & s = plan.timeline[i];
        LOOM_CHECK(s.chunk >= 0 && s.chunk < v && s.microbatch >= 0 && s.microbatch < mc && s.layer >= 0 &&
                       s.layer < plan.layers_per_chunk[s.chunk],
                   "step " << i << " (" << step_label(s) << ") names a graph outside the plan", kHint);
        LOOM_CHECK(ids.insert(s.graph_id).second, "graph id " << s.graph_id << " is used twice (again at step " << i
                                                                << ", " << step_label(s) << ")",
                   kHint);
        LOOM_CHECK(s.graph_id == graph_id(plan, s.kind, s.chunk, s.microbatch, s.layer),
                   "step " << i << " (" << step_label(s) << ") has graph id " << s.graph_id << ", expected "
                           << graph_id(plan, s.kind, s.chunk, s.microbatch, s.layer),
                   kHint);
        const Key key{s.chunk, s.microbatch, s.layer};
        if (s.kind == GraphKind::forward) {
            forward_at[key] = i;
        } else {
            LOOM_CHECK(forward_at.count(key), "step " << i << " (" << step_label(s) << ") runs a backward before its forward",
                       kHint);
            backward_at[key] = i;
            if (s.layer + 1 < plan.layers_per_chunk[s.chunk]) {
                const GraphStep & prev = plan.timeline[i > 0 ? i - 1 : i];
                LOOM_CHECK(i > 0 && prev.kind == GraphKind::backward && prev.chunk == s.chunk &&
                               prev.microbatch == s.microbatch && prev.layer == s.layer + 1,
                           "step " << i << " (" << step_label(s) << ") does not follow the backward of layer "
                                   << s.layer + 1 << ": the chunk-backward is not contiguous",
                           kHint);
            }
        }
    }

    // P1: replay the ownership of the sets along T.
    const int                      num_sets = plan.num_input_sets();
    std::vector<std::pair<int, int>> owner(num_sets, {-1, -1});   // (chunk, microbatch), or -1
    std::map<std::string, int>     owned, peak_owned, sets_of;
    for (const std::string & signature : plan.set_signatures) ++sets_of[signature];
    for (int i = 0; i < steps; ++i) {
        const GraphStep & s = plan.timeline[i];
        LOOM_CHECK(s.input_set >= 0 && s.input_set < num_sets,
                   "step " << i << " (" << step_label(s) << ") reads static input set " << s.input_set << " of "
                           << num_sets,
                   kHint);
        LOOM_CHECK(plan.input_sets[s.chunk][s.microbatch][s.layer] == s.input_set,
                   "step " << i << " (" << step_label(s) << ") reads set S" << s.input_set << ", the plan gives (c, m, l) S"
                           << plan.input_sets[s.chunk][s.microbatch][s.layer],
                   kHint);
        const std::string & signature = plan.input_signatures[s.chunk][s.layer];
        LOOM_CHECK(plan.set_signatures[s.input_set] == signature,
                   "step " << i << " (" << step_label(s) << ") of input signature '" << signature << "' reads set S"
                           << s.input_set << " of signature '" << plan.set_signatures[s.input_set] << "'",
                   kHint);
        std::pair<int, int> & who = owner[s.input_set];
        if (s.kind == GraphKind::forward) {
            LOOM_CHECK(who.first < 0, "static input set S" << s.input_set << " is handed to " << step_label(s)
                                                           << " at step " << i << " while chunk " << who.first
                                                           << " microbatch " << who.second << " still owns it",
                       kHint);
            who = {s.chunk, s.microbatch};
            peak_owned[signature] = std::max(peak_owned[signature], ++owned[signature]);
        } else {
            LOOM_CHECK(who == std::make_pair(s.chunk, s.microbatch),
                       "static input set S" << s.input_set << " is not owned by " << step_label(s) << " at step " << i
                                            << " although its backward reads X",
                       kHint);
            if (s.layer == 0) {   // the chunk-backward ends: all of F(c, m, .)'s sets are free
                for (int l = 0; l < plan.layers_per_chunk[s.chunk]; ++l) {
                    owner[plan.input_sets[s.chunk][s.microbatch][l]] = {-1, -1};
                    --owned[plan.input_signatures[s.chunk][l]];
                }
            }
        }
    }
    for (const auto & [signature, count] : sets_of) {
        LOOM_CHECK(count == peak_owned[signature],
                   "input signature '" << signature << "' has " << count << " static input sets, but at most "
                                       << peak_owned[signature] << " are owned at once",
                   kHint);
    }

    // P2: one grad-output buffer per output signature.
    std::map<std::string, int> buffer_of;
    for (int i = 0; i < steps; ++i) {
        const GraphStep & s = plan.timeline[i];
        if (s.kind == GraphKind::forward) {
            LOOM_CHECK(s.grad_output_buffer == -1,
                       "forward step " << i << " (" << step_label(s) << ") names a grad-output buffer", kHint);
            continue;
        }
        const std::string & signature = plan.output_signatures[s.chunk][s.layer];
        auto [it, created]            = buffer_of.emplace(signature, s.grad_output_buffer);
        LOOM_CHECK(it->second == s.grad_output_buffer && s.grad_output_buffer >= 0 &&
                       s.grad_output_buffer < plan.num_grad_output_buffers() &&
                       plan.grad_output_signatures[s.grad_output_buffer] == signature,
                   "step " << i << " (" << step_label(s) << ") of output signature '" << signature
                           << "' reads grad-output buffer " << s.grad_output_buffer,
                   kHint);
    }
    LOOM_CHECK(static_cast<int>(buffer_of.size()) == plan.num_grad_output_buffers(),
               "the plan has " << plan.num_grad_output_buffers() << " grad-output buffers for " << buffer_of.size()
                               << " output signatures",
               kHint);

    // P3: the intervals of docs/design/schedules_and_graphs.md 6.3.
    LOOM_CHECK(plan.pool_intervals.size() == 3u * steps / 2,
               "the plan has " << plan.pool_intervals.size() << " pool intervals, expected 3 per layer-microbatch",
               kHint);
    std::set<std::tuple<int, int, int, int>> seen;
    for (const PoolInterval & p : plan.pool_intervals) {
        const Key         key{p.chunk, p.microbatch, p.layer};
        const std::string what = std::string(pool_tensor_name(p.tensor)) + "(" + std::to_string(p.chunk) + ", " +
                                 std::to_string(p.microbatch) + ", " + std::to_string(p.layer) + ")";
        LOOM_CHECK(forward_at.count(key) && seen.insert({static_cast<int>(p.tensor), p.chunk, p.microbatch, p.layer}).second,
                   what << " is not a tensor of the plan, or appears twice", kHint);
        int first = 0, last = 0;
        if (p.tensor != PoolTensor::grad_input) {
            first = forward_at.at(key);
            last  = backward_at.at(key);
        } else {
            first = backward_at.at(key);
            last  = steps - 1;
            if (p.layer > 0) {
                last = backward_at.at({p.chunk, p.microbatch, p.layer - 1});
                LOOM_CHECK(p.last == last && last > first,
                           what << " lives over [" << p.first << ", " << p.last << "], but BWD(" << p.chunk << ", "
                                << p.microbatch << ", " << p.layer - 1 << ") consumes it at step " << last,
                           kHint);
            } else {
                for (int j = first + 1; j < steps; ++j) {
                    const GraphStep & s = plan.timeline[j];
                    if (s.kind == GraphKind::backward && s.layer == 0) {
                        last = j;
                        break;
                    }
                }
            }
        }
        LOOM_CHECK(p.first == first && p.last == last && first <= last,
                   what << " lives over [" << p.first << ", " << p.last << "], expected [" << first << ", " << last << "]",
                   kHint);
    }

    // Counts.
    LOOM_CHECK(plan.peak_in_flight == pipeline::peak_in_flight(plan.order),
               "the plan counts " << plan.peak_in_flight << " chunk-microbatches in flight, its order has "
                                  << pipeline::peak_in_flight(plan.order),
               kHint);
    int peak_forwards = 0, live = 0;   // Y(c, m, l) is live from its FWD through its BWD, inclusive
    for (const GraphStep & s : plan.timeline) {
        if (s.kind == GraphKind::forward) ++live;
        peak_forwards = std::max(peak_forwards, live);
        if (s.kind == GraphKind::backward) --live;
    }
    LOOM_CHECK(plan.peak_layer_forwards == peak_forwards && plan.peak_live_outputs == peak_forwards &&
                   plan.peak_live_saved == peak_forwards,
               "the plan counts " << plan.peak_layer_forwards << " layer-forwards outstanding at once ("
                                  << plan.peak_live_outputs << " Y, " << plan.peak_live_saved << " Saved), T has "
                                  << peak_forwards,
               kHint);
    LOOM_CHECK(plan.peak_live_grad_inputs == peak_live(plan.pool_intervals, PoolTensor::grad_input, steps) &&
                   plan.peak_live_grad_inputs <= 3,
               "the plan holds " << plan.peak_live_grad_inputs << " dX buffers at once, at most 3 are expected", kHint);
}

std::string graph_plan_text(const GraphPlan & plan) {
    const pipeline::ScheduleOptions & o = plan.schedule;
    std::ostringstream               os;
    const int                        mc = plan.captured_microbatches, total = plan.total_layers();
    os << "graph plan, rank " << plan.rank << ": " << pipeline::schedule_kind_name(pipeline::schedule_kind(o))
       << ", PP=" << o.pp << ", VPP=" << (o.vpp ? std::to_string(*o.vpp) : std::string("none"))
       << ", M=" << o.num_microbatches << ", N=" << pipeline::microbatch_group_size(o) << "\n";
    os << "  layers per chunk L_c:";
    for (int n : plan.layers_per_chunk) os << " " << n;
    os << "; captured microbatches Mc=" << mc;
    if (mc != o.num_microbatches) os << " (every microbatch replays m=0's graphs)";
    os << "; warm-up W=" << plan.num_warmup << "\n";
    os << "  graph id = prefix(c) x Mc + m x L_c + l, + " << mc * total << " for BWD; order:";
    for (int x : plan.order) os << " " << (x > 0 ? "+" : "") << x;
    os << "\n";

    // Pool tensors released after each step (their intervals end there).
    std::vector<std::string> released(plan.timeline.size());
    for (const PoolInterval & p : plan.pool_intervals) {
        std::string & r = released[p.last];
        std::ostringstream label;
        label << (r.empty() ? "" : " ") << pool_tensor_name(p.tensor) << p.chunk << "." << p.microbatch << "." << p.layer;
        r += label.str();
    }
    os << "  step  graph     id    set  dY  released after the step\n";
    for (size_t i = 0; i < plan.timeline.size(); ++i) {
        const GraphStep & s = plan.timeline[i];
        std::ostringstream row;
        row << "  " << std::setw(4) << i << "  " << std::left << std::setw(8) << step_label(s) << std::right
            << std::setw(4) << s.graph_id << "  " << std::setw(5) << set_label(s.input_set) << "  "
            << std::setw(2) << (s.grad_output_buffer < 0 ? std::string("-") : std::to_string(s.grad_output_buffer))
            << "  " << released[i];
        std::string line = row.str();
        line.erase(line.find_last_not_of(' ') + 1);
        os << line << "\n";
    }

    os << "  graphs " << plan.num_graphs << " (" << plan.num_graphs / 2 << " FWD + " << plan.num_graphs / 2
       << " BWD = 2 x Mc " << mc << " x " << total << " layers)\n";
    std::map<std::string, int> sets_of;
    for (const std::string & s : plan.set_signatures) ++sets_of[s];
    os << "  P1 static input sets " << plan.num_input_sets() << " (";
    bool first = true;
    for (const auto & [signature, count] : sets_of) {
        os << (first ? "" : ", ") << signature << " " << count;
        first = false;
    }
    os << "), P2 grad-output buffers " << plan.num_grad_output_buffers() << "\n";
    os << "  peak in flight P_r " << plan.peak_in_flight << " chunk-microbatches, " << plan.peak_layer_forwards
       << " layer-forwards; pool peak live: Y " << plan.peak_live_outputs << ", Saved " << plan.peak_live_saved
       << ", dX " << plan.peak_live_grad_inputs << "\n";
    return os.str();
}

}  // namespace loom::graphs
