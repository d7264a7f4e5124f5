// The param-and-grad buffer layout: buffers, placement, buckets, bucket groups and shard ranges (the rules
// are in layout.h), plus `loom layout`'s JSON and table views and its parameter-file reader.
#include "ddp/layout.h"

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_checks.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iomanip>
#include <numeric>
#include <set>
#include <sstream>

namespace loom::ddp {

namespace {

bool is_param_dtype(DType dtype) {
    return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16;
}

void validate(const std::vector<ParamSpec> & params, const LayoutOptions & options) {
    LOOM_CHECK(options.dp >= 1, "--dp (data-parallel size) must be >= 1, got " << options.dp,
               "dense buffers are reduced and sharded over --dp ranks; use 1 for a single rank");
    LOOM_CHECK(options.edp >= 1, "--edp (expert data-parallel size) must be >= 1, got " << options.edp,
               "expert buffers are reduced and sharded over --edp ranks; leave it out to use --dp");
    LOOM_CHECK(options.pipeline_rank >= 0, "--pipeline-rank must be >= 0, got " << options.pipeline_rank, "");
    LOOM_CHECK(!options.bucket_size || *options.bucket_size >= 1,
               "--ddp-bucket-size (--bucket-size) must be >= 1 element, got " << *options.bucket_size,
               "leave it out for no size limit (one bucket per buffer)");
    for (size_t i = 0; i < params.size(); ++i) {
        const ParamSpec & p = params[i];
        LOOM_CHECK(is_param_dtype(p.param_dtype),
                   "parameter " << i << " ('" << p.name << "') has dtype " << dtype_name(p.param_dtype)
                                << "; DDP buffers hold float32, bfloat16 or float16 parameters",
                   "give the parameter one of those dtypes (--bf16 / --fp16 set it for the model)");
        LOOM_CHECK(p.numel() >= 1,
                   "parameter " << i << " ('" << p.name << "') has shape " << shape_string(p.shape)
                                << " with no elements",
                   "every dimension of a parameter must be >= 1");
    }
}

struct BufferKey {
    DType param_dtype;
    DType grad_dtype;
    bool  expert;

