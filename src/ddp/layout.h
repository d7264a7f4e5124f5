// The layout of DDP's contiguous param-and-grad buffers: which parameters share a buffer, where each
// one sits, how buffers split into buckets and buckets into bucket groups, and which range of every
// parameter each data-parallel rank owns under the distributed optimizer. Pure functions of the
// parameter list and the options: the trainer, `loom layout` and the tests all compute it here.
//
// Rules (docs/design/ddp_and_optimizers.md sections 1.3-1.7 and 2.2; the section numbers below refer to that document):
//   - model chunks (virtual pipeline stages on this rank) lay out separately, chunk by chunk, as Megatron's
//     one DDP per chunk does: only chunk 0 of pipeline rank 0 is cut by bucket_size; every later chunk, and
//     every chunk of a later pipeline rank, is one bucket per buffer (Megatron's bucket_size=None), and a
//     later chunk's buckets form one group (disable_bucketing); overlap_param_gather_with_optimizer_step
//     does both for every chunk (section 1.5);
//   - within a chunk, one buffer per key (param dtype, grad dtype, expert), keys in order of first
//     appearance; grad dtype is f32 with grad_reduce_in_fp32, else the param dtype; the chunk's dense
//     buffers come first in Layout::buffers, then its expert buffers;
//   - parameters are placed in REVERSE registration order (bucket 0 holds the model's last layers);
//   - without the distributed optimizer: no padding, no alignment; a bucket closes after the parameter
//     that makes it reach bucket_size; no shared-embedding rule;
//   - with it: every parameter starts at a multiple of 64 elements, every bucket's end is padded to a
//     multiple of lcm(dp, 128) (lcm(dp, 128, 65536) with pad_buckets_for_high_nccl_busbw), where dp is
//     the buffer's sharding group (edp for expert buffers), and a shared-embedding parameter always gets
//     a bucket of its own (the open bucket is closed before it, at its aligned start);
//   - bucket groups: one per bucket, buffer by buffer, dense then expert; with force_single_bucket_group
//     all buckets of the dense buffers form one group (and the expert ones another);
//   - fsdp_units (Megatron-FSDP): a bucket closes wherever the unit changes (the distributed optimizer's
//     padding when sharded), never by size, and a unit's buckets in every buffer form its one group;
//   - shard ranges: bucket [off, off + S) splits into dp shards of S / dp; rank r's four ranges of each
//     parameter it overlaps are as in section 2.2.
//
// Worked example (sections 1.4, 2.2): distributed optimizer, dp 4, params w (100) then b (50), no bucket size.
//   b [0, 50); w at pad(50, 64) = 64: [64, 164); bucket 0 unpadded 164, padded to lcm(4, 128): 256.
//   shards of 64: rank 0 owns b [0, 50); rank 1 w [0, 64); rank 2 w [64, 100) (local [0, 36), world
//   [128, 164)); rank 3 only padding.
// The bucket closed before a shared embedding ends at the embedding's 64-aligned start (its unpadded size
// counts the alignment gap) and is then padded as any bucket; older Megatron releases padded that end to
// lcm(dp, 128) first when it was not divisible by dp, which Megatron's current code (and Loom) no longer does.
#pragma once

#include "core/dtype.h"
#include "core/tensor.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::ddp {

// A parameter as the layout sees it, in registration (forward) order.
struct ParamSpec {
    std::string name;
    Shape       shape;
    DType       param_dtype      = DType::f32;
    bool        shared_embedding = false;
    bool        expert           = false;   // allreduce == false: reduced over expert data parallel
    int         chunk            = 0;       // the model chunk (virtual stage) on this rank; chunks in order
    int         unit             = 0;       // the FSDP unit (module) it belongs to: embedding 0, layer i at
                                            // i + 1, the final norm and output layer last (fsdp_units only)
    bool        fp8_codes        = false;   // --fp8-param-gather: its values travel as FP8 codes (a u8
                                            // buffer; param_dtype stays the dtype its gradients take)

    int64_t numel() const;
};

struct LayoutOptions {
    int64_t                dp  = 1;   // size of the group that reduces / shards dense buffers
    int64_t                edp = 1;   // the same for expert buffers
    bool                   use_distributed_optimizer       = false;
    std::optional<int64_t> bucket_size;                      // elements; nullopt: no size limit
    bool                   pad_buckets_for_high_nccl_busbw = false;
    bool                   grad_reduce_in_fp32             = false;
    bool                   force_single_bucket_group       = false;
    int64_t                pipeline_rank                   = 0;       // > 0: no bucket_size limit
    bool                   overlap_param_gather_with_optimizer_step = false;   // every chunk unbucketed
    // Megatron-FSDP: each unit's parameters form one bucket per buffer (bucket_size is not used), and each
    // unit's buckets, in every buffer, one bucket group; groups in placement order (the last unit first).
    bool                   fsdp_units = false;
};

