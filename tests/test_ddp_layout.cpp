// DDP buffer layout (docs/design/ddp_and_optimizers.md sections 1.3-1.7, 2.2 and 4, cited below by number): the dp=4
// worked example of 1.4 and its shard ranges, the padding helpers, Megatron's bucket-size sweep over 10 Linear(95->95)
// layers, the shared-embedding bucket, expert and mixed-dtype buffers, bucket groups, shard coverage over many dp,
// parameter-file validation, and the `loom layout` command.
#include "core/error.h"
#include "ddp/layout.h"

#include "loom_cli_runner.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

using namespace loom;
using namespace loom::ddp;

namespace {

ParamSpec param(std::string name, Shape shape, DType dtype = DType::f32, bool shared_embedding = false,
                bool expert = false) {
    ParamSpec p;
    p.name             = std::move(name);
    p.shape            = std::move(shape);
    p.param_dtype      = dtype;
    p.shared_embedding = shared_embedding;
    p.expert           = expert;
    return p;
}

// A layout's bucket groups as (buffer, bucket) pairs.
using Groups = std::vector<std::vector<std::pair<int, int>>>;
Groups groups(const Layout & l) {
    Groups g;
    for (const auto & group : l.bucket_groups) {
        g.emplace_back();
        for (const BucketRef & r : group) g.back().push_back({r.buffer, r.bucket});
    }
    return g;
}

LayoutOptions distopt(int64_t dp, std::optional<int64_t> bucket_size = std::nullopt) {
    LayoutOptions o;
    o.dp                        = dp;
    o.edp                       = dp;
    o.use_distributed_optimizer = true;
    o.bucket_size               = bucket_size;
    return o;
}

// The section 1.4 worked example: `w` (100) then `b` (50) in registration order.
std::vector<ParamSpec> worked_example_params() { return {param("w", {100}), param("b", {50})}; }

// The message and hint of the Error `f` throws ("" if none).
template <typename F>
std::string error_of(F && f) {
    try {
        f();
    } catch (const Error & e) {
        return e.message() + " | " + e.hint();
    }
    return "";
}

struct Piece {
    int64_t start, end;
    bool    operator<(const Piece & o) const { return start < o.start; }
};

// Checks that every element of every parameter of `layout` is owned by exactly one rank of its buffer's DP
// group, that the four ranges of each piece agree with each other, and returns the owned element count.
int64_t check_shards_cover_every_param_once(const Layout & layout, const std::vector<ParamSpec> & params) {
    int64_t owned_total = 0;
    for (const BufferLayout & buffer : layout.buffers) {
        std::vector<std::vector<Piece>> pieces(params.size());
        for (int64_t rank = 0; rank < buffer.data_parallel_world_size; ++rank) {
            std::vector<std::vector<ShardRange>> ranges = shard_ranges(buffer, rank);
            EXPECT_EQ(ranges.size(), buffer.buckets.size());
            for (size_t b = 0; b < ranges.size(); ++b) {
                const BucketLayout & bucket = buffer.buckets[b];
                const int64_t        shard  = bucket.numel / buffer.data_parallel_world_size;
                const int64_t        world  = bucket.offset + rank * shard;
                for (const ShardRange & r : ranges[b]) {
                    const ParamPlace & place = buffer.place_of(r.param);
                    EXPECT_EQ(place.bucket, bucket.id);
                    EXPECT_EQ(r.gbuf_world_start, world + r.gbuf_local_start);
                    EXPECT_EQ(r.gbuf_world_end, world + r.gbuf_local_end);
                    EXPECT_EQ(r.gbuf_world_in_bucket_start, r.gbuf_world_start - bucket.offset);
                    EXPECT_EQ(r.gbuf_world_in_bucket_end, r.gbuf_world_end - bucket.offset);
                    EXPECT_EQ(r.param_start, r.gbuf_world_start - place.start);
                    EXPECT_EQ(r.param_end, r.gbuf_world_end - place.start);
                    EXPECT_GE(r.gbuf_local_start, 0);
                    EXPECT_LE(r.gbuf_local_end, shard);
                    pieces[r.param].push_back({r.param_start, r.param_end});
                    owned_total += r.param_end - r.param_start;
                }
            }
        }
        for (const ParamPlace & place : buffer.params) {
            std::vector<Piece> & p = pieces[place.param];
            std::sort(p.begin(), p.end());
            int64_t next = 0;
            for (const Piece & piece : p) {
                EXPECT_EQ(piece.start, next) << params[place.param].name;
                next = piece.end;
            }
            EXPECT_EQ(next, params[place.param].numel()) << params[place.param].name;
        }
    }
    return owned_total;
}

// "w3" from ("w", 3); written out because GCC 12 warns falsely (-Wrestrict) on "w" + std::to_string(3).
std::string numbered(const char * prefix, int64_t i) {
    std::string name = prefix;
    name += std::to_string(i);
    return name;
}

int64_t total_numel(const std::vector<ParamSpec> & params) {
    int64_t n = 0;
    for (const ParamSpec & p : params) n += p.numel();
    return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Padding helpers (test_param_layout.py)

TEST(DdpLayoutPadding, ParamStartIs64ElementAligned) {
    EXPECT_EQ(pad_param_start(0), 0);
    EXPECT_EQ(pad_param_start(1), 64);
    EXPECT_EQ(pad_param_start(63), 64);
    EXPECT_EQ(pad_param_start(64), 64);
    EXPECT_EQ(pad_param_start(65), 128);
    EXPECT_EQ(pad_to_divisor(0, 384), 0);
    EXPECT_EQ(pad_to_divisor(385, 384), 768);
}

TEST(DdpLayoutPadding, BucketEndDivisorIsLcmOfDpAnd128AndOptionally65536) {
    EXPECT_EQ(bucket_end_divisor(1, false), 128);
    EXPECT_EQ(bucket_end_divisor(4, false), 128);
    EXPECT_EQ(bucket_end_divisor(3, false), 384);
    EXPECT_EQ(bucket_end_divisor(256, false), 256);
    EXPECT_EQ(bucket_end_divisor(4, true), 65536);
    EXPECT_EQ(bucket_end_divisor(3, true), 196608);
    EXPECT_EQ(pad_bucket_end(164, 4, false), 256);
    EXPECT_EQ(pad_bucket_end(164, 4, true), 65536);
    EXPECT_EQ(pad_bucket_end(385, 3, false), 768);
}

TEST(DdpLayoutPadding, DefaultBucketSizeIsMax40MAnd1MTimesDp) {
    EXPECT_EQ(default_bucket_size(1), 40'000'000);
    EXPECT_EQ(default_bucket_size(40), 40'000'000);
    EXPECT_EQ(default_bucket_size(64), 64'000'000);
}

// ---------------------------------------------------------------------------------------------------
// The worked example of sections 1.4 and 2.2

TEST(DdpLayout, WorkedExampleDp4DistoptPlacesBThenWAndPadsTo256) {
    std::vector<ParamSpec> params = worked_example_params();
    Layout                 layout = compute_layout(params, distopt(4));
    ASSERT_EQ(layout.buffers.size(), 1u);
    const BufferLayout & buffer = layout.buffers[0];
    EXPECT_EQ(buffer.param_dtype, DType::f32);
    EXPECT_EQ(buffer.grad_dtype, DType::f32);
    EXPECT_FALSE(buffer.is_expert_parallel);
    EXPECT_EQ(buffer.data_parallel_world_size, 4);
    ASSERT_EQ(buffer.params.size(), 2u);
    // Reverse registration order: b first.
    EXPECT_EQ(buffer.params[0].param, 1);
    EXPECT_EQ(buffer.params[0].start, 0);
    EXPECT_EQ(buffer.params[0].end, 50);
    EXPECT_EQ(buffer.params[1].param, 0);
    EXPECT_EQ(buffer.params[1].start, 64);
    EXPECT_EQ(buffer.params[1].end, 164);
    ASSERT_EQ(buffer.buckets.size(), 1u);
    EXPECT_EQ(buffer.buckets[0].offset, 0);
    EXPECT_EQ(buffer.buckets[0].numel, 256);
    EXPECT_EQ(buffer.buckets[0].numel_unpadded, 164);
    EXPECT_EQ(buffer.buckets[0].params, (std::vector<int>{1, 0}));
    EXPECT_EQ(buffer.numel, 256);
    EXPECT_EQ(buffer.numel_unpadded, 164);
    EXPECT_EQ(buffer.place_of(0).start, 64);
    EXPECT_THROW(buffer.place_of(2), Error);
}

TEST(DdpLayout, WorkedExampleShardRangesMatchSpec22) {
    std::vector<ParamSpec> params = worked_example_params();
    Layout                 layout = compute_layout(params, distopt(4));
    const BufferLayout &   buffer = layout.buffers[0];

    // r0 owns b entirely (local [0,50), param [0,50)).
    std::vector<std::vector<ShardRange>> r0 = shard_ranges(buffer, 0);
    ASSERT_EQ(r0.size(), 1u);
    ASSERT_EQ(r0[0].size(), 1u);
    EXPECT_EQ(r0[0][0].param, 1);
    EXPECT_EQ(std::tie(r0[0][0].gbuf_world_start, r0[0][0].gbuf_world_end), std::make_tuple(0L, 50L));
    EXPECT_EQ(std::tie(r0[0][0].gbuf_world_in_bucket_start, r0[0][0].gbuf_world_in_bucket_end), std::make_tuple(0L, 50L));
    EXPECT_EQ(std::tie(r0[0][0].gbuf_local_start, r0[0][0].gbuf_local_end), std::make_tuple(0L, 50L));
    EXPECT_EQ(std::tie(r0[0][0].param_start, r0[0][0].param_end), std::make_tuple(0L, 50L));

    // r1 owns w's [0,64) (local [0,64), world [64,128)).
    std::vector<std::vector<ShardRange>> r1 = shard_ranges(buffer, 1);
    ASSERT_EQ(r1[0].size(), 1u);
    EXPECT_EQ(r1[0][0].param, 0);
    EXPECT_EQ(std::tie(r1[0][0].gbuf_world_start, r1[0][0].gbuf_world_end), std::make_tuple(64L, 128L));
    EXPECT_EQ(std::tie(r1[0][0].gbuf_local_start, r1[0][0].gbuf_local_end), std::make_tuple(0L, 64L));
    EXPECT_EQ(std::tie(r1[0][0].param_start, r1[0][0].param_end), std::make_tuple(0L, 64L));

    // r2 owns w's [64,100) (local [0,36), world [128,164)).
    std::vector<std::vector<ShardRange>> r2 = shard_ranges(buffer, 2);
    ASSERT_EQ(r2[0].size(), 1u);
    EXPECT_EQ(r2[0][0].param, 0);
    EXPECT_EQ(std::tie(r2[0][0].gbuf_world_start, r2[0][0].gbuf_world_end), std::make_tuple(128L, 164L));
    EXPECT_EQ(std::tie(r2[0][0].gbuf_world_in_bucket_start, r2[0][0].gbuf_world_in_bucket_end),
              std::make_tuple(128L, 164L));
    EXPECT_EQ(std::tie(r2[0][0].gbuf_local_start, r2[0][0].gbuf_local_end), std::make_tuple(0L, 36L));
    EXPECT_EQ(std::tie(r2[0][0].param_start, r2[0][0].param_end), std::make_tuple(64L, 100L));

    // r3 owns only padding.
    std::vector<std::vector<ShardRange>> r3 = shard_ranges(buffer, 3);
    ASSERT_EQ(r3.size(), 1u);
    EXPECT_TRUE(r3[0].empty());

    EXPECT_THROW(shard_ranges(buffer, 4), Error);
    EXPECT_THROW(shard_ranges(buffer, -1), Error);
    EXPECT_EQ(check_shards_cover_every_param_once(layout, params), 150);
}

TEST(DdpLayout, WorkedExampleWithoutDistoptIsExactAndUnpadded) {
    std::vector<ParamSpec> params = worked_example_params();
    LayoutOptions          o;
    o.dp          = 4;
    Layout layout = compute_layout(params, o);
    const BufferLayout & buffer = layout.buffers[0];
    EXPECT_EQ(std::tie(buffer.params[0].start, buffer.params[0].end), std::make_tuple(0L, 50L));
    EXPECT_EQ(std::tie(buffer.params[1].start, buffer.params[1].end), std::make_tuple(50L, 150L));
    EXPECT_EQ(buffer.numel, 150);
    EXPECT_EQ(buffer.numel_unpadded, 150);
    ASSERT_EQ(buffer.buckets.size(), 1u);
    EXPECT_EQ(buffer.buckets[0].numel, 150);
    // 150 is not divisible by dp 4: shard ranges need the distributed optimizer's padding.
    EXPECT_NE(error_of([&] { shard_ranges(buffer, 0); }).find("--use-distributed-optimizer"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------------
// test_bucket_sizes: bucket_size x distopt x bias x shared_embedding on 10 Linear(95->95) layers.

using BucketSizeCase = std::tuple<int64_t /*bucket size, 0: none*/, bool /*distopt*/, bool /*bias*/, bool /*shared*/>;

class DdpLayoutBucketSizes : public testing::TestWithParam<BucketSizeCase> {};

TEST_P(DdpLayoutBucketSizes, BucketCountUnpaddedAndPaddedSizes) {
    const auto [bucket_size, use_distopt, bias, shared_embedding] = GetParam();
    const int64_t kLayers = 10, kDim = 95, kEmbedding = 1000 * kDim;

    std::vector<ParamSpec> params;
    if (shared_embedding) {
        params.push_back(param("embedding.word_embeddings.weight", {1000, kDim}, DType::f32, true));
    }
    for (int64_t l = 0; l < kLayers; ++l) {
        params.push_back(param("layers." + std::to_string(l) + ".weight", {kDim, kDim}));
        if (bias) {
            params.push_back(param("layers." + std::to_string(l) + ".bias", {kDim}));
        }
    }

    for (int64_t dp : {1, 3, 8}) {
        SCOPED_TRACE("dp " + std::to_string(dp));
        LayoutOptions o;
        o.dp                        = dp;
        o.edp                       = dp;
        o.use_distributed_optimizer = use_distopt;
        if (bucket_size > 0) {
            o.bucket_size = bucket_size;
        }
        Layout layout = compute_layout(params, o);
        ASSERT_EQ(layout.buffers.size(), 1u);
        const BufferLayout & buffer = layout.buffers[0];

        // Expected unpadded bucket sizes, walking the sizes backwards as upstream's test does: within a
        // bucket every param start is padded to 64 (bucket starts are multiples of 128), and the shared
        // embedding (registered first, so placed last) closes the bucket before it at its aligned start.
        const int64_t        lcm = use_distopt ? std::lcm(dp, int64_t{128}) : 1;
        std::vector<int64_t> expected;
        int64_t              in_bucket = 0;
        for (auto it = params.rbegin(); it != params.rend(); ++it) {
            const bool isolated = use_distopt && it->shared_embedding;
            if (use_distopt) {
                in_bucket = (in_bucket + 63) / 64 * 64;
            }
            if (isolated && in_bucket > 0) {
                expected.push_back(in_bucket);
                in_bucket = 0;
            }
            in_bucket += it->numel();
            if ((bucket_size > 0 && in_bucket >= bucket_size) || isolated) {
                expected.push_back(in_bucket);
                in_bucket = 0;
            }
        }
        if (in_bucket > 0) {
            expected.push_back(in_bucket);
        }
        if (bucket_size == 0) {
            EXPECT_EQ(buffer.buckets.size(), shared_embedding && use_distopt ? 2u : 1u);
        }

        ASSERT_EQ(buffer.buckets.size(), expected.size());
        int64_t offset = 0;
        for (size_t b = 0; b < expected.size(); ++b) {
            const BucketLayout & bucket = buffer.buckets[b];
            EXPECT_EQ(bucket.id, static_cast<int>(b));
            EXPECT_EQ(bucket.offset, offset);
            EXPECT_EQ(bucket.numel_unpadded, expected[b]) << "bucket " << b;
            EXPECT_EQ(bucket.numel, (expected[b] + lcm - 1) / lcm * lcm) << "bucket " << b;
            EXPECT_LE(bucket.numel_unpadded, bucket.numel);
            if (use_distopt) {
                EXPECT_EQ(bucket.numel % lcm, 0);
                EXPECT_EQ(bucket.offset % lcm, 0);
            }
            offset += bucket.numel;
        }
        EXPECT_EQ(buffer.numel, offset);

        // Placement: reverse order, 64-aligned with distopt, gap-free without; never split.
        ASSERT_EQ(buffer.params.size(), params.size());
        int64_t previous_end = 0;
        for (size_t k = 0; k < buffer.params.size(); ++k) {
            const ParamPlace & place = buffer.params[k];
            EXPECT_EQ(place.param, static_cast<int>(params.size() - 1 - k));
            EXPECT_EQ(place.end - place.start, params[place.param].numel());
            const BucketLayout & bucket = buffer.buckets[place.bucket];
            EXPECT_GE(place.start, bucket.offset);
            EXPECT_LE(place.end, bucket.offset + bucket.numel_unpadded);
            if (use_distopt) {
                EXPECT_EQ(place.start % 64, 0);
            } else {
                EXPECT_EQ(place.start, previous_end);
            }
            previous_end = place.end;
        }
        if (!use_distopt) {
            EXPECT_EQ(buffer.numel, buffer.numel_unpadded);
            EXPECT_EQ(buffer.numel, total_numel(params));
        }
        if (use_distopt && shared_embedding) {
            const BucketLayout & last = buffer.buckets.back();
            EXPECT_EQ(last.params, (std::vector<int>{0}));
            EXPECT_EQ(last.numel_unpadded, kEmbedding);
        }
        if (use_distopt) {
            EXPECT_EQ(check_shards_cover_every_param_once(layout, params), total_numel(params));
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Upstream, DdpLayoutBucketSizes,
    testing::Combine(testing::Values<int64_t>(0, 9000, 9025, 9050, 18000, 18050, 20000), testing::Bool(),
                     testing::Bool(), testing::Bool()),
    [](const testing::TestParamInfo<BucketSizeCase> & info) {
        const int64_t bucket_size = std::get<0>(info.param);
        return (bucket_size ? "bucket" + std::to_string(bucket_size) : std::string("nobucket")) +
               (std::get<1>(info.param) ? "_distopt" : "_ddp") + (std::get<2>(info.param) ? "_bias" : "_nobias") +
               (std::get<3>(info.param) ? "_shared" : "_noshared");
    });

// A hand-computed case of the sweep: 10 x (95x95 weight + 95 bias), bucket 18000, distopt dp 8.
// Reverse order: bias 95 at 0, weight at 128 ([128, 9153)), bias at 9216, weight at 9344 ([9344, 18369)):
// 18369 >= 18000 closes bucket 0, padded to 18432.
TEST(DdpLayout, BucketSweepHandComputedFirstBucket) {
    std::vector<ParamSpec> params;
    for (int l = 0; l < 10; ++l) {
        params.push_back(param(numbered("w", l), {95, 95}));
        params.push_back(param(numbered("b", l), {95}));
    }
    Layout layout = compute_layout(params, distopt(8, 18000));
    const BufferLayout & buffer = layout.buffers[0];
    EXPECT_EQ(buffer.buckets.size(), 5u);
    EXPECT_EQ(buffer.buckets[0].numel_unpadded, 18369);
    EXPECT_EQ(buffer.buckets[0].numel, 18432);
    EXPECT_EQ(buffer.buckets[0].params, (std::vector<int>{19, 18, 17, 16}));
    EXPECT_EQ(buffer.params[3].start, 9344);
    EXPECT_EQ(buffer.params[4].start, 18432);   // the next bucket starts at the padded end
}

// ---------------------------------------------------------------------------------------------------
// The shared-embedding bucket (distopt only)

TEST(DdpLayout, SharedEmbeddingFirstInReverseOrderGetsBucketZeroAlone) {
    // The output layer (tied to the embedding) registered last, so placed first.
    std::vector<ParamSpec> params = {param("w", {95, 95}), param("b", {95}),
                                     param("output_layer.weight", {1000, 95}, DType::f32, true)};
    Layout layout = compute_layout(params, distopt(4));
    const BufferLayout & buffer = layout.buffers[0];
    ASSERT_EQ(buffer.buckets.size(), 2u);
    EXPECT_EQ(buffer.buckets[0].params, (std::vector<int>{2}));
    EXPECT_EQ(buffer.buckets[0].numel_unpadded, 95000);
    EXPECT_EQ(buffer.buckets[0].numel, 95104);
    EXPECT_EQ(buffer.buckets[1].offset, 95104);
    EXPECT_EQ(buffer.place_of(1).start, 95104);
    EXPECT_EQ(buffer.place_of(0).start, 95104 + 128);
    EXPECT_EQ(buffer.buckets[1].numel_unpadded, 128 + 9025);

    // Without the distributed optimizer there is no shared-embedding rule.
    LayoutOptions plain;
    plain.dp = 4;
    EXPECT_EQ(compute_layout(params, plain).buffers[0].buckets.size(), 1u);
}

TEST(DdpLayout, SharedEmbeddingIsolatedEvenWhenBucketSizeWouldMergeIt) {
    std::vector<ParamSpec> params = {param("embedding", {1000, 95}, DType::f32, true), param("w", {95, 95}),
                                     param("b", {95})};
    Layout layout = compute_layout(params, distopt(4, 1'000'000'000));
    const BufferLayout & buffer = layout.buffers[0];
    ASSERT_EQ(buffer.buckets.size(), 2u);
    // b [0, 95), w [128, 9153); the embedding's aligned start is 9216: the bucket before it counts the
    // 63-element alignment gap in its unpadded size.
    EXPECT_EQ(buffer.place_of(1).end, 9153);
    EXPECT_EQ(buffer.buckets[0].params, (std::vector<int>{2, 1}));
    EXPECT_EQ(buffer.buckets[0].numel_unpadded, 9216);
    EXPECT_EQ(buffer.buckets[0].numel, 9216);
    EXPECT_EQ(buffer.buckets[1].params, (std::vector<int>{0}));
    EXPECT_EQ(buffer.place_of(0).start, 9216);
    EXPECT_EQ(buffer.buckets[1].numel_unpadded, 95000);
    EXPECT_EQ(buffer.buckets[1].numel, 104320 - 9216);
    EXPECT_EQ(buffer.numel, 104320);
    EXPECT_EQ(buffer.numel_unpadded, 9216 + 95000);
}

// Section 1.4 (b): Megatron's current code closes the bucket before a shared embedding at its 64-aligned
// start; older releases padded that end to lcm(dp, 128) first when it was not divisible by dp, which would
// count 384 here.
TEST(DdpLayout, SharedEmbeddingPreCloseCountsOnlyTheAlignmentGapAtDp3) {
    std::vector<ParamSpec> params = {param("embedding", {1000}, DType::f32, true), param("w", {100})};
    Layout layout = compute_layout(params, distopt(3));
    const BufferLayout & buffer = layout.buffers[0];
    ASSERT_EQ(buffer.buckets.size(), 2u);
    EXPECT_EQ(buffer.buckets[0].numel_unpadded, 128);
    EXPECT_EQ(buffer.buckets[0].numel, 384);
    EXPECT_EQ(buffer.place_of(0).start, 384);
    EXPECT_EQ(buffer.buckets[1].numel_unpadded, 1000);
    EXPECT_EQ(buffer.numel, 1536);
    EXPECT_EQ(check_shards_cover_every_param_once(layout, params), 1100);
}

// ---------------------------------------------------------------------------------------------------
// Default (non-distributed-optimizer) layout

TEST(DdpLayout, DefaultLayoutSplitsAfterTheParamReachingBucketSize) {
    std::vector<ParamSpec> params = {param("p0", {30}), param("p1", {50}), param("p2", {20}), param("p3", {70}),
                                     param("p4", {10})};
    LayoutOptions o;
    o.dp          = 2;
    o.bucket_size = 80;
    Layout layout = compute_layout(params, o);
    const BufferLayout & buffer = layout.buffers[0];
    // Reverse: p4 10, p3 70 -> 80 >= 80 closes [0, 80); p2 20, p1 50 -> 70, p0 30 -> 100 closes [80, 180).
    ASSERT_EQ(buffer.buckets.size(), 2u);
    EXPECT_EQ(buffer.buckets[0].params, (std::vector<int>{4, 3}));
    EXPECT_EQ(std::tie(buffer.buckets[0].offset, buffer.buckets[0].numel), std::make_tuple(0L, 80L));
    EXPECT_EQ(buffer.buckets[1].params, (std::vector<int>{2, 1, 0}));
    EXPECT_EQ(std::tie(buffer.buckets[1].offset, buffer.buckets[1].numel), std::make_tuple(80L, 100L));
    EXPECT_EQ(buffer.buckets[1].numel_unpadded, 100);
    EXPECT_EQ(std::tie(buffer.place_of(0).start, buffer.place_of(0).end), std::make_tuple(150L, 180L));
    EXPECT_EQ(buffer.numel, 180);
    EXPECT_EQ(buffer.numel_unpadded, 180);
}

TEST(DdpLayout, DistoptMatchesDefaultLayoutWhenParamsAre64Multiples) {
    std::vector<ParamSpec> params = {param("a", {128}), param("b", {64}), param("c", {3, 64}), param("d", {256})};
    LayoutOptions plain;
    plain.dp = 4;
    Layout d = compute_layout(params, plain);
    Layout z = compute_layout(params, distopt(4));
    ASSERT_EQ(d.buffers[0].params.size(), z.buffers[0].params.size());
    for (size_t k = 0; k < d.buffers[0].params.size(); ++k) {
        EXPECT_EQ(d.buffers[0].params[k].start, z.buffers[0].params[k].start);
        EXPECT_EQ(d.buffers[0].params[k].end, z.buffers[0].params[k].end);
    }
    EXPECT_EQ(d.buffers[0].numel_unpadded, z.buffers[0].numel_unpadded);
    EXPECT_EQ(z.buffers[0].numel, 640);   // 640 = 5 * 128
}

// ---------------------------------------------------------------------------------------------------
// Buffers: expert, mixed dtypes, grad_reduce_in_fp32

TEST(DdpLayout, ExpertParamsGetASeparateBufferIndexedFromZeroWithEdp) {
    std::vector<ParamSpec> params = {param("embedding", {1000}), param("experts.0.fc1", {300}, DType::f32, false, true),
                                     param("dense.fc1", {500}), param("experts.1.fc1", {300}, DType::f32, false, true)};
    LayoutOptions o = distopt(3);
    o.edp           = 256;
    Layout layout   = compute_layout(params, o);
    ASSERT_EQ(layout.buffers.size(), 2u);
    const BufferLayout & dense  = layout.buffers[0];
    const BufferLayout & expert = layout.buffers[1];
    EXPECT_FALSE(dense.is_expert_parallel);
    EXPECT_TRUE(expert.is_expert_parallel);
    EXPECT_EQ(dense.data_parallel_world_size, 3);
    EXPECT_EQ(expert.data_parallel_world_size, 256);
    EXPECT_EQ(dense.buckets[0].params, (std::vector<int>{2, 0}));
    EXPECT_EQ(expert.buckets[0].params, (std::vector<int>{3, 1}));
    EXPECT_EQ(dense.params[0].start, 0);
    EXPECT_EQ(expert.params[0].start, 0);
    EXPECT_EQ(dense.numel % 384, 0);     // lcm(3, 128)
    EXPECT_EQ(dense.numel, 1536);        // 500 -> [0,500), 1000 -> [512,1512), padded to 4 * 384
    EXPECT_EQ(expert.numel % 256, 0);    // lcm(256, 128)
    EXPECT_EQ(expert.numel, 768);        // [0,300), [320,620), padded to 3 * 256
    EXPECT_THROW(dense.place_of(1), Error);
    EXPECT_EQ(check_shards_cover_every_param_once(layout, params), total_numel(params));
}

TEST(DdpLayout, MixedDtypesMakeBuffersInFirstSeenOrder) {
    std::vector<ParamSpec> params = {param("a", {10}, DType::bf16), param("b", {10}, DType::f32),
                                     param("c", {10}, DType::bf16), param("d", {10}, DType::f16),
                                     param("e", {10}, DType::f32)};
    LayoutOptions o;
    Layout layout = compute_layout(params, o);
    ASSERT_EQ(layout.buffers.size(), 3u);
    EXPECT_EQ(layout.buffers[0].param_dtype, DType::bf16);
    EXPECT_EQ(layout.buffers[0].grad_dtype, DType::bf16);
    EXPECT_EQ(layout.buffers[0].buckets[0].params, (std::vector<int>{2, 0}));
    EXPECT_EQ(layout.buffers[1].param_dtype, DType::f32);
    EXPECT_EQ(layout.buffers[1].buckets[0].params, (std::vector<int>{4, 1}));
    EXPECT_EQ(layout.buffers[2].param_dtype, DType::f16);
    EXPECT_EQ(layout.buffers[2].grad_dtype, DType::f16);

    o.grad_reduce_in_fp32 = true;
    Layout fp32 = compute_layout(params, o);
    ASSERT_EQ(fp32.buffers.size(), 3u);
    for (const BufferLayout & buffer : fp32.buffers) {
        EXPECT_EQ(buffer.grad_dtype, DType::f32);
    }
    EXPECT_EQ(fp32.buffers[0].param_dtype, DType::bf16);
    EXPECT_EQ(fp32.buffers[2].param_dtype, DType::f16);
}

// Section 1.3: four bf16 params with fp32 grads form one (bfloat16, float32) buffer.
TEST(DdpLayout, Seed003FourBf16ParamsWithFp32GradsShareOneBuffer) {
    std::vector<ParamSpec> params;
    for (int i = 0; i < 4; ++i) params.push_back(param(numbered("p", i), {64}, DType::bf16));
    LayoutOptions o       = distopt(2);
    o.grad_reduce_in_fp32 = true;
    Layout layout         = compute_layout(params, o);
    ASSERT_EQ(layout.buffers.size(), 1u);
    EXPECT_EQ(layout.buffers[0].param_dtype, DType::bf16);
    EXPECT_EQ(layout.buffers[0].grad_dtype, DType::f32);
    EXPECT_EQ(layout.buffers[0].buckets[0].params, (std::vector<int>{3, 2, 1, 0}));
    EXPECT_EQ(layout.buffers[0].numel, 256);
    // No FP8 buffer: one bucket group per bucket.
    ASSERT_EQ(layout.bucket_groups.size(), 1u);
}

TEST(DdpLayout, PadBucketsForHighNcclBusbwUsesLcmWith65536) {
    LayoutOptions o                   = distopt(4);
    o.pad_buckets_for_high_nccl_busbw = true;
    Layout layout = compute_layout(worked_example_params(), o);
    EXPECT_EQ(layout.buffers[0].numel, 65536);
    EXPECT_EQ(layout.buffers[0].numel_unpadded, 164);

    o                                 = distopt(3, 50);   // b [0, 50) reaches 50: w gets bucket 1
    o.pad_buckets_for_high_nccl_busbw = true;
    Layout dp3 = compute_layout(worked_example_params(), o);
    ASSERT_EQ(dp3.buffers[0].buckets.size(), 2u);
    EXPECT_EQ(dp3.buffers[0].buckets[0].numel, 196608);
    EXPECT_EQ(dp3.buffers[0].buckets[1].offset, 196608);
    EXPECT_EQ(dp3.buffers[0].numel, 2 * 196608);

    // Without the distributed optimizer nothing is padded.
    o.use_distributed_optimizer = false;
    EXPECT_EQ(compute_layout(worked_example_params(), o).buffers[0].numel, 150);
}

// ---------------------------------------------------------------------------------------------------
// Bucket groups (1.7)

TEST(DdpLayout, BucketGroupsOnePerBucketDenseBeforeExpert) {
    // An expert param registered first still goes after every dense buffer.
    std::vector<ParamSpec> params = {param("x0", {100}, DType::f32, false, true), param("x1", {100}, DType::f32, false, true),
                                     param("a", {100}), param("b", {100}), param("c", {100}, DType::bf16)};
    LayoutOptions o = distopt(2, 100);
    Layout layout   = compute_layout(params, o);
    ASSERT_EQ(layout.buffers.size(), 3u);
    EXPECT_EQ(layout.buffers[0].param_dtype, DType::f32);
    EXPECT_FALSE(layout.buffers[0].is_expert_parallel);
    EXPECT_EQ(layout.buffers[1].param_dtype, DType::bf16);
    EXPECT_TRUE(layout.buffers[2].is_expert_parallel);
    EXPECT_EQ(groups(layout), (Groups{{{0, 0}}, {{0, 1}}, {{1, 0}}, {{2, 0}}, {{2, 1}}}));

    o.force_single_bucket_group = true;
    EXPECT_EQ(groups(compute_layout(params, o)), (Groups{{{0, 0}, {0, 1}, {1, 0}}, {{2, 0}, {2, 1}}}));

    // Without expert params there is no expert group.
    params.erase(params.begin(), params.begin() + 2);
    EXPECT_EQ(groups(compute_layout(params, o)), (Groups{{{0, 0}, {0, 1}, {1, 0}}}));
}

// Megatron's one DDP per model chunk (section 1.5): with a bucket size of 100 elements and the distributed
// optimizer at dp 2, only chunk 0 of pipeline rank 0 is cut into buckets (one group each); chunk 1 is one
// bucket per buffer, its buckets one group; on pipeline rank 1 chunk 0 is unbucketed too, apart from the
// shared embedding's own bucket (two buckets, two groups); --overlap-param-gather-with-optimizer-step
// leaves every chunk unbucketed with one group each. Chunks lay out one after the other, each its dense
// buffers then its expert buffers.
TEST(DdpLayout, LaterChunksAndStagesAreOneBucketAsMegatronsDdpPerChunk) {
    auto in_chunk = [](ParamSpec p, int chunk) {
        p.chunk = chunk;
        return p;
    };
    const std::vector<ParamSpec> params = {
        in_chunk(param("c0.a", {100}), 0), in_chunk(param("c0.b", {100}), 0), in_chunk(param("c0.x", {100}, DType::f32, false, true), 0),
        in_chunk(param("c1.a", {100}), 1), in_chunk(param("c1.b", {100}), 1), in_chunk(param("c1.emb", {100}, DType::f32, true), 1)};
    auto chunks = [](const Layout & l) {
        std::vector<int> c;
        for (const BufferLayout & b : l.buffers) c.push_back(b.chunk);
        return c;
    };
    LayoutOptions o = distopt(2, 100);
    Layout first    = compute_layout(params, o);
    // Buffers: chunk 0 dense (2 buckets), chunk 0 expert (1), chunk 1 dense (the shared embedding alone, the rest).
    EXPECT_EQ(chunks(first), (std::vector<int>{0, 0, 1}));
    ASSERT_EQ(first.buffers.size(), 3u);
    EXPECT_EQ(first.buffers[0].buckets.size(), 2u);
    EXPECT_EQ(first.buffers[2].buckets.size(), 2u) << "the shared embedding keeps a bucket of its own";
    EXPECT_EQ(groups(first), (Groups{{{0, 0}}, {{0, 1}}, {{1, 0}}, {{2, 0}, {2, 1}}}));

    o.pipeline_rank = 1;   // a later stage: no chunk is cut by the size
    Layout later    = compute_layout(params, o);
    EXPECT_EQ(later.buffers[0].buckets.size(), 1u);
    EXPECT_EQ(groups(later), (Groups{{{0, 0}}, {{1, 0}}, {{2, 0}, {2, 1}}}));

    o.pipeline_rank                             = 0;
    o.overlap_param_gather_with_optimizer_step  = true;
    EXPECT_EQ(groups(compute_layout(params, o)), (Groups{{{0, 0}}, {{1, 0}}, {{2, 0}, {2, 1}}}));

    // Chunks must come in order.
    std::vector<ParamSpec> shuffled = {in_chunk(param("a", {10}), 1), in_chunk(param("b", {10}), 0)};
    EXPECT_THROW(compute_layout(shuffled, o), Error);
}

// ---------------------------------------------------------------------------------------------------
// Shards cover every parameter (test_optimizer_shards_cover_every_param)

TEST(DdpLayout, EveryParamElementIsOwnedByExactlyOneRank) {
    std::vector<ParamSpec> params = {param("embedding", {50, 37}, DType::bf16, true), param("ln", {37}),
                                     param("fc1", {37, 148}, DType::bf16), param("fc1.bias", {148}, DType::bf16),
                                     param("expert.fc1", {37, 91}, DType::bf16, false, true),
                                     param("expert.fc2", {91, 37}, DType::bf16, false, true),
                                     param("fc2", {148, 37}, DType::bf16), param("out", {1}, DType::f32)};
    for (int64_t dp : {1, 2, 3, 4, 5, 8, 16, 100}) {
        for (std::optional<int64_t> bucket_size : {std::optional<int64_t>{}, std::optional<int64_t>{1000},
                                                   std::optional<int64_t>{1}}) {
            for (bool busbw : {false, true}) {
                SCOPED_TRACE("dp " + std::to_string(dp) + " bucket " + std::to_string(bucket_size.value_or(0)));
                LayoutOptions o                   = distopt(dp, bucket_size);
                o.edp                             = std::max<int64_t>(1, dp / 2);
                o.pad_buckets_for_high_nccl_busbw = busbw;
                Layout layout = compute_layout(params, o);
                EXPECT_EQ(check_shards_cover_every_param_once(layout, params), total_numel(params));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Validation

TEST(DdpLayout, InvalidOptionsNameTheFlags) {
    std::vector<ParamSpec> params = worked_example_params();
    LayoutOptions          o;
    o.dp = 0;
    EXPECT_NE(error_of([&] { compute_layout(params, o); }).find("--dp"), std::string::npos);
    o.dp  = 2;
    o.edp = 0;
    EXPECT_NE(error_of([&] { compute_layout(params, o); }).find("--edp"), std::string::npos);
    o.edp         = 2;
    o.bucket_size = 0;
    std::string bucket = error_of([&] { compute_layout(params, o); });
    EXPECT_NE(bucket.find("--ddp-bucket-size"), std::string::npos) << bucket;
    EXPECT_NE(bucket.find("--bucket-size"), std::string::npos) << bucket;
    o.bucket_size = std::nullopt;
    params[1].param_dtype = DType::i32;
    std::string dtype = error_of([&] { compute_layout(params, o); });
    EXPECT_NE(dtype.find("'b'"), std::string::npos) << dtype;
    EXPECT_NE(dtype.find("int32"), std::string::npos) << dtype;
    EXPECT_NE(dtype.find("float32, bfloat16 or float16"), std::string::npos) << dtype;
    params[1].param_dtype = DType::f32;
    params[1].shape       = {0, 4};
    EXPECT_NE(error_of([&] { compute_layout(params, o); }).find("no elements"), std::string::npos);
    EXPECT_TRUE(compute_layout({}, o).buffers.empty());
}

namespace {

std::string temp_path(const std::string & name) {
    return testing::TempDir() + "loom_test_ddp_layout_" + std::to_string(::getpid()) + "_" + name;
}

std::string write_file(const std::string & name, const std::string & text) {
    std::string   path = temp_path(name);
    std::ofstream out(path);
    out << text;
    return path;
}

}  // namespace

TEST(DdpLayoutParamFile, ReadsNamesShapesDtypesAndOptions) {
    std::string path = write_file("good.json", R"({"params": [
        ["embedding.word_embeddings.weight", [1000, 95], "bfloat16", {"shared_embedding": true}],
        ["decoder.layers.0.mlp.experts.fc1", [95, 380], "float16", {"allreduce": false}],
        ["decoder.final_layernorm.weight", [95], "float32"]]})");
    std::vector<ParamSpec> specs = read_param_specs(path);
    ASSERT_EQ(specs.size(), 3u);
    EXPECT_EQ(specs[0].name, "embedding.word_embeddings.weight");
    EXPECT_EQ(specs[0].shape, (Shape{1000, 95}));
    EXPECT_EQ(specs[0].param_dtype, DType::bf16);
    EXPECT_TRUE(specs[0].shared_embedding);
    EXPECT_FALSE(specs[0].expert);
    EXPECT_EQ(specs[1].param_dtype, DType::f16);
    EXPECT_TRUE(specs[1].expert);
    EXPECT_FALSE(specs[1].shared_embedding);
    EXPECT_EQ(specs[2].param_dtype, DType::f32);
    EXPECT_EQ(specs[2].numel(), 95);
    std::remove(path.c_str());
}

TEST(DdpLayoutParamFile, BadFilesNameTheFileAndTheEntry) {
    struct Case {
        const char * name;
        const char * text;
        const char * expect;   // in the message
    };
    const Case cases[] = {
        {"notjson", "{\"params\": [", "is not JSON"},
        {"noparams", "{\"parameters\": []}", "no \"params\" list"},
        {"empty", "{\"params\": []}", "lists no parameters"},
        {"notarray", "{\"params\": [{\"name\": \"w\"}]}", "entry 0: is not [name, shape, dtype, options?]"},
        {"short", "{\"params\": [[\"w\", [4]]]}", "entry 0: is not [name, shape, dtype, options?]"},
        {"noname", "{\"params\": [[\"\", [4], \"float32\"]]}", "entry 0: the name is not a non-empty string"},
        {"baddtype", "{\"params\": [[\"w\", [4], \"float32\"], [\"b\", [4], \"int32\"]]}",
         "entry 1 ('b'): unknown parameter dtype 'int32'"},
        {"zerodim", "{\"params\": [[\"w\", [4, 0], \"float32\"]]}", "entry 0 ('w'): dimension 0 is not an integer >= 1"},
        {"negdim", "{\"params\": [[\"w\", [-3], \"float32\"]]}", "entry 0 ('w'): dimension -3"},
        {"noshape", "{\"params\": [[\"w\", [], \"float32\"]]}", "entry 0 ('w'): the shape"},
        {"duplicate", "{\"params\": [[\"w\", [4], \"float32\"], [\"w\", [4], \"float32\"]]}",
         "entry 1 ('w'): the name appears twice"},
        {"badoption", "{\"params\": [[\"w\", [4], \"float32\", {\"shared\": true}]]}", "unknown option 'shared'"},
        {"badoptionvalue", "{\"params\": [[\"w\", [4], \"float32\", {\"allreduce\": 0}]]}", "not true or false"},
    };
    for (const Case & c : cases) {
        std::string path  = write_file(std::string(c.name) + ".json", c.text);
        std::string error = error_of([&] { read_param_specs(path); });
        EXPECT_NE(error.find(path), std::string::npos) << c.name << ": " << error;
        EXPECT_NE(error.find(c.expect), std::string::npos) << c.name << ": " << error;
        const size_t hint = error.rfind(" | ");
        ASSERT_NE(hint, std::string::npos) << c.name;
        EXPECT_NE(error.find("\"params\"", hint), std::string::npos) << c.name << ": the hint shows the form: " << error;
        std::remove(path.c_str());
    }
    std::string missing = temp_path("does_not_exist.json");
    std::string error   = error_of([&] { read_param_specs(missing); });
    EXPECT_NE(error.find("cannot read params file '" + missing + "'"), std::string::npos) << error;
}

// ---------------------------------------------------------------------------------------------------
// JSON and table views

TEST(DdpLayoutViews, JsonOfTheWorkedExampleFollowsTheSchemaInOrder) {
    std::vector<ParamSpec> params = worked_example_params();
    Layout                 layout = compute_layout(params, distopt(4));
    nlohmann::ordered_json j      = nlohmann::ordered_json::parse(layout_json(layout, params, true));
    std::vector<std::string> top;
    for (const auto & [key, value] : j.items()) top.push_back(key);
    EXPECT_EQ(top, (std::vector<std::string>{"buffers", "bucket_groups", "shards"}));
    std::vector<std::string> keys;
    for (const auto & [key, value] : j["buffers"][0].items()) keys.push_back(key);
    EXPECT_EQ(keys, (std::vector<std::string>{"param_dtype", "grad_dtype", "is_expert_parallel",
                                              "data_parallel_world_size", "param_index_map", "bucket_indices",
                                              "numel", "numel_unpadded", "buckets", "chunk"}));
    EXPECT_EQ(j["buffers"][0]["param_index_map"].dump(), R"([["b",0,50,0],["w",64,164,0]])");
    EXPECT_EQ(j["buffers"][0]["buckets"].dump(), R"([{"bucket_id":0,"offset":0,"numel":256,"numel_unpadded":164}])");
    EXPECT_EQ(j["shards"].dump(),
              R"([[[[["b",0,50,0,50,0,50,0,50]]],[[["w",64,128,64,128,0,64,0,64]]],)"
              R"([[["w",128,164,128,164,0,36,64,100]]],[[]]]])");
    EXPECT_FALSE(nlohmann::json::parse(layout_json(layout, params, false)).contains("shards"));
}

TEST(DdpLayoutViews, TableShowsABarPerBucketALegendAndTheShards) {
    std::vector<ParamSpec> params = worked_example_params();
    Layout                 layout = compute_layout(params, distopt(4));
    std::string            table  = layout_table(layout, params, true);
    EXPECT_EQ(table, layout_table(layout, params, true));   // deterministic
    EXPECT_NE(table.find("buffer 0: params float32, grads float32, dense, dp 4 | numel 256, unpadded 164, "
                         "padding 92 (35.9%)"),
              std::string::npos)
        << table;
    // 60 cells over 256 elements (cell i covers [256i/60, 256(i+1)/60)): b [0,50) is 'a', w [64,164) is 'b',
    // the rest padding; a cell half param, half padding shows the param.
    size_t bar = table.find('|', table.find("bucket 0"));
    ASSERT_NE(bar, std::string::npos) << table;
    std::string cells = table.substr(bar + 1, 60);
    EXPECT_EQ(table[bar + 61], '|') << table;
    EXPECT_EQ(cells, std::string(12, 'a') + std::string(3, '.') + std::string(24, 'b') + std::string(21, '.')) << table;
    EXPECT_NE(table.find("a  b     [0, 50)"), std::string::npos) << table;
    EXPECT_NE(table.find("rank 2   [128, 192)"), std::string::npos) << table;
    EXPECT_NE(table.find("w[64, 100)"), std::string::npos) << table;
    EXPECT_NE(table.find("(padding only)"), std::string::npos) << table;
    EXPECT_NE(table.find("bucket groups (buffer.bucket): [0.0]"), std::string::npos) << table;
    EXPECT_EQ(layout_table(layout, params, false).find("shards"), std::string::npos);
}

TEST(DdpLayoutViews, TableBarShowsParamsTooSmallToWinACell) {
    // Reverse order: big [0, 6000), tiny [6000, 6010), big2 [6010, 12010): tiny covers 1/6 of a cell.
    std::vector<ParamSpec> params = {param("big2", {6000}), param("tiny", {10}), param("big", {6000})};
    LayoutOptions          o;
    Layout                 layout = compute_layout(params, o);
    std::string            table  = layout_table(layout, params, false);
    size_t                 bar    = table.find('|', table.find("bucket 0"));
    ASSERT_NE(bar, std::string::npos) << table;
    std::string cells = table.substr(bar + 1, 60);
    EXPECT_EQ(std::count(cells.begin(), cells.end(), 'b'), 1) << table;
    EXPECT_EQ(std::count(cells.begin(), cells.end(), 'a') + std::count(cells.begin(), cells.end(), 'c'), 59) << table;
}

// ---------------------------------------------------------------------------------------------------
// loom layout

namespace {

class LoomLayoutCli : public testing::Test {
protected:
    void SetUp() override {
        path_ = write_file("cli.json", R"({"params": [["w", [100], "float32"], ["b", [50], "float32"]]})");
    }
    void TearDown() override { std::remove(path_.c_str()); }

    CliRun stdout_of(const std::string & args) { return run_loom("layout --params " + path_ + " " + args, "2>/dev/null"); }
    CliRun stderr_of(const std::string & args) { return run_loom("layout " + args, "2>&1 >/dev/null"); }

    std::string path_;
};

}  // namespace

TEST_F(LoomLayoutCli, JsonMatchesTheWorkedExampleWithShards) {
    CliRun r = stdout_of("--dp 4 --use-distributed-optimizer --json");
    ASSERT_EQ(r.status, 0) << r.out;
    nlohmann::json j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j["buffers"].size(), 1u);
    const nlohmann::json & b = j["buffers"][0];
    EXPECT_EQ(b["param_dtype"], "float32");
    EXPECT_EQ(b["grad_dtype"], "float32");
    EXPECT_EQ(b["is_expert_parallel"], false);
    EXPECT_EQ(b["data_parallel_world_size"], 4);
    EXPECT_EQ(b["param_index_map"].dump(), R"([["b",0,50,0],["w",64,164,0]])");
    EXPECT_EQ(b["bucket_indices"].dump(), "[[0,256]]");
    EXPECT_EQ(b["numel"], 256);
    EXPECT_EQ(b["numel_unpadded"], 164);
    EXPECT_EQ(j["bucket_groups"].dump(), "[[[0,0]]]");
    ASSERT_EQ(j["shards"][0].size(), 4u);
    EXPECT_EQ(j["shards"][0][0].dump(), R"([[["b",0,50,0,50,0,50,0,50]]])");
    EXPECT_EQ(j["shards"][0][1].dump(), R"([[["w",64,128,64,128,0,64,0,64]]])");
    EXPECT_EQ(j["shards"][0][2].dump(), R"([[["w",128,164,128,164,0,36,64,100]]])");
    EXPECT_EQ(j["shards"][0][3].dump(), "[[]]");
}

TEST_F(LoomLayoutCli, WithoutDistoptThereAreNoShardsAndNoPadding) {
    CliRun r = stdout_of("--dp 4 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_FALSE(j.contains("shards"));
    EXPECT_EQ(j["buffers"][0]["param_index_map"].dump(), R"([["b",0,50,0],["w",50,150,0]])");
    EXPECT_EQ(j["buffers"][0]["numel"], 150);
}

// The stage and chunk from the command line: two chunks of the worked example's parameters at a bucket size
// of 40 cut chunk 0 on pipeline rank 0 (two buckets), chunk 1 never; on pipeline rank 1 neither.
TEST_F(LoomLayoutCli, ChunksAndThePipelineRankFollowMegatronsBucketing) {
    const std::string chunked = write_file("chunks.json", R"({"params": [["w", [100], "float32"], ["b", [50], "float32"],
        ["w1", [100], "float32", {"chunk": 1}], ["b1", [50], "float32", {"chunk": 1}]]})");
    CliRun first = run_loom("layout --params " + chunked + " --dp 2 --bucket-size 40 --json", "2>/dev/null");
    ASSERT_EQ(first.status, 0) << first.out;
    nlohmann::json j = nlohmann::json::parse(first.out);
    ASSERT_EQ(j["buffers"].size(), 2u);
    EXPECT_EQ(j["buffers"][0]["chunk"], 0);
    EXPECT_EQ(j["buffers"][1]["chunk"], 1);
    EXPECT_EQ(j["buffers"][0]["bucket_indices"].dump(), "[[0,50],[50,150]]");
    EXPECT_EQ(j["buffers"][1]["bucket_indices"].dump(), "[[0,150]]");
    CliRun later = run_loom("layout --params " + chunked + " --dp 2 --bucket-size 40 --pipeline-rank 1 --json", "2>/dev/null");
    ASSERT_EQ(later.status, 0) << later.out;
    j = nlohmann::json::parse(later.out);
    EXPECT_EQ(j["buffers"][0]["bucket_indices"].dump(), "[[0,150]]");
    EXPECT_EQ(j["bucket_groups"].dump(), "[[[0,0]],[[1,0]]]");
    CliRun table = run_loom("layout --params " + chunked + " --dp 2", "2>/dev/null");
    EXPECT_NE(table.out.find("buffer 1 (chunk 1)"), std::string::npos) << table.out;
    std::remove(chunked.c_str());
}

TEST_F(LoomLayoutCli, TableModePrintsBars) {
    CliRun r = stdout_of("--dp 4 --use-distributed-optimizer");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("|aaaaaaaaaaaa...bbbb"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("shards of bucket 0: 64 elements per rank"), std::string::npos) << r.out;
}

TEST_F(LoomLayoutCli, MegatronSpellingsAndEdpDefault) {
    std::string bf16 = write_file("bf16.json", R"({"params": [["w", [100], "bfloat16"], ["b", [50], "bfloat16"]]})");
    CliRun a = run_loom("layout --params " + bf16 + " --dp 2 --bucket-size 50 --grad-reduce-in-fp32 "
                        "--use-distributed-optimizer --json", "2>/dev/null");
    CliRun b = run_loom("layout --params " + bf16 + " --dp 2 --ddp-bucket-size 50 --accumulate-allreduce-grads-in-fp32 "
                        "--use-distributed-optimizer --json", "2>/dev/null");
    std::remove(bf16.c_str());
    ASSERT_EQ(a.status, 0);
    EXPECT_EQ(a.out, b.out);
    nlohmann::json j = nlohmann::json::parse(a.out);
    EXPECT_EQ(j["buffers"][0]["param_dtype"], "bfloat16");
    EXPECT_EQ(j["buffers"][0]["grad_dtype"], "float32");
    EXPECT_EQ(j["buffers"][0]["buckets"].size(), 2u);   // b reaches 50 and closes bucket 0
    CliRun busbw = stdout_of("--dp 4 --use-distributed-optimizer --ddp-pad-buckets-for-high-nccl-busbw --json");
    ASSERT_EQ(busbw.status, 0);
    EXPECT_EQ(nlohmann::json::parse(busbw.out)["buffers"][0]["numel"], 65536);

    std::string expert = write_file("expert.json", R"({"params": [["w", [100], "bfloat16"],
        ["x", [100], "bfloat16", {"allreduce": false}]]})");
    CliRun e = run_loom("layout --params " + expert + " --dp 3 --json", "2>/dev/null");
    ASSERT_EQ(e.status, 0);
    nlohmann::json ej = nlohmann::json::parse(e.out);
    EXPECT_EQ(ej["buffers"][1]["is_expert_parallel"], true);
    EXPECT_EQ(ej["buffers"][1]["data_parallel_world_size"], 3);
    e  = run_loom("layout --params " + expert + " --dp 3 --edp 2 --json", "2>/dev/null");
    ej = nlohmann::json::parse(e.out);
    EXPECT_EQ(ej["buffers"][1]["data_parallel_world_size"], 2);
    std::remove(expert.c_str());
}

TEST_F(LoomLayoutCli, BadInputExitsTwoNamingTheFlagOrFileWithNothingOnStdout) {
    std::string missing = temp_path("missing.json");
    std::string bad     = write_file("bad_dtype.json", R"({"params": [["w", [4], "int32"]]})");
    struct Case {
        std::string args;
        std::string expect;   // on stderr
    };
    const Case cases[] = {
        {"--params " + missing, missing},
        {"--params " + bad, "unknown parameter dtype 'int32'"},
        {"--params " + path_ + " --dp 0", "--dp"},
        {"--params " + path_ + " --bucket-size 0", "--ddp-bucket-size"},
        {"--params " + path_ + " --edp 0", "--edp"},
        {"--dp 2", "--params"},
        {"--params " + path_ + " --dp two", "--dp"},
    };
    for (const Case & c : cases) {
        CliRun out = run_loom("layout " + c.args, "2>/dev/null");
        EXPECT_EQ(out.status, 2) << c.args;
        EXPECT_EQ(out.out, "") << c.args;
        CliRun err = stderr_of(c.args);
        EXPECT_NE(err.out.find(c.expect), std::string::npos) << c.args << ": " << err.out;
    }
    std::remove(bad.c_str());
}

TEST_F(LoomLayoutCli, HelpDocumentsTheBucketSizeDefault) {
    CliRun r = run_loom("layout --help", "2>/dev/null");
    EXPECT_EQ(r.status, 0);
    EXPECT_NE(r.out.find("--ddp-bucket-size"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("no size limit"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("max(40M, 1M*dp)"), std::string::npos) << r.out;
}