    bool operator==(const BufferKey &) const = default;
};

// Places the members of one buffer (ParamSpec indices in registration order) in reverse order and closes
// buckets, as in docs/design/ddp_and_optimizers.md 1.4: (a) without the distributed optimizer, (b) with it.
void place_buffer(BufferLayout & buffer, const std::vector<int> & members, const std::vector<ParamSpec> & params,
                  const LayoutOptions & options) {
    const bool    distopt = options.use_distributed_optimizer;
    const int64_t divisor = distopt ? bucket_end_divisor(buffer.data_parallel_world_size,
                                                         options.pad_buckets_for_high_nccl_busbw)
                                    : 1;
    int64_t      pos          = 0;
    int64_t      bucket_start = 0;
    BucketLayout open;

    // Ends the open bucket at `end` (its unpadded end); the next bucket starts at the padded end.
    auto close = [&](int64_t end) {
        int64_t padded_end  = pad_to_divisor(end, divisor);
        open.numel_unpadded = end - bucket_start;
        open.numel          = padded_end - bucket_start;
        buffer.buckets.push_back(std::move(open));
        bucket_start = padded_end;
        open         = BucketLayout{};
        open.id      = static_cast<int>(buffer.buckets.size());
        open.offset  = bucket_start;
    };

    for (auto it = members.rbegin(); it != members.rend(); ++it) {
        const ParamSpec & p        = params[*it];
        const bool        isolated = distopt && p.shared_embedding;
        if (distopt) {
            pos = pad_param_start(pos);
        }
        const bool unit_ends = options.fsdp_units && !open.params.empty() && params[open.params.back()].unit != p.unit;
        if ((isolated || unit_ends) && !open.params.empty()) {
            close(pos);   // the unpadded size of the bucket before includes the gap up to the aligned start
            pos = bucket_start;
        }
        const int64_t end = pos + p.numel();
        buffer.params.push_back({*it, pos, end, open.id});
        open.params.push_back(*it);
        if ((options.bucket_size && end - bucket_start >= *options.bucket_size) || isolated) {
            close(end);
            pos = bucket_start;
        } else {
            pos = end;
        }
    }
    if (!open.params.empty()) {
        close(pos);
    }
    buffer.numel          = bucket_start;
    buffer.numel_unpadded = 0;
    for (const BucketLayout & bucket : buffer.buckets) {
        buffer.numel_unpadded += bucket.numel_unpadded;
    }
}

// docs/design/ddp_and_optimizers.md 1.7 without FP8 buffers: one group per bucket, or one group of every bucket,
// over the buffers from `first` (one chunk's).
void partition_buckets(Layout & layout, size_t first, bool expert, bool force_single_bucket_group) {
    std::vector<BucketRef> single;
    for (size_t b = first; b < layout.buffers.size(); ++b) {
        const BufferLayout & buffer = layout.buffers[b];
        if (buffer.is_expert_parallel != expert) {
            continue;
        }
        for (const BucketLayout & bucket : buffer.buckets) {
            BucketRef ref{static_cast<int>(b), bucket.id};
            if (force_single_bucket_group) {
                single.push_back(ref);
            } else {
                layout.bucket_groups.push_back({ref});
            }
        }
    }
    if (!single.empty()) {
        layout.bucket_groups.push_back(std::move(single));
    }
}

// Megatron-FSDP: one group per unit, holding the unit's bucket in every buffer of the chunk; groups in
// placement order, so the model's last unit first.
void unit_groups(Layout & layout, size_t first, const std::vector<ParamSpec> & params) {
    std::vector<int> units;   // in placement order
    for (size_t b = first; b < layout.buffers.size(); ++b) {
        for (const ParamPlace & place : layout.buffers[b].params) {
            const int unit = params[place.param].unit;
            if (std::find(units.begin(), units.end(), unit) == units.end()) units.push_back(unit);
        }
    }
    std::sort(units.begin(), units.end(), std::greater<>());
    for (int unit : units) {
        std::vector<BucketRef> group;
        for (size_t b = first; b < layout.buffers.size(); ++b) {
            for (const BucketLayout & bucket : layout.buffers[b].buckets) {
                if (params[bucket.params.front()].unit == unit) group.push_back(BucketRef{static_cast<int>(b), bucket.id});
            }
        }
        layout.bucket_groups.push_back(std::move(group));
    }
}

std::string range_string(int64_t start, int64_t end) {
    std::ostringstream os;
    os << "[" << start << ", " << end << ")";
    return os.str();
}

// The character of the k-th parameter placed in a buffer, in the table's bars and legend.
char legend_char(size_t k) {
    static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    return kChars[k % (sizeof(kChars) - 1)];
}

constexpr int64_t kBarWidth = 60;

// One bucket as kBarWidth cells: a cell shows the parameter covering most of its elements, or '.' where
// padding (alignment gaps and bucket-end padding) covers more than any parameter. A parameter too small to
// win a cell then takes the cell of its midpoint, unless that would remove the cell's owner from the bar.
std::string bucket_bar(const BufferLayout & buffer, const BucketLayout & bucket, const std::vector<char> & chars) {
    const int64_t    n = bucket.numel;
    std::vector<int> owner(kBarWidth, -1);   // index into buffer.params, -1: padding
    for (int64_t i = 0; i < kBarWidth && n > 0; ++i) {
        const int64_t lo      = bucket.offset + i * n / kBarWidth;
        const int64_t hi      = bucket.offset + std::max(i * n / kBarWidth + 1, (i + 1) * n / kBarWidth);
        int64_t       covered = 0;
        int64_t       best    = 0;
        for (size_t k = 0; k < buffer.params.size(); ++k) {
            const ParamPlace & place   = buffer.params[k];
            const int64_t      overlap = std::min(hi, place.end) - std::max(lo, place.start);
            if (place.bucket != bucket.id || overlap <= 0) {
                continue;
            }
            covered += overlap;
            if (overlap > best) {
                best     = overlap;
                owner[i] = static_cast<int>(k);
            }
        }
        if (hi - lo - covered > best) {
            owner[i] = -1;
        }
    }
    for (size_t k = 0; k < buffer.params.size() && n > 0; ++k) {
        const ParamPlace & place = buffer.params[k];
        if (place.bucket != bucket.id || std::count(owner.begin(), owner.end(), static_cast<int>(k)) > 0) {
            continue;
        }
        const int64_t cell = std::min(kBarWidth - 1, ((place.start + place.end) / 2 - bucket.offset) * kBarWidth / n);
        if (std::count(owner.begin(), owner.end(), owner[cell]) > 1) {
            owner[cell] = static_cast<int>(k);
        }
    }
    std::string bar(kBarWidth, '.');
    for (int64_t i = 0; i < kBarWidth; ++i) {
        if (owner[i] >= 0) {
            bar[i] = chars[owner[i]];
        }
    }
    return bar;
}

[[noreturn]] void throw_entry_error(const std::string & path, size_t index, const std::string & name,
                                    const std::string & what) {
    LOOM_THROW("params file '" << path << "': entry " << index << (name.empty() ? "" : " ('" + name + "')") << ": "
                               << what,
               "each entry of \"params\" is [name, [d0, d1, ...], dtype, {\"shared_embedding\": true, "
               "\"allreduce\": false}?] with dtype float32, bfloat16 or float16, e.g. "
               "[\"decoder.layers.0.mlp.linear_fc1.weight\", [4096, 1024], \"bfloat16\"]");
}

}  // namespace

int64_t ParamSpec::numel() const { return shape_numel(shape); }

int64_t default_bucket_size(int64_t dp) { return std::max<int64_t>(40'000'000, 1'000'000 * dp); }

int64_t pad_to_divisor(int64_t x, int64_t divisor) {
    LOOM_CHECK(divisor >= 1 && x >= 0, "pad_to_divisor(" << x << ", " << divisor << "): bad arguments", "");
    return (x + divisor - 1) / divisor * divisor;
}

int64_t pad_param_start(int64_t pos) { return pad_to_divisor(pos, kParamStartAlignment); }

int64_t bucket_end_divisor(int64_t dp, bool pad_buckets_for_high_nccl_busbw) {
    int64_t divisor = std::lcm(dp, kBucketEndAlignment);
    return pad_buckets_for_high_nccl_busbw ? std::lcm(divisor, kHighNcclBusbwDivisor) : divisor;
}

int64_t pad_bucket_end(int64_t end, int64_t dp, bool pad_buckets_for_high_nccl_busbw) {
    return pad_to_divisor(end, bucket_end_divisor(dp, pad_buckets_for_high_nccl_busbw));
}

const ParamPlace & BufferLayout::place_of(int param) const {
    for (const ParamPlace & place : params) {
        if (place.param == param) {
            return place;
        }
    }
    LOOM_THROW("parameter " << param << " is not in this " << dtype_name(param_dtype) << " buffer", "");
}

Layout compute_layout(const std::vector<ParamSpec> & params, const LayoutOptions & options) {
    validate(params, options);
    int chunks = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        LOOM_CHECK(params[i].chunk >= 0 && params[i].chunk >= chunks - 1 && params[i].chunk <= chunks,
                   "parameter " << i << " ('" << params[i].name << "') is in model chunk " << params[i].chunk
                                << " after chunk " << chunks - 1,
                   "list each chunk's parameters together, chunks in order from 0");
        chunks = std::max(chunks, params[i].chunk + 1);
    }

