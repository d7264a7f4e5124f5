#include "plan/meta_device.h"

#include "backend/cpu/moe.h"
#include "core/error.h"
#include "core/ops.h"

#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace loom::plan {

namespace {

// Address space, reserved: MAP_NORESERVE pages cost nothing until touched. Blocks come from one arena
// reserved at the first allocation (one mmap: a layout search sets up hundreds of ranks, and a system call per
// block took most of its time); past the arena, or where the system refuses so large a reservation, each block
// is reserved by itself. An arena outlives its device: the next device of the same arena size takes it back,
// so the pages an earlier plan touched (its batches' tokens, its routing counts) are not faulted in again
// (the page faults were a fifth of a layout search's time). The plan never reads a value it did not write.
class ArenaPool {
public:
    static ArenaPool & instance() {
        static ArenaPool pool;
        return pool;
    }
    char * take(size_t bytes) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = free_.begin(); it != free_.end(); ++it) {
            if (it->second != bytes) continue;
            char * arena = it->first;
            free_.erase(it);
            return arena;
        }
        return nullptr;
    }
    void give(char * arena, size_t bytes) {
        std::lock_guard<std::mutex> lock(mutex_);
        free_.emplace_back(arena, bytes);
    }

private:
    std::mutex                                 mutex_;
    std::vector<std::pair<char *, size_t>>     free_;
};

class ReservedMemory final : public RawMemory {
public:
    explicit ReservedMemory(size_t arena_bytes) : arena_bytes_(arena_bytes) {}
    ~ReservedMemory() override {
        if (arena_ != nullptr) ArenaPool::instance().give(arena_, arena_bytes_);
    }
    void * raw_alloc(size_t bytes) override {
        constexpr size_t kPage = 4096;
        const size_t     size  = (bytes + kPage - 1) / kPage * kPage;
        if (arena_ == nullptr && !arena_refused_) {
            arena_ = ArenaPool::instance().take(arena_bytes_);
            if (arena_ == nullptr) {
                void * p = ::mmap(nullptr, arena_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
                if (p == MAP_FAILED) arena_refused_ = true;
                else arena_ = static_cast<char *>(p);
            }
        }
        if (arena_ != nullptr && used_ + size <= arena_bytes_) {
            void * p = arena_ + used_;
            used_ += size;
            return p;
        }
        void * p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        LOOM_CHECK(p != MAP_FAILED, "the meta device could not reserve " << bytes << " bytes of address space",
                   "plan a smaller model or layout per rank (the plan holds one rank's address space)");
        return p;
    }
    // The arena's blocks go back with it (the caching allocator reuses freed blocks itself).
    void raw_free(void * ptr, size_t bytes) override {
        const char * p = static_cast<const char *>(ptr);
        if (arena_ != nullptr && p >= arena_ && p < arena_ + arena_bytes_) return;
        ::munmap(ptr, bytes);
    }

private:
    size_t arena_bytes_;
    char * arena_         = nullptr;
    size_t used_          = 0;
    bool   arena_refused_ = false;
};

class MetaEvent final : public Event {
public:
    explicit MetaEvent(MetaClock & clock) : clock_(clock) {}
    bool query() override { return true; }
    void synchronize() override { clock_.wait_until(time); }

    double time = 0;   // when the work before its record ends

private:
    MetaClock & clock_;
};

// Drops its work: nothing runs, and the tensors the work held are given back at once. Its clock is when the
// work issued on it so far ends.
class MetaStream final : public Stream {
public:
    MetaStream(Device & device, MetaClock & clock, std::string name) : device_(device), clock_(clock), name_(std::move(name)) {}
    Device &            device() override { return device_; }
    const std::string & name() const override { return name_; }
    void                submit(std::function<void()>, const char *) override {}
    void                record(Event & event) override { static_cast<MetaEvent &>(event).time = std::max(time, clock_.host); }
    void                wait(Event & event) override { time = std::max(time, static_cast<MetaEvent &>(event).time); }
    void                synchronize() override { clock_.wait_until(time); }
    bool                query() override { return true; }
    std::optional<double> modelled_seconds() const override {
        if (!clock_.costs) return std::nullopt;
        return std::max(time, clock_.host);
    }

