// GptModel: embedding -> L transformer layers -> final norm -> output layer -> cross-entropy.
//
//   tokens (b, s) --wte (V, h) [+ wpe (P, h)]--> x (s*b, h) --layers--> --norm--> --W_out^T--> logits (s*b, V)
//   loss = sum over tokens of mask * CE(logits, labels) / sum(mask)         ("lm loss")
//
// Multi-token prediction (--mtp-num-layers D, DeepSeek-V3's MTP as Megatron's MultiTokenPredictionBlock): on
// the last stage, from h_0 = the final norm's output, depth k = 0 .. D-1 computes
//   e_k     = embedding(token k + 1 ahead)                         (the shared word embedding, its dropout)
//   h_{k+1} = final_norm_k(layer_k(eh_proj_k [enorm_k(e_k) | hnorm_k(h_k)]))     eh_proj_k (h, 2h), no bias
//   mtp loss_k = sum over tokens of mask_{k+1} * CE(h_{k+1} W_out^T, label k + 1 ahead) / sum(mask_{k+1})
// (the token, label and mask k + 1 ahead: MicroBatch's MTP planes), and the training loss is
// lm loss + mtp_loss_scaling_factor / D * sum_k mtp loss_k. layer_k is a transformer layer of the last
// decoder layer's kind. Evaluation leaves the depths out: they change no reported loss.
//
// The output layer reuses the word embedding (tied, GPT-2) unless the config unties them (Llama); the
// tied weight then gets both gradient contributions before it is reported ready. backward() takes the
// factor each token's loss is scaled by (1 / (sum(mask) * num_microbatches) for Megatron's averaging
// over a global batch) and accumulates every parameter's gradient into main_grad.
//
// The softmax runs over the real vocabulary only: the padding columns (vocab_size .. V) are left out of
// the loss and get zero gradient, so their embedding rows never train and an imported Hugging Face model
// scores exactly its own loss. (Megatron keeps the padded logits inside its softmax; llm.c masks them, as
// Loom does: a padded token can never be a label, so giving it probability only makes the loss worse.)
#pragma once

#include "model/transformer_layer.h"

#include <array>
#include <functional>
#include <memory>
#include <vector>