    Layout layout;
    for (int chunk = 0; chunk < chunks; ++chunk) {
        // Megatron's DDP of this chunk: bucket_size=None on later pipeline ranks and for later chunks
        // (disable_bucketing, which also makes one bucket group), or for every chunk with the optimizer-
        // step overlap.
        const bool    disable_bucketing = chunk > 0 || options.overlap_param_gather_with_optimizer_step;
        LayoutOptions mine              = options;
        if (options.pipeline_rank > 0 || disable_bucketing || options.fsdp_units) mine.bucket_size.reset();
        mine.force_single_bucket_group = options.force_single_bucket_group || disable_bucketing;

        // One buffer per key, keys in order of first appearance; dense keys before expert keys.
        std::vector<BufferKey>        keys;
        std::vector<std::vector<int>> members;
        for (bool expert : {false, true}) {
            for (size_t i = 0; i < params.size(); ++i) {
                const ParamSpec & p = params[i];
                if (p.expert != expert || p.chunk != chunk) {
                    continue;
                }
                BufferKey key{p.fp8_codes ? DType::u8 : p.param_dtype, options.grad_reduce_in_fp32 ? DType::f32 : p.param_dtype,
                              p.expert};
                auto      found = std::find(keys.begin(), keys.end(), key);
                if (found == keys.end()) {
                    keys.push_back(key);
                    members.emplace_back();
                    found = keys.end() - 1;
                }
                members[found - keys.begin()].push_back(static_cast<int>(i));
            }
        }
        const size_t first = layout.buffers.size();
        for (size_t b = 0; b < keys.size(); ++b) {
            BufferLayout buffer;
            buffer.chunk                    = chunk;
            buffer.param_dtype              = keys[b].param_dtype;
            buffer.grad_dtype               = keys[b].grad_dtype;
            buffer.is_expert_parallel       = keys[b].expert;
            buffer.data_parallel_world_size = keys[b].expert ? options.edp : options.dp;
            place_buffer(buffer, members[b], params, mine);
            layout.buffers.push_back(std::move(buffer));
        }
        if (options.fsdp_units) {
            unit_groups(layout, first, params);
        } else {
            partition_buckets(layout, first, false, mine.force_single_bucket_group);
            partition_buckets(layout, first, true, mine.force_single_bucket_group);
        }
    }
    return layout;
}