    double time = 0;

private:
    Device &    device_;
    MetaClock & clock_;
    std::string name_;
};

// An op's cost from its tensors: FLOPs on tensor cores (GEMMs and attention) and bytes of memory traffic.
double bytes_of(std::initializer_list<const Tensor *> tensors) {
    double total = 0;
    for (const Tensor * t : tensors) {
        if (t->defined()) total += static_cast<double>(t->nbytes());
    }
    return total;
}

// sum over p in [lo, hi] of clamp(p - a + 1, 0, len): the keys at positions a, ..., a + len - 1 that a query at
// position p sees.
double visible_keys(int64_t lo, int64_t hi, int64_t a, int64_t len) {
    if (len <= 0 || hi < lo) return 0;
    double        total = 0;
    const int64_t ramp_lo = std::max(lo, a), ramp_hi = std::min(hi, a + len - 2);   // 1 .. len - 1 keys
    if (ramp_lo <= ramp_hi) {
        const double n = static_cast<double>(ramp_hi - ramp_lo + 1);
        total += n * (static_cast<double>(ramp_lo - a + 1) + static_cast<double>(ramp_hi - a + 1)) / 2;
    }
    const int64_t full_lo = std::max(lo, a + len - 1);   // all len keys
    if (full_lo <= hi) total += static_cast<double>(hi - full_lo + 1) * static_cast<double>(len);
    return total;
}

// The (query, key) pairs the causal mask keeps: for each query, the keys at positions up to its own. Each
// side's positions are two runs (core/positions.h: rows before `split` from `first`, the rest from
// `second`).
double causal_pairs(const AttentionShape & shape) {
    const int64_t keys = shape.keys(), k1 = std::min(keys, shape.k_pos.split), k2 = keys - k1;
    const int64_t q1 = std::min(shape.s, shape.q_pos.split), q2 = shape.s - q1;
    double        pairs = 0;
    for (const auto & [first, count] : {std::pair{shape.q_pos.first, q1}, std::pair{shape.q_pos.second, q2}}) {
        if (count <= 0) continue;
        pairs += visible_keys(first, first + count - 1, shape.k_pos.first, k1);
        pairs += visible_keys(first, first + count - 1, shape.k_pos.second, k2);
    }
    return pairs * static_cast<double>(shape.b);
}

bool is_index(const Tensor & t) { return t.defined() && (t.dtype() == DType::i32 || t.dtype() == DType::i64); }

// Balanced routing: slot j of token t (t counted from `first`) goes to expert ((first + t) k + j) mod E, so
// every expert receives the same share of the slots (k consecutive experts per token: all different while
// k <= E). The plan's stand-in for a router whose load balancing works.
// Each slot's probability 1 / k (a dispatch plan that drops by probability sorts them).
void route_round_robin(const Tensor & top_idx, const Tensor & probs, int64_t first, int64_t experts) {
    int32_t *     idx = top_idx.data<int32_t>();
    float *       p   = probs.data<float>();
    const int64_t n = top_idx.size(0), k = top_idx.size(1);
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            idx[t * k + j] = static_cast<int32_t>(((first + t) * k + j) % experts);
            p[t * k + j]   = 1.0f / static_cast<float>(k);
        }
    }
}

// Every kernel, doing nothing but advancing its stream's clock by its modelled cost (the signatures are
// core/ops.h's). Except with index data: the host reads MoE routing counts to size the experts' inputs, so
// the routers route round-robin (balanced), the dispatch plans are computed from that (by the CPU's
// kernels, over the meta device's memory, which is the host's), and integer tensors are copied and zeroed
// for real. Those tensors are a few bytes per token; activations and weights are never touched.
class MetaOps final : public Ops {
public:
    explicit MetaOps(MetaClock & clock) : clock_(clock) {}

