#include "train/megatron_flags.h"

#include "core/error.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

namespace loom::train {

namespace {

constexpr NoOpFlag kNoOpFlags[] = {
    {"--use-mcore-models", nullptr, "Megatron Core's GPT is the model Loom builds (the flag is deprecated upstream)"},
    {"--transformer-impl", "local|transformer_engine",
     "both name the same layer math; Loom runs its own kernels for either"},
    {"--distributed-backend", "nccl|gloo", "Loom's communicator is MPI on the CPU (NCCL on CUDA), chosen by the device"},
    {"--no-gradient-accumulation-fusion", nullptr,
     "Loom accumulates weight gradients straight into the main_grad buffer in any case"},
    {"--attention-softmax-in-fp32", nullptr, "Loom's softmax always runs in f32, also with --bf16"},
    {"--deterministic-mode", nullptr, "Loom's kernels and reductions are deterministic: every run is bitwise repeatable"},
    {"--no-masked-softmax-fusion", nullptr, "a kernel-fusion choice; the result is the same"},
    {"--no-bias-gelu-fusion", nullptr, "a kernel-fusion choice; the result is the same"},
    {"--no-bias-swiglu-fusion", nullptr, "a kernel-fusion choice; the result is the same"},
    {"--no-bias-dropout-fusion", nullptr, "a kernel-fusion choice; the result is the same"},
    {"--no-rope-fusion", nullptr, "a kernel-fusion choice; the result is the same"},
    {"--no-persist-layer-norm", nullptr, "a kernel choice; the result is the same"},
    {"--te-rng-tracker", nullptr,
     "Loom's dropout masks are a hash of (seed, site, sample, position), with no generator state: graph capture "
     "needs no other tracker"},
    {"--use-flash-attn", nullptr, "Loom's attention is always tiled (flash-style) and never forms the full matrix"},
    {"--attention-backend", "auto|flash|fused|unfused|local",
     "every backend computes exact softmax attention; on CUDA Loom runs cuDNN's fused attention where the call is "
     "plain causal bf16 attention (head size a multiple of 8 up to 128) and its own tiled kernel elsewhere, whichever "
     "is named"},
    {"--no-async-tensor-model-parallel-allreduce", nullptr, "a communication-overlap choice; the result is the same"},
    {"--tiktoken-pattern", "v1|v2",
     "the pre-tokenizer pattern of --tokenizer-type TikTokenizer, which Loom refuses; Megatron's other tokenizers "
     "ignore it, as Loom does"},
    {"--num-workers", "", "Loom's loader reads memory-mapped samples on the training thread; there are no workers"},
    {"--no-mmap-bin-files", nullptr, "Loom maps the .bin; the tokens read are the same"},
    {"--no-create-attention-mask-in-dataloader", nullptr,
     "Loom's attention applies the causal mask in the kernel; no mask is ever built"},
    {"--use-persistent-ckpt-worker", nullptr,
     "the worker that runs --async-save's writes; Loom's is a thread per save, the checkpoint is the same"},
    {"--auto-detect-ckpt-format", nullptr, "Loom has one checkpoint format, which it reads"},
    {"--ckpt-fully-parallel-load", nullptr, "every rank reads only the pieces it needs in any case"},
    {"--apply-query-key-layer-scaling", nullptr,
     "an identity outside fp16: the scores are divided by the layer number and the f32 softmax multiplies it back"},
    {"--calculate-per-token-loss", nullptr,
     "every token of a Loom micro-batch counts, so normalising by the global token count equals Loom's per "
     "micro-batch mean"},
    {"--manual-gc", nullptr, "Python's garbage collector; Loom has none"},
    {"--dist-ckpt-optim-fully-reshardable", nullptr,
     "Loom's checkpoints, optimizer state included, reshard across DP, TP and PP in any case"},
    {"--no-use-tokenizer-model-from-checkpoint-args", nullptr, "Loom's checkpoints record no tokenizer model"},
    {"--ckpt-assume-constant-structure", nullptr,
     "a caching choice of Megatron's save; Loom plans each save afresh (a list of its pieces), and writes the same "
     "checkpoint"},
    {"--no-ckpt-fully-parallel-save", nullptr,
     "Loom's save is parallel by construction: each element is written once, by the rank that steps it; the "
     "checkpoint is the same either way"},
    {"--ckpt-fully-parallel-save", nullptr, "deprecated upstream, where it has no effect either"},
    {"--moe-permute-fusion", nullptr, "a kernel-fusion choice for the token permutation; the tokens moved are the same"},
    {"--enable-gpt-oss", nullptr,
     "ModelOpt's switch to YaRN RoPE with gpt-oss's values, read only where a ModelOpt checkpoint or a distillation "
     "builds the model; pretraining from scratch never reads it, in Megatron or in Loom (give the gpt-oss layers' own "
     "flags, as Megatron's gpt-oss example does)"},
    {"--export-force-local-attention", nullptr,
     "ModelOpt's export layer spec (local attention instead of Transformer Engine's), read only where a ModelOpt "
     "checkpoint or a distillation builds the model; Loom's attention is one kernel for either"},
    {"--disable-bf16-reduced-precision-matmul", nullptr,
     "Loom's bf16 GEMMs always sum in f32, their split-K partial sums included (cuBLASLt's reduction scheme held to "
     "f32 on CUDA)"},
    {"--moe-router-fusion", nullptr,
     "a kernel-fusion choice for the router's scores, top-k and auxiliary losses; the routing and the losses are the "
     "same"},
    {"--manual-gc-interval", "", "Python's garbage collector; Loom has none"},
    {"--verify-integrity", nullptr,
     "Loom's index holds every checkpoint file's CRC-32C, written on each save and checked on each load, with or "
     "without the flag"},
    {"--async-strategy", "nvrx|mcore", "the engine of --async-save; Loom's writes from a host snapshot on a thread"},
    {"--overlap-p2p-communication-warmup-flush", nullptr,
     "a communication-overlap choice of the pipeline's warm-up and flush; the transfers and the result are the same"},
    {"--overlap-moe-expert-parallel-comm", nullptr,
     "a communication-overlap choice of the expert-parallel all-to-alls; the tokens moved and the result are the same"},
    {"--delay-wgrad-compute", nullptr,
     "when the weight gradients are computed within the backward (to overlap the expert-parallel all-to-alls, "
     "with --overlap-moe-expert-parallel-comm, as Megatron requires); the gradients are the same"},
    {"--defer-embedding-wgrad-compute", nullptr,
     "when the embedding's weight gradient is computed within the step; the gradient is the same"},
    {"--wgrad-deferral-limit", "", "how many micro-batches --defer-embedding-wgrad-compute defers; no effect on the result"},
    {"--use-transformer-engine-op-fuser", nullptr, "a kernel-fusion choice of Transformer Engine; the result is the same"},
    {"--async-ckpt-use-cpu-shm", nullptr, "an --async-save staging choice; Loom's snapshot is host memory of its own"},
    {"--disable-gloo-process-groups", nullptr, "Loom creates no Gloo groups: its host-side collectives run over MPI"},
    {"--straggler-minmax-count", "", "the number of ranks --log-straggler reports, which Loom does not accept"},
    {"--test-mode", nullptr,
     "Megatron's in-model self-tests of its attention; Loom checks each kernel against its twin in its own test suite"},
    {"--fsdp-double-buffer", nullptr,
     "a buffer-reuse choice of Megatron-FSDP's gathers and reductions; Loom's allocator reuses the same blocks by "
     "size class in any case, and the result is the same"},
    {"--no-gradient-reduce-div-fusion", nullptr,
     "whether Megatron-FSDP fuses the 1/dp division into its reduction; Loom scales before the collective, and the "
     "result is the same either way"},
    {"--create-all-gather-group", nullptr,
     "a second group so that all-gathers and reduce-scatters overlap; Loom's run one after the other on DDP's "
     "stream, with the same result"},
    {"--empty-unused-memory-level", "0|1|2",
     "torch.cuda.empty_cache() between steps; Loom's allocator keeps its pools, which changes no result "
     "(its statistics report the peak either way)"},
};

}  // namespace

const std::map<std::string, std::string> & refusal_hints() {
    static const std::map<std::string, std::string> hints = {
        {"--tokenizer-model", "Loom reads GPT-2 BPE files (--tokenizer-type GPT2BPETokenizer --vocab-file V "
                              "--merge-file M) or plain ids (--tokenizer-type NullTokenizer --vocab-size N)"},
    };
    return hints;
}

namespace {

// argparse's _negative_number_matcher, widened to exponents: such a word is a value, not a flag.
bool looks_like_negative_number(const char * word) {
    if (word[0] != '-' || word[1] == '\0') return false;
    char * end = nullptr;
    std::strtod(word, &end);
    return end != nullptr && *end == '\0';
}

bool looks_like_flag(const char * word) { return word[0] == '-' && word[1] != '\0' && !looks_like_negative_number(word); }

}  // namespace

std::span<const NoOpFlag> noop_flags() { return kNoOpFlags; }

void add_noop_flags(CLI::App & app, std::vector<std::string> & sink) {
    sink.assign(std::size(kNoOpFlags), std::string());
    for (size_t i = 0; i < std::size(kNoOpFlags); ++i) {
        const NoOpFlag & f    = kNoOpFlags[i];
        std::string      help = std::string("accepted, no effect: ") + f.reason;
        if (f.values == nullptr) {
            app.add_flag(f.name)->description(help)->group("accepted without effect");
            continue;
        }
        CLI::Option * option = app.add_option(f.name, sink[i], help)->group("accepted without effect");
        if (f.values[0] == '\0') continue;
        std::vector<std::string> allowed;
        std::stringstream        values(f.values);
        for (std::string v; std::getline(values, v, '|');) allowed.push_back(v);
        const std::string name = f.name;
        option->check(CLI::Validator(
            [allowed, name](std::string & value) {
                for (const std::string & a : allowed) {
                    if (a == value) return std::string();
                }
                std::string list;
                for (const std::string & a : allowed) list += (list.empty() ? "" : ", ") + a;
                return name + " " + value + " is not supported by Loom (it accepts " + list +
                       ", which behave as Loom does)";
            },
            std::string(f.values), "megatron-value"));
    }
}

void check_option_values(const CLI::App & app, int argc, const char * const * argv) {
    for (int i = 1; i < argc; ++i) {
        const char * word = argv[i];
        if (std::strncmp(word, "--", 2) != 0) continue;
        if (const char * eq = std::strchr(word, '='); eq != nullptr) {
            // argparse's store_true and store_false take no value, not even "true".
            const std::string   name(word, eq);
            const CLI::Option * option = app.get_option_no_throw(name);
            LOOM_CHECK(option == nullptr || option->get_expected_min() > 0,
                       "argument " << name << ": ignored explicit argument '" << eq + 1 << "'",
                       name << " is a switch: give it alone to turn it on, or leave it out");
            continue;
        }
        const CLI::Option * option = app.get_option_no_throw(word);
        if (option == nullptr || option->get_expected_min() == 0) continue;   // unknown, or a switch
        LOOM_CHECK(i + 1 < argc && !looks_like_flag(argv[i + 1]),
                   "argument " << word << ": expected one argument"
                               << (i + 1 < argc ? std::string(", got the flag '") + argv[i + 1] + "'" : std::string()),
                   "give " << word << " a value; a value that starts with '-' is read as a flag (argparse's rule)");
    }
}

std::string unsupported_flags_message(const std::vector<std::string> & remaining) {
    std::vector<std::pair<std::string, std::string>> flags;   // flag, its values
    for (const std::string & word : remaining) {
        if (looks_like_flag(word.c_str()) || flags.empty()) {
            flags.emplace_back(word, "");
        } else {
            flags.back().second += " " + word;
        }
    }
    if (flags.empty()) return "";
    std::ostringstream os;
    os << (flags.size() == 1 ? "this flag is" : std::to_string(flags.size()) + " flags are") << " not supported by Loom:";
    for (const auto & [flag, values] : flags) {
        const std::string name = flag.substr(0, flag.find('='));
        os << "\n  " << flag << values;
        if (!looks_like_flag(flag.c_str())) {
            os << "  (a value with no flag before it)";
            continue;
        }
        auto hint = refusal_hints().find(name);
        if (hint != refusal_hints().end()) os << "  (" << hint->second << ")";
    }
    return os.str();
}

}  // namespace loom::train