std::vector<std::vector<ShardRange>> shard_ranges(const BufferLayout & buffer, int64_t rank) {
    const int64_t dp = buffer.data_parallel_world_size;
    LOOM_CHECK(rank >= 0 && rank < dp, "shard_ranges: rank " << rank << " is outside the buffer's " << dp
                                                              << " data-parallel ranks",
               "");
    std::vector<std::vector<ShardRange>> out;
    for (const BucketLayout & bucket : buffer.buckets) {
        LOOM_CHECK(bucket.numel % dp == 0,
                   "bucket " << bucket.id << " has " << bucket.numel << " elements, not divisible by dp " << dp,
                   "shard ranges need the distributed optimizer's padding (--use-distributed-optimizer)");
        const int64_t shard       = bucket.numel / dp;
        const int64_t world_start = bucket.offset + rank * shard;
        std::vector<ShardRange> pieces;
        for (int param : bucket.params) {
            const ParamPlace & place = buffer.place_of(param);
            const int64_t      ls    = std::max<int64_t>(0, place.start - world_start);
            const int64_t      le    = std::min<int64_t>(shard, place.end - world_start);
            if (le <= ls) {
                continue;
            }
            ShardRange r;
            r.param                      = param;
            r.gbuf_local_start           = ls;
            r.gbuf_local_end             = le;
            r.gbuf_world_start           = world_start + ls;
            r.gbuf_world_end             = world_start + le;
            r.gbuf_world_in_bucket_start = r.gbuf_world_start - bucket.offset;
            r.gbuf_world_in_bucket_end   = r.gbuf_world_end - bucket.offset;
            r.param_start                = std::max<int64_t>(0, world_start - place.start);
            r.param_end                  = r.param_start + (le - ls);
            pieces.push_back(r);
        }
        out.push_back(std::move(pieces));
    }
    return out;
}

std::string layout_json(const Layout & layout, const std::vector<ParamSpec> & params, bool with_shards) {
    using ordered_json = nlohmann::ordered_json;
    ordered_json out;
    out["buffers"] = ordered_json::array();
    for (const BufferLayout & buffer : layout.buffers) {
        ordered_json b;
        b["param_dtype"]              = dtype_name(buffer.param_dtype);
        b["grad_dtype"]               = dtype_name(buffer.grad_dtype);
        b["is_expert_parallel"]       = buffer.is_expert_parallel;
        b["data_parallel_world_size"] = buffer.data_parallel_world_size;
        b["param_index_map"]          = ordered_json::array();
        for (const ParamPlace & place : buffer.params) {
            b["param_index_map"].push_back(
                ordered_json::array({params[place.param].name, place.start, place.end, place.bucket}));
        }
        b["bucket_indices"] = ordered_json::array();
        for (const BucketLayout & bucket : buffer.buckets) {
            b["bucket_indices"].push_back(ordered_json::array({bucket.offset, bucket.offset + bucket.numel}));
        }
        b["numel"]          = buffer.numel;
        b["numel_unpadded"] = buffer.numel_unpadded;
        b["buckets"]        = ordered_json::array();
        for (const BucketLayout & bucket : buffer.buckets) {
            ordered_json k;
            k["bucket_id"]      = bucket.id;
            k["offset"]         = bucket.offset;
            k["numel"]          = bucket.numel;
            k["numel_unpadded"] = bucket.numel_unpadded;
            b["buckets"].push_back(std::move(k));
        }
        b["chunk"] = buffer.chunk;   // the model chunk (virtual stage) on this rank
        out["buffers"].push_back(std::move(b));
    }
    out["bucket_groups"] = ordered_json::array();
    for (const std::vector<BucketRef> & group : layout.bucket_groups) {
        ordered_json g = ordered_json::array();
        for (const BucketRef & ref : group) {
            g.push_back(ordered_json::array({ref.buffer, ref.bucket}));
        }
        out["bucket_groups"].push_back(std::move(g));
    }
    if (with_shards) {
        out["shards"] = ordered_json::array();
        for (const BufferLayout & buffer : layout.buffers) {
            ordered_json per_rank = ordered_json::array();
            for (int64_t rank = 0; rank < buffer.data_parallel_world_size; ++rank) {
                ordered_json per_bucket = ordered_json::array();
                for (const std::vector<ShardRange> & pieces : shard_ranges(buffer, rank)) {
                    ordered_json list = ordered_json::array();
                    for (const ShardRange & r : pieces) {
                        list.push_back(ordered_json::array(
                            {params[r.param].name, r.gbuf_world_start, r.gbuf_world_end, r.gbuf_world_in_bucket_start,
                             r.gbuf_world_in_bucket_end, r.gbuf_local_start, r.gbuf_local_end, r.param_start,
                             r.param_end}));
                    }
                    per_bucket.push_back(std::move(list));
                }
                per_rank.push_back(std::move(per_bucket));
            }
            out["shards"].push_back(std::move(per_rank));
        }
    }
    return out.dump();
}