    void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c, bool accumulate) override {
        matmul(s, "gemm", a, b, c, bytes_of({&a, &b, &c}) + (accumulate ? static_cast<double>(c.nbytes()) : 0.0));
    }
    void gemm_bias(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c, const Tensor & bias) override {
        matmul(s, "gemm", a, b, c, bytes_of({&a, &b, &c, &bias}));
    }
    // The GPU's epilogues: one product that also stores pre (GELU_AUX_BIAS) or reads it (DGELU).
    void gemm_bias_gelu(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & pre, const Tensor & y, const Tensor & bias) override {
        matmul(s, "gemm", a, b, y, bytes_of({&a, &b, &pre, &y, &bias}));
    }
    void gemm_gelu_backward(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & pre, const Tensor & dx) override {
        matmul(s, "gemm", a, b, dx, bytes_of({&a, &b, &pre, &dx}));
    }
    // BGRADB: the product, its bias gradient written to a scratch vector, and that vector added (one small op).
    void gemm_weight_grad(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & dw, const Tensor & dbias) override {
        matmul(s, "gemm", dy, x, dw, bytes_of({&dy, &x, &dw, &dw, &dbias}));
        memory(s, "add_inplace", bytes_of({&dbias, &dbias, &dbias}));
    }
    void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd, float eps) override {
        memory(s, "layernorm_forward", bytes_of({&x, &residual, &gamma, &beta, &y, &mean, &rstd}) + (residual.defined() ? x.nbytes() : 0));
    }
    void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y, const Tensor & rstd, float eps) override {
        memory(s, "rmsnorm_forward", bytes_of({&x, &residual, &gamma, &y, &rstd}) + (residual.defined() ? x.nbytes() : 0));
    }
    void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & mean, const Tensor & rstd, const Tensor & dx, const Tensor & dgamma, const Tensor & dbeta, const Tensor & dresidual) override {
        memory(s, "layernorm_backward", bytes_of({&dy, &x, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta, &dgamma, &dbeta, &dresidual}));
    }
    void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & rstd, const Tensor & dx, const Tensor & dgamma, const Tensor & dresidual) override {
        memory(s, "rmsnorm_backward", bytes_of({&dy, &x, &gamma, &rstd, &dx, &dgamma, &dgamma, &dresidual}));
    }
    void bias_add(Stream & s, const Tensor & y, const Tensor & bias) override { memory(s, "bias_add", bytes_of({&y, &y, &bias})); }
    void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) override { memory(s, "bias_backward", bytes_of({&dy, &dbias, &dbias})); }
    void add_inplace(Stream & s, const Tensor & y, const Tensor & x) override { memory(s, "add_inplace", bytes_of({&y, &y, &x})); }
    void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y, const Tensor & x_bf16) override {
        memory(s, "bias_gelu_forward", bytes_of({&x, &bias, &y, &x_bf16}) + (bias.defined() ? x.nbytes() : 0));
    }
    void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override { memory(s, "gelu_backward", bytes_of({&x, &dy, &dx})); }
    void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) override { memory(s, "swiglu_forward", bytes_of({&x, &y})); }
    void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override { memory(s, "swiglu_backward", bytes_of({&x, &dy, &dx})); }
    void glu_forward(Stream & s, const Tensor & x, const Tensor & y, const GluSpec &) override { memory(s, "glu_forward", bytes_of({&x, &y})); }
    void glu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx, const GluSpec &) override { memory(s, "glu_backward", bytes_of({&x, &dy, &dx})); }
    void squared_relu_forward(Stream & s, const Tensor & x, const Tensor & y) override { memory(s, "squared_relu_forward", bytes_of({&x, &y})); }
    void squared_relu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override { memory(s, "squared_relu_backward", bytes_of({&x, &dy, &dx})); }
    void gated_delta_rule_forward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g, const Tensor & beta, const Tensor & o, const Tensor & workspace, const DeltaRuleShape & shape) override {
        memory(s, "gated_delta_rule_forward", bytes_of({&q, &k, &v, &g, &beta, &o}));
    }
    void gated_delta_rule_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g, const Tensor & beta, const Tensor & dout, const Tensor & dq, const Tensor & dk, const Tensor & dv, const Tensor & dg, const Tensor & dbeta, const Tensor & workspace, const DeltaRuleShape & shape) override {
        memory(s, "gated_delta_rule_backward", 2 * bytes_of({&q, &k, &v, &g, &beta, &dout}));
    }
    // The indexer's ops: 2 H d FLOPs per causal (query, key) pair for the scores, twice that for their gradients
    // (each recomputes the products), 2 nq d for the target's logits (computed three times by the CUDA kernel).
    void dsa_index_scores(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, int64_t seq, int64_t batch, bool, const Tensor & scores, const SeqPositions & q_pos) override {
        dsa(s, "dsa_index_scores", 2.0 * static_cast<double>(q.numel() / std::max<int64_t>(seq * batch, 1)),
            indexer_shape(seq, batch, k.size(0) / std::max<int64_t>(batch, 1), q_pos), bytes_of({&q, &k, &w, &scores}));
    }
    void dsa_index_scores_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, const Tensor & dscores, int64_t seq, int64_t batch, bool, const Tensor & dq, const Tensor & dk, const Tensor & dw, const SeqPositions & q_pos) override {
        dsa(s, "dsa_index_scores_backward", 8.0 * static_cast<double>(q.numel() / std::max<int64_t>(seq * batch, 1)),
            indexer_shape(seq, batch, k.size(0) / std::max<int64_t>(batch, 1), q_pos), bytes_of({&q, &k, &w, &dscores, &dq, &dk, &dw}));
    }
    void dsa_attention_target(Stream & s, const Tensor & q_k_v, const AttentionShape & shape, float, const Tensor & target, const Tensor & kv) override {
        dsa(s, "dsa_attention_target", 6.0 * static_cast<double>(shape.nq * shape.d), shape, bytes_of({&q_k_v, &kv, &target}));
    }
    void dsa_topk_mask(Stream & s, const Tensor & scores, int64_t, const Tensor & mask, const SeqPositions &) override {
        memory(s, "dsa_topk_mask", bytes_of({&scores, &mask}));
    }
    void dsa_indexer_loss(Stream & s, const Tensor & scores, const Tensor & target, float, const Tensor & kl, const Tensor & dscores, const Tensor & mask, const SeqPositions &) override {
        memory(s, "dsa_indexer_loss", bytes_of({&scores, &target, &kl, &dscores, &mask}));
    }
    void causal_conv_silu_forward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & y, int64_t seq, int64_t batch) override {
        memory(s, "causal_conv_silu_forward", bytes_of({&x, &w, &y}));
    }
    void causal_conv_silu_backward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & dy, const Tensor & dx, const Tensor & dw, int64_t seq, int64_t batch) override {
        memory(s, "causal_conv_silu_backward", 2 * bytes_of({&x, &dy}) + bytes_of({&dx, &w, &dw}));
    }
    // The gate's columns of src are read (and written) once: x's bytes of them.
    void output_gate_forward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & y, GateActivation) override { memory(s, "output_gate_forward", 3 * bytes_of({&x})); }
    void output_gate_backward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & dy, const Tensor & dx, const Tensor & dgate, GateActivation) override { memory(s, "output_gate_backward", 5 * bytes_of({&x})); }
    void l2norm_forward(Stream & s, const Tensor & x, const Tensor & y, const Tensor & rstd, float) override { memory(s, "l2norm_forward", bytes_of({&x, &y, &rstd})); }
    void l2norm_backward(Stream & s, const Tensor & dy, const Tensor & y, const Tensor & rstd, const Tensor & dx) override { memory(s, "l2norm_backward", bytes_of({&dy, &y, &rstd, &dx})); }
    // The gate columns of src are read once: about the bytes of g and beta (and of dsrc).
    void gdn_gates_forward(Stream & s, const Tensor & src, int64_t, const Tensor &, const Tensor &, const Tensor & g, const Tensor & beta) override { memory(s, "gdn_gates_forward", 2 * bytes_of({&g, &beta})); }
    void gdn_gates_backward(Stream & s, const Tensor & src, int64_t, const Tensor &, const Tensor &, const Tensor & dg, const Tensor & dbeta, const Tensor & dsrc, const Tensor &, const Tensor &) override { memory(s, "gdn_gates_backward", 2 * bytes_of({&dg, &dbeta, &dsrc})); }
    void rope(Stream & s, const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d, float base, bool inverse,
              int64_t rotary_dim, bool interleaved, const SeqPositions & positions, const RopeScaling & scaling) override {
        memory(s, "rope", 2.0 * static_cast<double>(seq * batch * heads * d * static_cast<int64_t>(dtype_size(x.dtype()))));
    }
    void dropout(Stream & s, const Tensor & x, const Tensor & y, const Dropout & key) override { memory(s, "dropout", bytes_of({&x, &y})); }
    void embedding_forward(Stream & s, const Tensor & tokens, const Tensor & wte, const Tensor & wpe, const Tensor & out, const SeqPositions & positions) override {
        memory(s, "embedding_forward", bytes_of({&tokens, &out, &out}) + (wpe.defined() ? out.nbytes() : 0));
    }
    // dwte on the GPU: the rows' 8-byte keys sorted by token (a bitonic sort of n = the next power of two of
    // the rows: log2(n) (log2(n) + 1) / 2 passes, each reading and writing every key), then the runs' adds.
    void embedding_backward(Stream & s, const Tensor & tokens, const Tensor & dout, const Tensor & dwte, const Tensor & dwpe, const SeqPositions & positions) override {
        int64_t keys = 1, levels = 0;
        while (keys < tokens.numel()) keys *= 2, ++levels;
        const double sort = 16.0 * static_cast<double>(keys) * static_cast<double>(levels * (levels + 1) / 2 + 1);
        memory(s, "embedding_backward", bytes_of({&tokens, &dout, &dout, &dout}) + sort + (dwpe.defined() ? 2 * dout.nbytes() : 0));
    }
    void vocab_shard_ids(Stream & s, const Tensor & ids, int64_t begin, int64_t count, const Tensor & out) override { memory(s, "vocab_shard_ids", bytes_of({&ids, &out})); }
    void attention_forward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & lse, const AttentionShape & shape, float scale, const Dropout & dropout) override {
        attention(s, "attention_forward", 1.0, shape, bytes_of({&q, &out, &lse}) + (kv.shares_storage(q) ? 0 : kv.nbytes()));
    }
    void attention_backward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & dout, const Tensor & lse, const Tensor & dq, const Tensor & dkv, const AttentionShape & shape, float scale, const Dropout & dropout, bool accumulate) override {
        const double kv_bytes = kv.shares_storage(q) ? 0 : 2.0 * static_cast<double>(kv.nbytes());
        attention(s, "attention_backward", 2.5, shape, bytes_of({&q, &out, &dout, &lse, &dq}) + kv_bytes);
    }
    void attention_merge(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & part_out, const Tensor & part_lse, const AttentionShape & shape) override {
        memory(s, "attention_merge", bytes_of({&out, &out, &lse, &lse, &part_out, &part_lse}));
    }
    void attention_sink_forward(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & sink, const AttentionShape & shape) override {
        memory(s, "attention_sink_forward", bytes_of({&out, &out, &lse, &lse, &sink}));
    }
    void attention_sink_backward(Stream & s, const Tensor & out, const Tensor & dout, const Tensor & lse, const Tensor & sink, const Tensor & dsink, const AttentionShape & shape) override {
        memory(s, "attention_sink_backward", bytes_of({&out, &dout, &lse, &sink, &dsink}));
    }
    void cross_entropy_forward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & loss, const Tensor & lse, int64_t vocab) override {
        memory(s, "cross_entropy_forward", bytes_of({&logits, &labels, &loss, &lse}));
    }
    void cross_entropy_backward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & lse, const Tensor & dloss, int64_t vocab) override {
        memory(s, "cross_entropy_backward", bytes_of({&logits, &logits, &labels, &lse, &dloss}));
    }
    void row_max(Stream & s, const Tensor & logits, int64_t valid, const Tensor & out) override { memory(s, "row_max", bytes_of({&logits, &out})); }
    void row_sum_exp(Stream & s, const Tensor & logits, const Tensor & max, int64_t valid, const Tensor & out) override { memory(s, "row_sum_exp", bytes_of({&logits, &max, &out})); }
    void label_logit(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & out) override { memory(s, "label_logit", bytes_of({&labels, &out})); }
    void lse_and_loss(Stream & s, const Tensor & max, const Tensor & sum, const Tensor & target, const Tensor & lse, const Tensor & loss) override {
        memory(s, "lse_and_loss", bytes_of({&max, &sum, &target, &lse, &loss}));
    }
    void loss_grad(Stream & s, const Tensor & mask, double scale, const Tensor & dloss) override { memory(s, "loss_grad", bytes_of({&mask, &dloss})); }
    void convert(Stream & s, const Tensor & src, const Tensor & dst) override { memory(s, "convert", bytes_of({&src, &dst})); }
    void round_to_bf16(Stream & s, const Tensor & x, const Tensor & x_bf16) override { memory(s, "round_to_bf16", bytes_of({&x, &x, &x_bf16})); }
    void copy(Stream & s, const Tensor & src, const Tensor & dst) override {
        if (is_index(src)) {
            std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
        } else if (dst.host_addressable() && dst.nbytes() <= (size_t{1} << 16)) {
            std::memset(dst.data_ptr(), 0, dst.nbytes());   // a value the host reads (a loss, a norm): zero, never
                                                            // the bytes a reused block held before
        }
        if (src.memory_kind() != MemoryKind::device || dst.memory_kind() != MemoryKind::device) {
            run(s, "host_copy", 0, static_cast<double>(src.nbytes()), clock_.costs ? clock_.costs->host_copy_seconds(static_cast<double>(src.nbytes())) : 0);
        } else {
            memory(s, "copy", bytes_of({&src, &dst}));
        }
    }
    void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col, int64_t width) override {
        memory(s, "copy_columns", 2.0 * static_cast<double>(src.size(0) * width * static_cast<int64_t>(dtype_size(src.dtype()))));
    }
    void fill_zero(Stream & s, const Tensor & t) override {
        if (is_index(t)) std::memset(t.data_ptr(), 0, t.nbytes());
        memory(s, "fill_zero", bytes_of({&t}));
    }
    void scale(Stream & s, const Tensor & t, float factor) override { memory(s, "scale", bytes_of({&t, &t})); }
    void fp8_quantize(Stream & s, const Tensor & x, Fp8Format, const Tensor & q, const Tensor &) override {
        memory(s, "fp8_quantize", bytes_of({&x, &x, &q}));
    }
    void fp8_quantize_blocks(Stream & s, const Tensor & x, Fp8Format, int64_t, int64_t, const Tensor & q, bool) override {
        memory(s, "fp8_quantize_blocks", bytes_of({&x, &x, &q}));
    }
    void scale_by_reciprocal(Stream & s, const Tensor & t, const Tensor &) override {
        memory(s, "scale_by_reciprocal", bytes_of({&t, &t}));
    }
    void fp8_amax(Stream & s, const Tensor & x, const Tensor &) override { memory(s, "fp8_amax", bytes_of({&x})); }
    void sigmoid_gate_forward(Stream & s, const Tensor & y, const Tensor & logits) override {
        memory(s, "sigmoid_gate_forward", bytes_of({&y, &y, &logits}));
    }
    void sigmoid_gate_backward(Stream & s, const Tensor & dy, const Tensor & m, const Tensor & logits, const Tensor & dm,
                               const Tensor & dlogits) override {
        memory(s, "sigmoid_gate_backward", bytes_of({&dy, &m, &logits, &dm, &dlogits}));
    }
    void fp8_quantize_scaled(Stream & s, const Tensor & x, Fp8Format, const Tensor &, const Tensor & q, const Tensor &) override {
        memory(s, "fp8_quantize_scaled", bytes_of({&x, &q}));
    }
    void fp8_delayed_update(Stream & s, const Tensor & history, const Tensor & scale, Fp8Format, int, bool) override {
        memory(s, "fp8_delayed_update", bytes_of({&history, &history, &scale}));
    }
    void fp8_encode(Stream & s, const Tensor & x, Fp8Format, const Tensor &, const Tensor & codes, const Tensor &) override {
        memory(s, "fp8_encode", bytes_of({&x, &codes}));
    }
    void fp8_decode(Stream & s, const Tensor & codes, Fp8Format, const Tensor & q) override {
        memory(s, "fp8_decode", bytes_of({&codes, &q}));
    }
    void scale_by_product(Stream & s, const Tensor & t, const Tensor &, const Tensor &) override {
        memory(s, "scale_by_product", bytes_of({&t, &t}));
    }
    void scale_by_inverse_norm(Stream & s, const Tensor & t, const Tensor &, double) override {
        memory(s, "scale_by_inverse_norm", bytes_of({&t, &t}));
    }
    void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) override { memory(s, "sum_of_squares", bytes_of({&x})); }
    // The CUDA backend's launches: 64 tensors each (kernels::kSquaresMultiTensors).
    void sum_of_squares_multi(Stream & s, std::span<const Tensor> xs, const Tensor & out) override {
        for (size_t first = 0; first < xs.size(); first += 64) {
            double bytes = 0;
            for (size_t t = first; t < std::min(xs.size(), first + 64); ++t) bytes += bytes_of({&xs[t]});
            memory(s, "sum_of_squares", bytes);
        }
    }
    void moe_topk(Stream & s, const Tensor & logits, const MoeRouting & routing, const Tensor & expert_bias,
                  const Tensor & top_idx, const Tensor & probs) override {
        route_round_robin(top_idx, probs, 0, routing.experts);
        memory(s, "moe_topk", bytes_of({&logits, &expert_bias, &top_idx, &probs}));
    }
    void moe_count_tokens(Stream & s, const Tensor & tokens_per_expert, const Tensor & load) override {
        memory(s, "moe_count_tokens", bytes_of({&tokens_per_expert, &load, &load}));
    }
    void moe_expert_bias_update(Stream & s, const Tensor & load, const Tensor & bias, float) override {
        memory(s, "moe_expert_bias_update", bytes_of({&load, &bias, &load, &bias}));
    }
    void moe_sinkhorn_topk(Stream & s, const Tensor & logits, int64_t first, const MoeRouting & routing, const Tensor & top_idx, const Tensor & probs) override {
        route_round_robin(top_idx, probs, first, routing.experts);
        memory(s, "moe_sinkhorn_topk", bytes_of({&logits, &logits, &top_idx, &probs}));
    }
    void moe_aux_counts(Stream & s, const Tensor & logits, const MoeRouting & routing, int64_t groups, const Tensor & counts) override {
        memory(s, "moe_aux_counts", bytes_of({&logits, &counts}));
    }
    void moe_router_losses(Stream & s, const Tensor & logits, const Tensor & counts, const MoeRouting & routing, const MoeRouterLoss & loss, const Tensor & losses) override {
        memory(s, "moe_router_losses", bytes_of({&logits, &counts, &losses}));
    }
    void moe_router_backward(Stream & s, const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs, const Tensor & counts, const MoeRouting & routing, const MoeRouterLoss & loss, float loss_scale, const Tensor & dlogits) override {
        memory(s, "moe_router_backward", bytes_of({&logits, &top_idx, &dprobs, &counts, &dlogits}));
    }
    void moe_plan(Stream & s, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec, const Tensor & plan_probs, const Tensor & row_of, const Tensor & token_of_row, const Tensor & tokens_per_expert) override {
        cpu::moe_plan(expert_of.data<int32_t>(), probs.data<float>(), expert_of.size(0), expert_of.size(1), spec,
                      plan_probs.data<float>(), row_of.data<int32_t>(), token_of_row.data<int32_t>(), token_of_row.numel(),
                      tokens_per_expert.data<int64_t>());
        memory(s, "moe_plan", bytes_of({&expert_of, &probs, &plan_probs, &row_of, &token_of_row, &tokens_per_expert}));
    }
    void moe_plan_experts(Stream & s, const Tensor & row_of, const Tensor & tokens_per_expert, const Tensor & expert_of) override {
        cpu::moe_plan_experts(row_of.data<int32_t>(), row_of.numel(), tokens_per_expert.data<int64_t>(),
                              tokens_per_expert.numel(), expert_of.data<int32_t>());
        memory(s, "moe_plan_experts", bytes_of({&row_of, &tokens_per_expert, &expert_of}));
    }
    void moe_gather_rows(Stream & s, const Tensor & x, const Tensor & index, const Tensor & out) override { memory(s, "moe_gather_rows", bytes_of({&index, &out, &out})); }
    void moe_combine(Stream & s, const Tensor & src, const Tensor & row_of, const Tensor & weights, const Tensor & dst) override {
        memory(s, "moe_combine", bytes_of({&src, &row_of, &weights, &dst}));
    }
    void moe_combine_backward(Stream & s, const Tensor & dy, const Tensor & src, const Tensor & weights, const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc, const Tensor & dweights) override {
        memory(s, "moe_combine_backward", bytes_of({&dy, &src, &weights, &row_of, &token_of_row, &dsrc, &dweights}));
    }
    void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v, const Tensor & out, const AdamStep & step) override {
        memory(s, "adamw", bytes_of({&master, &master, &grad, &m, &m, &v, &v, &out}));
    }
    // The CUDA backend's launches: 24 tensors each (kernels::kAdamMultiTensors).
    void adamw_multi(Stream & s, std::span<const AdamwTensors> entries) override {
        for (size_t first = 0; first < entries.size(); first += 24) {
            double bytes = 0;
            for (size_t t = first; t < std::min(entries.size(), first + 24); ++t) {
                const AdamwTensors & e = entries[t];
                bytes += bytes_of({&e.master, &e.master, &e.grad, &e.m, &e.m, &e.v, &e.v, &e.out});
            }
            memory(s, "adamw", bytes);
        }
    }
    void grad_norm_gate(Stream & s, const Tensor & pairs, const GradNormGate &, const Tensor & gate,
                        const Tensor & norm) override {
        memory(s, "grad_norm_gate", bytes_of({&pairs, &gate, &norm}));
    }
    // Priced as the step it usually is (the gate open); a clipped step also writes the gradients back.
    void adamw_multi_gated(Stream & s, std::span<const AdamwTensors> entries, const Tensor &) override {
        adamw_multi(s, entries);
    }

