#include "plan/meta_device.h"

#include "core/error.h"
#include "core/ops.h"

#include <sys/mman.h>

namespace loom::plan {

namespace {

// Address space, reserved and never written: MAP_NORESERVE pages cost nothing until touched.
class ReservedMemory final : public RawMemory {
public:
    void * raw_alloc(size_t bytes) override {
        void * p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        LOOM_CHECK(p != MAP_FAILED, "the meta device could not reserve " << bytes << " bytes of address space",
                   "plan a smaller model or layout per rank (the plan holds one rank's address space)");
        return p;
    }
    void raw_free(void * ptr, size_t bytes) override { ::munmap(ptr, bytes); }
};

class MetaEvent final : public Event {
public:
    bool query() override { return true; }
    void synchronize() override {}
};

// Drops its work: nothing runs, and the tensors the work held are given back at once.
class MetaStream final : public Stream {
public:
    MetaStream(Device & device, std::string name) : device_(device), name_(std::move(name)) {}
    Device &            device() override { return device_; }
    const std::string & name() const override { return name_; }
    void                submit(std::function<void()>, const char *) override {}
    void                record(Event &) override {}
    void                wait(Event &) override {}
    void                synchronize() override {}
    bool                query() override { return true; }

private:
    Device &    device_;
    std::string name_;
};

// Every kernel, doing nothing (the signatures are core/ops.h's).
class MetaOps final : public Ops {
public:
    void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c, bool accumulate) override {}
    void gemm_bias(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c, const Tensor & bias) override {}
    void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd, float eps) override {}
    void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y, const Tensor & rstd, float eps) override {}
    void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & mean, const Tensor & rstd, const Tensor & dx, const Tensor & dgamma, const Tensor & dbeta) override {}
    void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & rstd, const Tensor & dx, const Tensor & dgamma) override {}
    void bias_add(Stream & s, const Tensor & y, const Tensor & bias) override {}
    void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) override {}
    void add_inplace(Stream & s, const Tensor & y, const Tensor & x) override {}
    void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y, const Tensor & x_bf16) override {}
    void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {}
    void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) override {}
    void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {}
    void squared_relu_forward(Stream & s, const Tensor & x, const Tensor & y) override {}
    void squared_relu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {}
    void rope(Stream & s, const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d, float base, bool inverse, int64_t rotary_dim, bool interleaved, const SeqPositions & positions) override {}
    void dropout(Stream & s, const Tensor & x, const Tensor & y, const Dropout & key) override {}
    void embedding_forward(Stream & s, const Tensor & tokens, const Tensor & wte, const Tensor & wpe, const Tensor & out, const SeqPositions & positions) override {}
    void embedding_backward(Stream & s, const Tensor & tokens, const Tensor & dout, const Tensor & dwte, const Tensor & dwpe, const SeqPositions & positions) override {}
    void vocab_shard_ids(Stream & s, const Tensor & ids, int64_t begin, int64_t count, const Tensor & out) override {}
    void attention_forward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & lse, const AttentionShape & shape, float scale, const Dropout & dropout) override {}
    void attention_backward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & dout, const Tensor & lse, const Tensor & dq, const Tensor & dkv, const AttentionShape & shape, float scale, const Dropout & dropout, bool accumulate) override {}
    void attention_merge(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & part_out, const Tensor & part_lse, const AttentionShape & shape) override {}
    void cross_entropy_forward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & loss, const Tensor & lse, int64_t vocab) override {}
    void cross_entropy_backward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & lse, const Tensor & dloss, int64_t vocab) override {}
    void row_max(Stream & s, const Tensor & logits, int64_t valid, const Tensor & out) override {}
    void row_sum_exp(Stream & s, const Tensor & logits, const Tensor & max, int64_t valid, const Tensor & out) override {}
    void label_logit(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & out) override {}
    void lse_and_loss(Stream & s, const Tensor & max, const Tensor & sum, const Tensor & target, const Tensor & lse, const Tensor & loss) override {}
    void loss_grad(Stream & s, const Tensor & mask, double scale, const Tensor & dloss) override {}
    void convert(Stream & s, const Tensor & src, const Tensor & dst) override {}
    void round_to_bf16(Stream & s, const Tensor & x, const Tensor & x_bf16) override {}
    void copy(Stream & s, const Tensor & src, const Tensor & dst) override {}
    void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col, int64_t width) override {}
    void fill_zero(Stream & s, const Tensor & t) override {}
    void scale(Stream & s, const Tensor & t, float factor) override {}
    void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) override {}
    void moe_topk(Stream & s, const Tensor & logits, const MoeRouting & routing, const Tensor & top_idx, const Tensor & probs) override {}
    void moe_sinkhorn_topk(Stream & s, const Tensor & logits, int64_t first, const MoeRouting & routing, const Tensor & top_idx, const Tensor & probs) override {}
    void moe_aux_counts(Stream & s, const Tensor & logits, const MoeRouting & routing, int64_t groups, const Tensor & counts) override {}
    void moe_router_losses(Stream & s, const Tensor & logits, const Tensor & counts, const MoeRouting & routing, const MoeRouterLoss & loss, const Tensor & losses) override {}
    void moe_router_backward(Stream & s, const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs, const Tensor & counts, const MoeRouting & routing, const MoeRouterLoss & loss, float loss_scale, const Tensor & dlogits) override {}
    void moe_plan(Stream & s, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec, const Tensor & plan_probs, const Tensor & row_of, const Tensor & token_of_row, const Tensor & tokens_per_expert) override {}
    void moe_plan_experts(Stream & s, const Tensor & row_of, const Tensor & tokens_per_expert, const Tensor & expert_of) override {}
    void moe_gather_rows(Stream & s, const Tensor & x, const Tensor & index, const Tensor & out) override {}
    void moe_combine(Stream & s, const Tensor & src, const Tensor & row_of, const Tensor & weights, const Tensor & dst) override {}
    void moe_combine_backward(Stream & s, const Tensor & dy, const Tensor & src, const Tensor & weights, const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc, const Tensor & dweights) override {}
    void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v, const Tensor & out, const AdamStep & step) override {}
};