std::string layout_table(const Layout & layout, const std::vector<ParamSpec> & params, bool with_shards) {
    std::ostringstream os;
    for (size_t b = 0; b < layout.buffers.size(); ++b) {
        const BufferLayout & buffer  = layout.buffers[b];
        const int64_t        padding = buffer.numel - buffer.numel_unpadded;
        char                 percent[32];
        std::snprintf(percent, sizeof(percent), "%.1f%%",
                      buffer.numel > 0 ? 100.0 * static_cast<double>(padding) / static_cast<double>(buffer.numel) : 0.0);
        const bool chunked = layout.buffers.back().chunk > 0;   // a later model chunk exists: name each buffer's
        os << "buffer " << b << (chunked ? " (chunk " + std::to_string(buffer.chunk) + ")" : std::string())
           << ": params " << dtype_name(buffer.param_dtype) << ", grads "
           << dtype_name(buffer.grad_dtype) << ", " << (buffer.is_expert_parallel ? "expert" : "dense") << ", "
           << (buffer.is_expert_parallel ? "edp " : "dp ") << buffer.data_parallel_world_size << " | numel "
           << buffer.numel << ", unpadded " << buffer.numel_unpadded << ", padding " << padding << " (" << percent
           << ")\n";

        std::vector<char> chars(buffer.params.size());
        size_t            name_width = 4;
        for (size_t k = 0; k < buffer.params.size(); ++k) {
            chars[k]   = legend_char(k);
            name_width = std::max(name_width, params[buffer.params[k].param].name.size());
        }
        for (const BucketLayout & bucket : buffer.buckets) {
            os << "  bucket " << std::left << std::setw(3) << bucket.id << std::setw(24)
               << range_string(bucket.offset, bucket.offset + bucket.numel) << " unpadded " << std::setw(12)
               << bucket.numel_unpadded << " |" << bucket_bar(buffer, bucket, chars) << "|\n"
               << std::right;
        }
        for (size_t k = 0; k < buffer.params.size(); ++k) {
            const ParamPlace & place = buffer.params[k];
            const ParamSpec &  spec  = params[place.param];
            os << "    " << chars[k] << "  " << std::left << std::setw(static_cast<int>(name_width)) << spec.name
               << "  " << std::setw(24) << range_string(place.start, place.end) << " bucket " << std::setw(3)
               << place.bucket << " " << shape_string(spec.shape) << (spec.shared_embedding ? " shared-embedding" : "")
               << "\n"
               << std::right;
        }
        if (with_shards) {
            const int64_t dp = buffer.data_parallel_world_size;
            std::vector<std::vector<std::vector<ShardRange>>> ranks;
            for (int64_t rank = 0; rank < dp; ++rank) {
                ranks.push_back(shard_ranges(buffer, rank));
            }
            for (const BucketLayout & bucket : buffer.buckets) {
                const int64_t shard = bucket.numel / dp;
                os << "  shards of bucket " << bucket.id << ": " << shard << " elements per rank\n";
                for (int64_t rank = 0; rank < dp; ++rank) {
                    const int64_t start = bucket.offset + rank * shard;
                    os << "    rank " << std::left << std::setw(4) << rank << std::setw(24)
                       << range_string(start, start + shard) << std::right;
                    const std::vector<ShardRange> & pieces = ranks[rank][bucket.id];
                    if (pieces.empty()) {
                        os << " (padding only)";
                    }
                    for (const ShardRange & r : pieces) {
                        os << " " << params[r.param].name << range_string(r.param_start, r.param_end);
                    }
                    os << "\n";
                }
            }
        }
    }
    os << "bucket groups (buffer.bucket):";
    for (const std::vector<BucketRef> & group : layout.bucket_groups) {
        os << " [";
        for (size_t i = 0; i < group.size(); ++i) {
            os << (i ? " " : "") << group[i].buffer << "." << group[i].bucket;
        }
        os << "]";
    }
    os << "\n";
    return os.str();
}

