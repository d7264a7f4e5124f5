#include "pipeline/schedule.h"

#include "core/error.h"

#include <algorithm>
#include <sstream>

namespace loom::pipeline {

namespace {

constexpr const char * kMicrobatchesHint =
    "the number of microbatches is --global-batch-size / (--micro-batch-size x data-parallel size)";

// Group sizes N in [pp, m] the interleaved schedule accepts for m microbatches, as "4, 8" (or "none").
std::string valid_group_sizes(int pp, int m) {
    std::ostringstream os;
    int                count = 0;
    for (int n = pp; n <= m; ++n) {
        if (m % n == 0 || m % n >= pp) {
            os << (count++ ? ", " : "") << n;
        }
    }
    return count ? os.str() : "none";
}

// The smallest number of microbatches >= m that group size n accepts with pipeline size pp.
int next_valid_microbatches(int m, int n, int pp) {
    int rest = m % n;
    if (rest == 0 || rest >= pp) return m;
    return pp < n ? m - rest + pp : m - rest + n;
}

void check_rank(const ScheduleOptions & options, int rank) {
    LOOM_CHECK(rank >= 0 && rank < options.pp,
               "pipeline rank " << rank << " is out of range for --pipeline-model-parallel-size " << options.pp,
               "use a rank in 0.." << options.pp - 1);
}

}  // namespace

const char * schedule_kind_name(ScheduleKind kind) {
    switch (kind) {
        case ScheduleKind::no_pipelining: return "no pipelining";
        case ScheduleKind::one_f_one_b:   return "1F1B";
        case ScheduleKind::interleaved:   return "interleaved 1F1B";
    }
    return "unknown";
}

void validate_schedule(const ScheduleOptions & o) {
    LOOM_CHECK(o.pp >= 1, "--pipeline-model-parallel-size must be >= 1, got " << o.pp, "");
    LOOM_CHECK(o.num_microbatches >= 1, "the number of microbatches must be >= 1, got " << o.num_microbatches,
               kMicrobatchesHint);
    if (o.microbatch_group_size) {
        LOOM_CHECK(*o.microbatch_group_size >= 1,
                   "--microbatch-group-size-per-virtual-pipeline-stage must be >= 1, got " << *o.microbatch_group_size,
                   "leave it unset for the default, --pipeline-model-parallel-size");
    }
    if (!o.vpp) {
        return;
    }
    LOOM_CHECK(*o.vpp >= 1, "--num-virtual-stages-per-pipeline-rank must be >= 1, got " << *o.vpp,
               "leave it unset for the non-interleaved 1F1B schedule");
    LOOM_CHECK(*o.vpp == 1 || o.pp > 1,
               "--num-virtual-stages-per-pipeline-rank " << *o.vpp << " needs pipeline parallelism, but "
                   "--pipeline-model-parallel-size is 1",
               "set --pipeline-model-parallel-size >= 2, or drop the virtual stages");
    if (o.pp == 1) {
        return;   // no pipelining: one chunk, nothing interleaved
    }

    const int  m          = o.num_microbatches;
    const int  n          = microbatch_group_size(o);
    const bool explicit_n = o.microbatch_group_size.has_value();
    if (n < o.pp || n > m) {
        if (!explicit_n && n > m) {
            LOOM_THROW("the interleaved schedule needs at least --pipeline-model-parallel-size (" << o.pp
                           << ") microbatches, got " << m,
                       "raise the number of microbatches to >= " << o.pp << " (" << kMicrobatchesHint
                           << "), or drop --num-virtual-stages-per-pipeline-rank");
        }
        LOOM_THROW("--microbatch-group-size-per-virtual-pipeline-stage " << n << " must be in "
                       << "[--pipeline-model-parallel-size " << o.pp << ", number of microbatches " << m << "]",
                   "valid values for " << m << " microbatches: " << valid_group_sizes(o.pp, m)
                       << (o.pp > m ? std::string("; raise the number of microbatches to >= ") + std::to_string(o.pp)
                                    : std::string())
                       << " (" << kMicrobatchesHint << ")");
    }
    const int rest = m % n;
    LOOM_CHECK(rest == 0 || rest >= o.pp,
               "the number of microbatches " << m << " leaves a last group of " << rest << " with "
                   << "--microbatch-group-size-per-virtual-pipeline-stage " << n
                   << (explicit_n ? "" : " (its default, the pipeline size)")
                   << "; the remainder must be 0 or >= --pipeline-model-parallel-size " << o.pp
                   << ", or the pipeline has dependency bubbles",
               "use " << next_valid_microbatches(m, n, o.pp) << " microbatches, or a group size from: "
                   << valid_group_sizes(o.pp, m) << " (" << kMicrobatchesHint << ")");
}

ScheduleKind schedule_kind(const ScheduleOptions & o) {
    if (o.pp == 1) return ScheduleKind::no_pipelining;
    return o.vpp ? ScheduleKind::interleaved : ScheduleKind::one_f_one_b;
}

int num_model_chunks(const ScheduleOptions & o) { return schedule_kind(o) == ScheduleKind::interleaved ? *o.vpp : 1; }

int microbatch_group_size(const ScheduleOptions & o) { return o.microbatch_group_size.value_or(o.pp); }

int num_warmup_microbatches(const ScheduleOptions & o, int rank) {
    validate_schedule(o);
    check_rank(o, rank);
    const int total = o.num_microbatches * num_model_chunks(o);
    int       w     = 0;
    if (o.forward_only) {
        w = total;
    } else if (schedule_kind(o) == ScheduleKind::one_f_one_b) {
        w = o.pp - rank - 1;
    } else if (schedule_kind(o) == ScheduleKind::interleaved) {
        w = 2 * (o.pp - rank - 1) + (num_model_chunks(o) - 1) * microbatch_group_size(o);
    }
    return std::min(w, total);
}

bool operator==(const ScheduleEntry & a, const ScheduleEntry & b) {
    return a.microbatch == b.microbatch && a.chunk == b.chunk;
}

std::vector<ScheduleEntry> schedule_table(int num_microbatches, int num_chunks, int group_size) {
    LOOM_CHECK(num_microbatches >= 1 && num_chunks >= 1 && group_size >= 1,
               "schedule table needs positive sizes, got " << num_microbatches << " microbatches, " << num_chunks
                   << " chunks, group size " << group_size,
               "");
    std::vector<ScheduleEntry> table;
    table.reserve(static_cast<size_t>(num_microbatches) * num_chunks);
    for (int first = 0; first < num_microbatches; first += group_size) {
        const int last = std::min(first + group_size, num_microbatches);   // the last group takes the rest
        for (int c = 0; c < num_chunks; ++c) {
            for (int m = first; m < last; ++m) {
                table.push_back({m, c});
            }
        }
    }
    return table;
}

std::vector<ScheduleEntry> schedule_table(const ScheduleOptions & o) {
    validate_schedule(o);
    return schedule_table(o.num_microbatches, num_model_chunks(o), microbatch_group_size(o));
}

std::vector<int> convert_schedule_table_to_order(int num_warmup, int num_chunks,
                                                 const std::vector<ScheduleEntry> & table) {
    const int total = static_cast<int>(table.size());
    LOOM_CHECK(num_warmup >= 0 && num_warmup <= total,
               "warm-up count " << num_warmup << " is outside [0, " << total << "]", "");
    std::vector<int> order;
    order.reserve(2 * table.size());
    auto fwd = [&](int k) { return table[k].chunk + 1; };
    auto bwd = [&](int k) { return table[k].chunk - num_chunks; };
    for (int k = 0; k < num_warmup; ++k) {
        order.push_back(fwd(k));
    }
    for (int k = num_warmup; k < total; ++k) {
        order.push_back(fwd(k));
        order.push_back(bwd(k - num_warmup));
    }
    for (int k = total - num_warmup; k < total; ++k) {
        order.push_back(bwd(k));
    }
    return order;
}

std::vector<int> schedule_order(const ScheduleOptions & o, int rank) {
    const int                        w     = num_warmup_microbatches(o, rank);   // validates
    const std::vector<ScheduleEntry> table = schedule_table(o);
    if (o.forward_only) {
        std::vector<int> order;
        for (const ScheduleEntry & e : table) order.push_back(e.chunk + 1);
        return order;
    }
    return convert_schedule_table_to_order(w, num_model_chunks(o), table);
}

bool operator==(const ScheduleOp & a, const ScheduleOp & b) {
    return a.forward == b.forward && a.chunk == b.chunk && a.microbatch == b.microbatch;
}

std::string op_label(const ScheduleOp & op) {
    std::string label(1, op.forward ? 'F' : 'B');
    label += std::to_string(op.chunk);
    label += '.';
    label += std::to_string(op.microbatch);
    return label;
}

std::vector<ScheduleOp> order_ops(const std::vector<int> & order) {
    std::vector<int>        forwards, backwards;   // per chunk: how many of each so far
    std::vector<ScheduleOp> ops;
    ops.reserve(order.size());
    for (int id : order) {
        LOOM_CHECK(id != 0, "an order holds signed 1-based chunk ids, found 0", "");
        const int chunk = (id > 0 ? id : -id) - 1;
        if (static_cast<size_t>(chunk) >= forwards.size()) {
            forwards.resize(chunk + 1, 0);
            backwards.resize(chunk + 1, 0);
        }
        int & count = id > 0 ? forwards[chunk] : backwards[chunk];
        ops.push_back({id > 0, chunk, count++});
    }
    return ops;
}

std::vector<ScheduleOp> schedule_ops(const ScheduleOptions & o, int rank) { return order_ops(schedule_order(o, rank)); }

int peak_in_flight(const std::vector<int> & order, bool forward_only) {
    int in_flight = 0, peak = 0;
    for (int id : order) {
        in_flight += id > 0 ? 1 : -1;
        peak = std::max(peak, in_flight);
        if (forward_only && id > 0) --in_flight;   // no backward will need the context
    }
    return peak;
}

int peak_in_flight(const ScheduleOptions & o, int rank) { return peak_in_flight(schedule_order(o, rank), o.forward_only); }

int expected_peak_in_flight(const ScheduleOptions & o, int rank) {
    validate_schedule(o);
    check_rank(o, rank);
    const int m = o.num_microbatches;
    if (o.forward_only) return 1;
    switch (schedule_kind(o)) {
        case ScheduleKind::no_pipelining: return 1;
        case ScheduleKind::one_f_one_b:   return std::min(o.pp - rank, m);
        case ScheduleKind::interleaved: {
            const int v = num_model_chunks(o);
            return std::min(2 * (o.pp - rank - 1) + (v - 1) * microbatch_group_size(o) + 1, m * v);
        }
    }
    return 0;
}

}  // namespace loom::pipeline