class DoneWork final : public comm::Work {
public:
    void wait() override {}
    bool test() override { return true; }
};

}  // namespace

MetaDevice::MetaDevice()
    : device_memory_(std::make_unique<Allocator>(std::make_unique<ReservedMemory>(), MemoryKind::device, "meta")),
      pinned_memory_(std::make_unique<Allocator>(std::make_unique<ReservedMemory>(), MemoryKind::pinned_host, "meta-pinned")),
      ops_(std::make_unique<MetaOps>()),
      compute_(std::make_unique<MetaStream>(*this, "compute")) {}

MetaDevice::~MetaDevice() = default;

Allocator & MetaDevice::allocator(MemoryKind kind) {
    LOOM_CHECK(kind != MemoryKind::pageable_host, "the meta device has no pageable host allocator", "");
    return kind == MemoryKind::device ? *device_memory_ : *pinned_memory_;
}

std::unique_ptr<Stream> MetaDevice::stream_create(const std::string & name) { return std::make_unique<MetaStream>(*this, name); }
std::unique_ptr<Event>  MetaDevice::event_create() { return std::make_unique<MetaEvent>(); }
Ops &                   MetaDevice::ops() { return *ops_; }
Stream &                MetaDevice::compute_stream() { return *compute_; }

MetaCommunicator::MetaCommunicator(std::vector<int> global_ranks, int rank, std::string name)
    : global_ranks_(std::move(global_ranks)), rank_(rank), name_(std::move(name)) {}

comm::WorkPtr MetaCommunicator::done() { return std::make_shared<DoneWork>(); }

std::shared_ptr<comm::Communicator> MetaCommunicatorFactory::world() {
    std::vector<int> all(static_cast<size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) all[static_cast<size_t>(r)] = r;
    return std::make_shared<MetaCommunicator>(all, rank_, "world");
}

std::shared_ptr<comm::Communicator> MetaCommunicatorFactory::split(const std::vector<std::vector<int>> & groups,
                                                                   const std::string & name) {
    for (const std::vector<int> & group : groups) {
        for (size_t i = 0; i < group.size(); ++i) {
            if (group[i] == rank_) return std::make_shared<MetaCommunicator>(group, static_cast<int>(i), name);
        }
    }
    return nullptr;
}

}  // namespace loom::plan