std::vector<ParamSpec> read_param_specs(const std::string & path) {
    const char * kFileHint = "the file is one JSON object {\"params\": [[name, [d0, d1, ...], dtype, "
                             "{\"shared_embedding\": true, \"allreduce\": false, \"chunk\": 1}?], ...]} listing the "
                             "parameters in registration (forward) order, chunk by chunk";
    const std::string text = read_input_file(path, "params file");

    nlohmann::json root;
    try {
        root = nlohmann::json::parse(text, json_parse_checks<nlohmann::json>("params file '" + path + "'"));
    } catch (const nlohmann::json::exception & e) {
        LOOM_THROW("params file '" << path << "' is not JSON: " << json_error_text(e), kFileHint);
    }
    LOOM_CHECK(root.is_object() && root.contains("params") && root["params"].is_array(),
               "params file '" << path << "' has no \"params\" list", kFileHint);
    const nlohmann::json & list = root["params"];
    LOOM_CHECK(!list.empty(), "params file '" << path << "' lists no parameters", kFileHint);

    std::vector<ParamSpec> specs;
    std::set<std::string>  names;
    for (size_t i = 0; i < list.size(); ++i) {
        const nlohmann::json & entry = list[i];
        if (!entry.is_array() || entry.size() < 3 || entry.size() > 4) {
            throw_entry_error(path, i, "", "is not [name, shape, dtype, options?]");
        }
        if (!entry[0].is_string() || entry[0].get<std::string>().empty()) {
            throw_entry_error(path, i, "", "the name is not a non-empty string");
        }
        ParamSpec spec;
        spec.name = entry[0].get<std::string>();
        if (!names.insert(spec.name).second) {
            throw_entry_error(path, i, spec.name, "the name appears twice");
        }
        const nlohmann::json & shape = entry[1];
        if (!shape.is_array() || shape.empty()) {
            throw_entry_error(path, i, spec.name, "the shape is not a non-empty list of dimensions");
        }
        for (const nlohmann::json & dim : shape) {
            if (!dim.is_number_integer() || dim.get<int64_t>() < 1) {
                throw_entry_error(path, i, spec.name, "dimension " + dim.dump() + " is not an integer >= 1");
            }
            spec.shape.push_back(dim.get<int64_t>());
        }
        if (!entry[2].is_string()) {
            throw_entry_error(path, i, spec.name, "the dtype " + entry[2].dump() + " is not a string");
        }
        const std::string dtype = entry[2].get<std::string>();
        if (dtype == "float32") {
            spec.param_dtype = DType::f32;
        } else if (dtype == "bfloat16") {
            spec.param_dtype = DType::bf16;
        } else if (dtype == "float16") {
            spec.param_dtype = DType::f16;
        } else {
            throw_entry_error(path, i, spec.name, "unknown parameter dtype '" + dtype + "'");
        }
        if (entry.size() == 4) {
            const nlohmann::json & options = entry[3];
            if (!options.is_object()) {
                throw_entry_error(path, i, spec.name, "the options " + options.dump() + " are not an object");
            }
            for (const auto & [key, value] : options.items()) {
                if (key != "shared_embedding" && key != "allreduce" && key != "chunk") {
                    throw_entry_error(path, i, spec.name,
                                      "unknown option '" + key + "' (known: shared_embedding, allreduce, chunk)");
                }
                if (key == "chunk") {
                    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > 1024) {
                        throw_entry_error(path, i, spec.name, "option 'chunk' " + value.dump() + " is not an integer in [0, 1024]");
                    }
                } else if (!value.is_boolean()) {
                    throw_entry_error(path, i, spec.name, "option '" + key + "' is not true or false");
                }
            }
            spec.shared_embedding = options.value("shared_embedding", false);
            spec.expert           = !options.value("allreduce", true);
            spec.chunk            = options.value("chunk", 0);
        }
        specs.push_back(std::move(spec));
    }
    return specs;
}

}  // namespace loom::ddp