namespace loom::model {

struct MicroBatch {
    Tensor tokens;      // (b, s) int32
    Tensor labels;      // (b, s) int32
    Tensor loss_mask;   // (b, s) f32
    Tensor sample_ids;  // (b) int64, host: each row's place in the global sample stream (the dropout masks'
                        // key, so they do not depend on the layout); undefined: 0 .. b-1
    // With context parallelism the tensors hold this rank's two chunks of each sequence
    // (model::ContextParallel); sequence_tokens is then the whole sequences' loss_mask sum, which every
    // rank's loss is a share of. -1: the sum of loss_mask itself.
    double sequence_tokens = -1;
    // Multi-token prediction (--mtp-num-layers D; add_mtp_targets): depth k's input token and its label and
    // mask are those k + 1 positions ahead, (D, b, s) each, 0 past the sequence's end (Megatron's roll_tensor).
    // With context parallelism they hold this rank's chunks of the whole sequences' rolls, and
    // mtp_sequence_tokens[k] is the whole sequences' mask sum of depth k (else the planes' own sums).
    Tensor              mtp_tokens, mtp_labels, mtp_mask;
    std::vector<double> mtp_sequence_tokens;
};

// `batch` (whole sequences, in host memory) with its MTP planes for `depths` depths (none for 0).
MicroBatch add_mtp_targets(MicroBatch batch, int64_t depths);

// The part of the model one pipeline stage holds: layers [first_layer, first_layer + num_layers) (global
// indices, so parameter names and initial values are those of the whole model), the embedding on the
// first stage (pre_process) and the final norm, output layer and loss on the last (post_process). A
// last stage with tied embeddings holds its own copy of the word embedding as the output weight
// (shared_embedding; the trainer all-reduces its gradient with the first stage's over the embedding
// group). The default is the whole model.
struct PipelineStage {
    int64_t first_layer  = 0;
    int64_t num_layers   = -1;   // -1: every layer from first_layer on
    bool    pre_process  = true;
    bool    post_process = true;
};

// How a training pass runs one layer of a chunk: eagerly (the layer's forward keeps its context for its
// backward), recomputed (full recompute: the forward drops what it saved and the backward reruns the layer's
// group from the group's input, model/gpt_model.h recompute_groups), or as a graph replay (LayerGraphs).
// The pipeline executor chooses, per (chunk, micro-batch), from GptModel::layer_runs, and hands the choice
// and the graphs over in the Context; the model only carries it out.
enum class LayerRun : uint8_t { eager, recompute, graph };

// Per-layer graphs (graphs/layer_graph_runner.h), the graph strategy: layer i of chunk `chunk` for micro-batch
// `microbatch` of the iteration (Context::chunk and Context::microbatch, the executor's) on input x (or
// output gradient dy). The runner maps each call to the graph captured for it, copies the inputs into the
// graph's static buffers and replays; evaluation and recomputed layers never reach it.
class LayerGraphs {
public:
    virtual ~LayerGraphs() = default;
    virtual Tensor forward(int chunk, int microbatch, int64_t layer, const Tensor & x, const DropoutBatch & batch) = 0;
    virtual Tensor backward(int chunk, int microbatch, int64_t layer, const Tensor & dy, const GradReadyFn & ready) = 0;
};

// The fused classifier's logits per chunk at most (GptConfig::classifier_chunk_positions 0): 256
// MiB, enough rows that each chunk's weight-gradient GEMM, which reads and writes the whole output weight's
// main_grad, is bound by its arithmetic rather than by those bytes on a GPU.
inline constexpr int64_t kClassifierChunkBytes = int64_t{256} << 20;

class GptModel {
public:
    // With tensor parallelism (tp.size > 1) this rank holds its shard of every split parameter (layers.h)
    // and the vocabulary rows [rank, rank + 1) x V / tp of the embedding and output layer, V padded to a
    // multiple of make_vocab_size_divisible_by x tp; the cross-entropy never gathers the full logits.
    // With expert parallelism (ep.size > 1) its MoE layers hold their share of the experts (layers.h).
    GptModel(const GptConfig & config, Device & device, const PipelineStage & stage = {},
             const TensorParallel & tp = {}, const ExpertParallel & ep = {}, const ContextParallel & cp = {});

    struct LossSum {
        double sum   = 0;   // sum of mask * per-token loss
        double count = 0;   // sum of mask
        double mean() const { return count > 0 ? sum / count : 0.0; }
    };