private:
    void run(Stream & s, const char * op, double flops, double bytes, double seconds) {
        if (clock_.costs) clock_.run(static_cast<MetaStream &>(s).time, op, flops, bytes, seconds);
    }
    void memory(Stream & s, const char * op, double bytes) {
        run(s, op, 0, bytes, clock_.costs ? clock_.costs->memory_seconds(bytes) : 0);
    }
    // c (m, n) = op(a) (m, k) op(b) (k, n): 2 m n k FLOPs.
    void matmul(Stream & s, const char * op, const Tensor & a, const Tensor & b, const Tensor & c, double bytes) {
        const int64_t m     = c.dim() >= 2 ? c.numel() / c.size(-1) : 1;
        const double  flops = 2.0 * static_cast<double>(c.numel()) * static_cast<double>(a.numel() / std::max<int64_t>(m, 1));
        run(s, op, flops, bytes, clock_.costs ? clock_.costs->kernel_seconds(flops, bytes, clock_.costs->efficiency().gemm) : 0);
    }
    // `per_pair` FLOPs for each causal (query, key) pair of `batch` sequences of `seq`.
    // The indexer's rows as an attention's: its queries at q_pos against whole sequences' keys.
    static AttentionShape indexer_shape(int64_t seq, int64_t batch, int64_t keys, const SeqPositions & q_pos) {
        AttentionShape shape(seq, batch, 1, 1, 1, 1);
        shape.s_kv  = keys;
        shape.q_pos = q_pos;
        return shape;
    }
    void dsa(Stream & s, const char * op, double per_pair, const AttentionShape & rows, double bytes) {
        const double flops = per_pair * causal_pairs(rows);
        run(s, op, flops, bytes, clock_.costs ? clock_.costs->kernel_seconds(flops, bytes, clock_.costs->efficiency().attention) : 0);
    }

    // 4 b a d per kept (query, key) pair in the forward (the scores and the weighted values, 2 FLOPs per
    // multiply-add), `factor` times that for the backward.
    void attention(Stream & s, const char * op, double factor, const AttentionShape & shape, double bytes) {
        if (!clock_.costs) return;
        const double flops = factor * 4.0 * static_cast<double>(shape.nq * shape.d) * causal_pairs(shape);
        run(s, op, flops, bytes, clock_.costs->kernel_seconds(flops, bytes, clock_.costs->efficiency().attention));
    }

    MetaClock & clock_;
};