// Megatron's default bucket size: max(40'000'000, 1'000'000 * dp) elements.
int64_t default_bucket_size(int64_t dp);

// The padding helpers of the distributed-optimizer layout (section 1.4 (b)):
//   pad_to_divisor(x, m)  = ceil(x / m) * m
//   pad_param_start(pos)  = pad_to_divisor(pos, 64)                 0 -> 0, 1 -> 64, 63 -> 64, 65 -> 128
//   bucket_end_divisor    = lcm(dp, 128), or lcm(dp, 128, 65536) with pad_buckets_for_high_nccl_busbw
//   pad_bucket_end(end)   = pad_to_divisor(end, bucket_end_divisor)
inline constexpr int64_t kParamStartAlignment   = 64;      // elements, not bytes
inline constexpr int64_t kBucketEndAlignment    = 128;
inline constexpr int64_t kHighNcclBusbwDivisor  = 65536;   // 2^16

int64_t pad_to_divisor(int64_t x, int64_t divisor);
int64_t pad_param_start(int64_t pos);
int64_t bucket_end_divisor(int64_t dp, bool pad_buckets_for_high_nccl_busbw);
int64_t pad_bucket_end(int64_t end, int64_t dp, bool pad_buckets_for_high_nccl_busbw);

struct ParamPlace {
    int     param  = 0;   // index into the ParamSpec list
    int64_t start  = 0;   // [start, end) in the buffer's element space
    int64_t end    = 0;
    int     bucket = 0;
};

struct BucketLayout {
    int              id             = 0;
    int64_t          offset         = 0;   // start in the buffer
    int64_t          numel          = 0;   // padded size (end - offset)
    int64_t          numel_unpadded = 0;   // up to the last param's end, alignment gaps included (before a
                                           // shared embedding: up to its 64-aligned start)
    std::vector<int> params;               // ParamSpec indices, in placement order
};

struct BufferLayout {
    int                       chunk       = 0;   // the model chunk it holds
    DType                     param_dtype = DType::f32;
    DType                     grad_dtype  = DType::f32;
    bool                      is_expert_parallel = false;
    int64_t                   data_parallel_world_size = 1;   // dp, or edp for expert buffers
    std::vector<ParamPlace>   params;    // placement order (reverse registration)
    std::vector<BucketLayout> buckets;
    int64_t                   numel = 0;            // the last bucket's padded end
    int64_t                   numel_unpadded = 0;   // sum of the buckets' numel_unpadded

    const ParamPlace & place_of(int param) const;   // throws if the parameter is not in this buffer
};

struct BucketRef {
    int buffer = 0;   // index into Layout::buffers
    int bucket = 0;
};

struct Layout {
    std::vector<BufferLayout>           buffers;         // by chunk: its dense buffers, then its expert buffers
    std::vector<std::vector<BucketRef>> bucket_groups;   // by chunk: its dense groups, then its expert groups
};

// Validates the options (dp >= 1, bucket_size >= 1 when given; errors name the flags) and computes
// the layout of `params`.
Layout compute_layout(const std::vector<ParamSpec> & params, const LayoutOptions & options);

// The four ranges (section 2.2) of one parameter piece that one DP rank owns.
struct ShardRange {
    int     param = 0;
    int64_t gbuf_world_start = 0, gbuf_world_end = 0;                     // in the buffer
    int64_t gbuf_world_in_bucket_start = 0, gbuf_world_in_bucket_end = 0; // in the bucket
    int64_t gbuf_local_start = 0, gbuf_local_end = 0;                     // in the rank's shard of the bucket
    int64_t param_start = 0, param_end = 0;                               // in the flattened parameter
};

// Per bucket of `buffer`, the pieces `rank` owns, in the bucket's placement order. Needs the
// distributed optimizer's padding (every bucket's numel divisible by the buffer's dp); throws if a
// bucket is not, or if rank is outside [0, dp).
std::vector<std::vector<ShardRange>> shard_ranges(const BufferLayout & buffer, int64_t rank);

// `loom layout`'s outputs: the JSON object of the schema ("shards" only when with_shards), and
// a readable table with one bar per bucket showing its parameters and padding.
std::string layout_json(const Layout & layout, const std::vector<ParamSpec> & params, bool with_shards);
std::string layout_table(const Layout & layout, const std::vector<ParamSpec> & params, bool with_shards);

// Reads `loom layout --params FILE.json`: {"params": [[name, [shape...], dtype, {"shared_embedding":
// true, "allreduce": false, "chunk": 1}?], ...]}; errors name the file and the entry.
std::vector<ParamSpec> read_param_specs(const std::string & path);

}  // namespace loom::ddp