    struct Context {
        std::vector<TransformerLayer::Context> layers;
        Norm::Context                          final_norm;
        MicroBatch                             batch;          // the micro-batch's tensors in device memory (forward_stage)
        Tensor                                 final_hidden;   // input of the output layer (s*b, h), params' dtype
        Tensor                                 logits;         // (s*b, V) f32; becomes dlogits in backward
        Tensor                                 lse;            // (s*b)
        Tensor                                 token_loss;     // (s*b)
        int64_t                                s = 0, b = 0;
        int                                    chunk      = 0;   // the executor's chunk index on this rank
        int                                    microbatch = 0;   // its index in the iteration (the executor's)
        // How each layer runs (empty: layer_runs(nullptr)); the executor sets both for training passes.
        std::vector<LayerRun>                  runs;
        LayerGraphs *                          graphs = nullptr;   // the replays of LayerRun::graph layers
        LossSum                                loss;           // last stage: this micro-batch's loss
        // The fused classifier (GptConfig::classifier_fusion): the executor's loss scale and micro-batch count,
        // given before a training forward (0: not given, the classifier runs unfused); the forward computes the
        // output layer's gradients with the scale backward_stage will be given, loss_scale / (tokens x
        // microbatches), and keeps the hidden states' gradient for it.
        double                                 loss_scale   = 0;
        int64_t                                microbatches = 0;
        double                                 classifier_scale = 0;
        Tensor                                 classifier_dx;   // (s*b, h): the output layer's input gradient
        bool                                   training = true;   // false: evaluation, no dropout
        Dropout                                embedding_dropout;
        std::vector<Tensor>                    checkpoints;    // full recompute: each group's input, at its first layer
        // DSA: the selections of the layers that compute their own top-k in this forward, by layer index, for the
        // layers that take them (--dsa-indexer-topk-freq) and for full recompute's reruns; cleared by backward.
        std::map<int64_t, Tensor>              dsa_topk;
        // MTP (training passes of the last stage): each depth's contexts, the rows its loss reads, and its
        // token count (count; sum is not read here: take_mtp_losses).
        struct MtpDepth {
            Norm::Context             enorm, hnorm, final_norm;
            Linear::Context           eh_proj;
            TransformerLayer::Context layer;
            Dropout                   embedding_dropout;
            Tensor                    tokens;          // (b, s) the inputs as this rank's vocabulary rows
            Tensor                    labels, mask;    // (b, s) device
            Tensor                    final_hidden, logits, lse, token_loss;
            LossSum                   loss;
        };
        std::vector<MtpDepth>                  mtp;
        Tensor                                 mtp_host_mask;   // (D, b, s): the planes' masks on the host
    };

    // Initialises every parameter from config.seed (Megatron's scheme).
    void init();

    // The whole model's forward; waits for the compute stream and returns the loss.
    LossSum forward(Context & ctx, const MicroBatch & batch);
    // The sum of mask * token_loss over a micro-batch's rows (token_loss (s*b) in (s, b) order, mask (b, s)),
    // in double, on the host: call it once the stream that computed token_loss has been waited on, with
    // token_loss in host memory (host_copy_async, read_after_stream: no further synchronization).
    static double masked_loss_sum(const Tensor & token_loss, const Tensor & mask);
    // The token count a micro-batch's loss is a mean over (its loss mask's sum, or with context parallelism
    // the whole sequences'), which scales its loss gradient.
    static double loss_tokens(const MicroBatch & batch);
    // Throws naming the id when a token of `tokens` (host memory) is outside the vocabulary.
    void          check_token_ids(const Tensor & tokens) const;
    // Adds gradients of (loss_scale * sum of mask * token loss) into main_grad.
    void    backward(Context & ctx, double loss_scale, const GradReadyFn & ready);

    // One pipeline stage's forward: `input` is the previous stage's output (unused on the first stage).
    // Returns this stage's output (s*b, h) for the next stage; on the last stage an undefined tensor, and
    // ctx.loss.count is the micro-batch's token count while ctx.loss.sum waits for the stream: it is NaN
    // until the caller fills it from ctx.token_loss with masked_loss_sum. Everything is enqueued on the
    // device's compute stream.
    Tensor forward_stage(Context & ctx, const MicroBatch & batch, const Tensor & input);
    // Its backward: `dy` is the gradient of the stage's output (unused on the last stage). Returns the
    // gradient of its input for the previous stage (undefined on the first stage).
    Tensor backward_stage(Context & ctx, double loss_scale, const Tensor & dy, const GradReadyFn & ready);

    const PipelineStage & stage() const { return stage_; }
    // Rows of the activations between this model's layers for a (b, s) micro-batch: s * b, or this rank's
    // s * b / tp with sequence parallelism (what pipeline stages send each other).
    int64_t activation_rows(int64_t s, int64_t b) const { return tp_.sp() ? s * b / tp_.size : s * b; }
    // The word embedding (first stage) or its tied copy (last stage); null when the stage has neither.
    Parameter * word_embedding() { return wte_.data.defined() ? &wte_ : nullptr; }