// Complete when the host asks; a wait moves the host's clock up to the work's modelled end.
class MetaWork final : public comm::Work {
public:
    MetaWork(MetaClock * clock, double end) : clock_(clock), end_(end) {}
    void wait() override {
        if (clock_) clock_->wait_until(end_);
    }
    bool test() override { return true; }

private:
    MetaClock * clock_;
    double      end_;
};

}  // namespace

double MetaClock::run(double & stream, const char * op, double flops, double bytes, double seconds, bool holds_stream) {
    const double start = std::max(stream, host);
    const double end   = start + seconds;
    if (holds_stream) stream = end;
    horizon      = std::max(horizon, end);
    OpTotal & t  = totals[op];
    t.calls += 1;
    t.flops += flops;
    t.bytes += bytes;
    t.seconds += seconds;
    return end;
}

MetaDevice::MetaDevice(const CostModel * costs)
    : device_memory_(std::make_unique<Allocator>(std::make_unique<ReservedMemory>(size_t{1} << 45), MemoryKind::device, "meta")),
      pinned_memory_(std::make_unique<Allocator>(std::make_unique<ReservedMemory>(size_t{1} << 42), MemoryKind::pinned_host, "meta-pinned")),
      ops_(std::make_unique<MetaOps>(clock_)),
      compute_(std::make_unique<MetaStream>(*this, clock_, "compute")) {
    clock_.costs = costs;
}