    // The layer groups this chunk recomputes (full recompute), as [begin, end) of its local layer indices;
    // empty without. The layers outside every group keep their activations.
    std::vector<std::pair<int64_t, int64_t>> recompute_groups() const;
    // Each layer's strategy for a training pass: recompute inside recompute_groups(), else a graph replay
    // where `graphs` holds them (non-null), else eager.
    std::vector<LayerRun> layer_runs(const LayerGraphs * graphs) const;

    // Every parameter, in a fixed order (embedding first, output last).
    std::vector<Parameter *> parameters();

    // Every parameter's FSDP unit, in parameters() order: the embedding 0, layer i (local index) i + 1, the
    // final norm and output layer num_layers() + 1 (a last stage's tied word embedding with them).
    std::vector<int> parameter_units();

    // The hooks are called with the parameters of each module (embedding, each layer, the final norm with
    // the output layer) around its forward and its backward: DDP's --overlap-param-gather waits for the
    // buckets that hold them before a forward (Megatron's forward pre-hook); Megatron-FSDP gathers and gives
    // back sharded values there, and makes gradient buckets whole before a backward. A full-recompute
    // group's modules get before_backward before their forward runs again. Unset hooks are skipped.
    void set_param_hooks(ParamHooks hooks) { hooks_ = std::move(hooks); }
    int64_t            num_layers() const { return static_cast<int64_t>(layers_.size()); }
    // The factor the auxiliary losses' gradients are scaled by: the MoE routers' aux and z losses (Megatron's
    // MoEAuxLossAutoScaler) and the DSA indexers' KL loss (its DSAIndexerLossAutoScaler), both the loss scale /
    // the number of micro-batches, as the lm loss is averaged over them.
    void    set_aux_loss_scale(float scale);
    // global_aux_loss: a new iteration's micro-batches begin (each router's running mean restarts).
    void    reset_moe_global_counts();
    // --moe-router-enable-expert-bias, once per training iteration after its last backward (Megatron's
    // _update_router_expert_bias in finalize_model_grads): every MoE layer's token counts summed over the
    // TP x DP x CP ranks in one all-reduce, each expert bias moved by the update rate toward balance, the
    // counts cleared. Nothing without the flag.
    void    update_moe_expert_bias();
    // (MoE layers of this chunk, E) f32: the routers' expert biases (undefined without the flag).
    Tensor  moe_expert_bias() const { return moe_expert_bias_; }
    // The state a checkpoint holds beside the parameters, by name, each replicated over TP x DP x CP: each MoE
    // router's expert bias (E) f32, "layers.<i>.mlp.router.expert_bias" (Megatron's buffer); with delayed FP8,
    // each layer's "<layer>.fp8_{forward,backward}_{amax_history,scale}" (model/fp8_delayed.h).
    std::vector<std::pair<std::string, Tensor>> buffers() const;
    // The router's four logged losses (router.h's RouterLoss order) summed over this chunk's MoE layers and
    // over the training forwards since the last call, which clears them; wait for the compute stream first.
    // With `per_layer` (one entry per layer of the whole model), each MoE layer's values are also added at
    // its global layer index.
    std::array<double, 4> take_moe_losses(std::vector<std::array<double, 4>> * per_layer = nullptr);
    int64_t num_moe_layers() const;
    // --mtp-num-layers: each depth's loss, the masked mean cross-entropy of each training micro-batch (over
    // the whole sequences' tokens: a context-parallel rank's is its share) summed over the forwards since the
    // last call, which clears them; wait for the compute stream first. Empty off the last stage.
    std::vector<double> take_mtp_losses();
    // --experimental-attention-variant dsa: the indexers' KL losses (each times its coefficient) summed over this
    // chunk's layers and the training forwards since the last call, which clears them; wait for the compute
    // stream first.
    double take_dsa_losses();
    TransformerLayer & layer(int64_t i) { return *layers_.at(static_cast<size_t>(i)); }
    void zero_grad();

    const GptConfig & config() const { return config_; }
    const ContextParallel & context_parallel() const { return cp_; }
    Device &          device() const { return device_; }

private:
    GptConfig                                      config_;
    PipelineStage                                  stage_;
    Device &                                       device_;
    int64_t                                        vocab_;   // padded
    Parameter                                      wte_;     // (V, h)
    Parameter                                      wpe_;     // (P, h), learned positions only
    std::vector<std::unique_ptr<TransformerLayer>> layers_;
    std::unique_ptr<Norm>                          final_norm_;
    Parameter                                      output_;  // (V, h), untied only
    TensorParallel                                 tp_;
    ExpertParallel                                 ep_;
    ContextParallel                                cp_;
    Tensor                                         moe_expert_bias_, moe_expert_load_;   // (MoE layers, E): routers' rows
    // The MTP depths (last stage only): mtp.layers.<k>.{enorm, hnorm, eh_proj, transformer_layer, final_layernorm}.
    struct MtpDepth {
        std::unique_ptr<Norm>             enorm, hnorm, final_norm;
        std::unique_ptr<Linear>           eh_proj;
        std::unique_ptr<TransformerLayer> layer;
    };
    std::vector<MtpDepth>                          mtp_;
    // Training forwards' depth losses not read yet: (token_loss, the mask plane (b, s) on the host, count).
    struct PendingMtpLoss { Tensor token_loss, mask; double count; size_t depth; };
    std::vector<PendingMtpLoss>                    pending_mtp_;
    int64_t                                        vocab_local_ = 0;   // V / tp rows on this rank
    int64_t                                        vocab_begin_ = 0;   // the first of them

    // tokens (b, s) as rows of this rank's vocabulary shard, -1 for another rank's (the tokens themselves
    // without tensor parallelism).
    Tensor  local_tokens(const Tensor & tokens) const;
    // How many of this rank's vocabulary columns are real tokens (the rest is padding).
    int64_t local_valid_vocab() const;
    // t *= factor on the compute stream (nothing when factor is 1): µP's embedding and output multipliers.
    void    scale_by(const Tensor & t, float factor);
    // Per-token cross-entropy of logits (s*b, V / tp) against labels (b, s): token_loss and lse, (s*b) each.
    void    cross_entropy(const Tensor & logits, const Tensor & labels, Tensor & lse, Tensor & token_loss);
    // The fused classifier's forward (GptConfig::classifier_fusion), from ctx.final_hidden: ctx.lse,
    // ctx.token_loss and ctx.classifier_dx, and `out_w`'s gradient accumulated into its main_grad.
    void    fused_classifier(Context & ctx, Parameter & out_w);
    int64_t classifier_chunk_positions(int64_t s, int64_t b) const;
    // The decoder's layers, then the MTP depths' (MoE bookkeeping spans both).
    std::vector<TransformerLayer *> all_layers() const;
    void    mtp_forward(Context & ctx, const MicroBatch & batch, const Tensor & h, const DropoutBatch & dropout_batch);
    // Returns the gradient of h (the final norm's output rows) from the depths.
    Tensor  mtp_backward(Context & ctx, double loss_scale, const GradReadyFn & ready);
    // ctx.runs is one strategy per layer, recomputes exactly recompute_groups() and replays only with graphs
    // in a training pass.
    void    check_runs(const Context & ctx) const;
    ParamHooks                                     hooks_;
    // The hook with the module's parameters, listed only when the hook is set (the hot path has none).
    template <class Params> static void call(const ParamHooks::Fn & hook, Params && params) {
        if (hook) hook(params());
    }
    std::vector<Parameter *> embedding_params();
    std::vector<Parameter *> layer_params(size_t i);
    std::vector<Parameter *> output_params();
    void                     mtp_parameters(std::vector<Parameter *> & out);
};

}  // namespace loom::model