MetaDevice::~MetaDevice() = default;

Allocator & MetaDevice::allocator(MemoryKind kind) {
    LOOM_CHECK(kind != MemoryKind::pageable_host, "the meta device has no pageable host allocator", "");
    return kind == MemoryKind::device ? *device_memory_ : *pinned_memory_;
}

std::unique_ptr<Stream> MetaDevice::stream_create(const std::string & name) { return std::make_unique<MetaStream>(*this, clock_, name); }
std::unique_ptr<Event>  MetaDevice::event_create() { return std::make_unique<MetaEvent>(clock_); }
Ops &                   MetaDevice::ops() { return *ops_; }
Stream &                MetaDevice::compute_stream() { return *compute_; }

MetaCommunicator::MetaCommunicator(std::vector<int> global_ranks, int rank, std::string name, MetaClock * clock)
    : global_ranks_(std::move(global_ranks)), rank_(rank), name_(std::move(name)), clock_(clock) {}

comm::WorkPtr MetaCommunicator::modelled(const char * op, CollectiveKind kind, double bytes, const std::vector<int> & ranks,
                                         Stream * stream, bool holds_stream, int peers) {
    if (!clock_ || !clock_->costs) return std::make_shared<MetaWork>(nullptr, 0.0);
    const double seconds = clock_->costs->collective_seconds(kind, bytes, ranks, peers);
    double       host    = clock_->host;   // without a stream the data is ready now, and nothing waits for it
    double &     start   = stream ? static_cast<MetaStream &>(*stream).time : host;
    return std::make_shared<MetaWork>(clock_, clock_->run(start, op, 0, bytes, seconds, holds_stream));
}

// Index data (routing counts, expert ids) crosses a meta communicator as it would between ranks that all
// hold what this one holds: the plan's ranks are symmetric (balanced routing on every one). Floating-point
// values are never moved: the plan reads none.
namespace {

template <typename T> void scale_integers(const Tensor & t, int64_t factor) {
    T * v = static_cast<T *>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<T>(v[i] * factor);
}

void multiply(const Tensor & t, int64_t factor) {
    if (t.dtype() == DType::i32) scale_integers<int32_t>(t, factor);
    else scale_integers<int64_t>(t, factor);
}

}  // namespace

comm::WorkPtr MetaCommunicator::do_all_reduce(const Tensor & t, comm::ReduceOp op, Stream * s) {
    if (is_index(t) && op == comm::ReduceOp::sum) multiply(t, size());
    return modelled("all_reduce", CollectiveKind::all_reduce, static_cast<double>(t.nbytes()), global_ranks_, s);
}
comm::WorkPtr MetaCommunicator::do_reduce_scatter(const Tensor & in, const Tensor & out, comm::ReduceOp op, Stream * s) {
    if (is_index(in)) {
        std::memcpy(out.data_ptr(), static_cast<const char *>(in.data_ptr()) + rank_ * out.nbytes(), out.nbytes());
        if (op == comm::ReduceOp::sum) multiply(out, size());
    }
    return modelled("reduce_scatter", CollectiveKind::reduce_scatter, static_cast<double>(in.nbytes()), global_ranks_, s);
}
comm::WorkPtr MetaCommunicator::do_all_gather(const Tensor & in, const Tensor & out, Stream * s) {
    if (is_index(in)) {
        for (int p = 0; p < size(); ++p) std::memcpy(static_cast<char *>(out.data_ptr()) + p * in.nbytes(), in.data_ptr(), in.nbytes());
    }
    return modelled("all_gather", CollectiveKind::all_gather, static_cast<double>(out.nbytes()), global_ranks_, s);
}
comm::WorkPtr MetaCommunicator::do_broadcast(const Tensor & t, int, Stream * s) {
    return modelled("broadcast", CollectiveKind::broadcast, static_cast<double>(t.nbytes()), global_ranks_, s);
}
comm::WorkPtr MetaCommunicator::do_all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                                              std::span<const int64_t> recv_counts, Stream * s) {
    if (is_index(in)) {   // every peer sends this rank what this rank sends itself
        const size_t  unit = dtype_size(in.dtype());
        int64_t       mine = 0, at = 0;
        for (int p = 0; p < rank_; ++p) mine += send_counts[static_cast<size_t>(p)];
        const int64_t own = send_counts[static_cast<size_t>(rank_)];
        for (int p = 0; p < size(); ++p) {
            const int64_t n = std::min(own, recv_counts[static_cast<size_t>(p)]);
            std::memcpy(static_cast<char *>(out.data_ptr()) + at * unit, static_cast<const char *>(in.data_ptr()) + mine * unit,
                        static_cast<size_t>(n) * unit);
            at += recv_counts[static_cast<size_t>(p)];
        }
    }
    // Priced by what leaves this rank and for how many peers: a uniform exchange as an all-to-all, a ring's pass
    // (one peer) as a transfer.
    int64_t to_others = 0;
    int     peers     = 0;
    for (int p = 0; p < size(); ++p) {
        if (p == rank_ || send_counts[static_cast<size_t>(p)] == 0) continue;
        to_others += send_counts[static_cast<size_t>(p)];
        ++peers;
    }
    return modelled("all_to_all", CollectiveKind::all_to_all, static_cast<double>(to_others) * static_cast<double>(dtype_size(in.dtype())),
                    global_ranks_, s, true, peers);
}
// A send does not hold its stream (comm/communicator.h); its receiver's wait is what takes the time.
comm::WorkPtr MetaCommunicator::do_send(const Tensor & t, int peer, int, Stream * s) {
    return modelled("send", CollectiveKind::point_to_point, static_cast<double>(t.nbytes()),
                    {global_ranks_[static_cast<size_t>(rank_)], global_ranks_[static_cast<size_t>(peer)]}, s, false);
}
comm::WorkPtr MetaCommunicator::do_recv(const Tensor & t, int peer, int, Stream * s) {
    return modelled("recv", CollectiveKind::point_to_point, static_cast<double>(t.nbytes()),
                    {global_ranks_[static_cast<size_t>(peer)], global_ranks_[static_cast<size_t>(rank_)]}, s);
}
comm::WorkPtr MetaCommunicator::do_barrier(Stream * s) {
    return modelled("barrier", CollectiveKind::all_reduce, 0, global_ranks_, s);
}

std::shared_ptr<comm::Communicator> MetaCommunicatorFactory::world() {
    std::vector<int> all(static_cast<size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) all[static_cast<size_t>(r)] = r;
    return std::make_shared<MetaCommunicator>(all, rank_, "world", clock_);
}

std::shared_ptr<comm::Communicator> MetaCommunicatorFactory::split(const std::vector<std::vector<int>> & groups,
                                                                   const std::string & name) {
    for (const std::vector<int> & group : groups) {
        for (size_t i = 0; i < group.size(); ++i) {
            if (group[i] == rank_) return std::make_shared<MetaCommunicator>(group, static_cast<int>(i), name, clock_);
        }
    }
    return nullptr;
}

}  // namespace loom::plan
