// The parser of `loom train`'s and `loom eval`'s flags: Megatron's spellings, defaults and help, declared in
// one table per config (train/flag_table.h, train/flag_values.h), registered on a CLI11 app, then resolved
// and validated in one place with messages that name the flags, into TrainOptions (train/options.h).
#pragma once

#include "comm/agreement.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace loom::train {

// Every value the flag tables write: TrainOptions, and the flags a resolve step reads (train/flag_values.h).
struct FlagValues {
    TrainOptions   options;
    ModelFlags     model;
    OptimFlags     optim;
    ParallelFlags  parallel;
    RecomputeFlags recompute;
    MoeFlags       moe;
    GraphFlags     graphs;
};

// Every flag of `loom train`, from its tables, in the order they are registered (--help's order within a
// group): what the checkpoint's args and docs/megatron_flags.md are made from.
std::vector<FlagInfo> train_flags();

// The flag reference of docs/megatron_flags.md, rendered from the tables (train/flag_table.h).
std::string flag_reference_markdown();

// Registers every table's flags on `app`, then resolves them in one place.
class TrainOptionParser {
public:
    explicit TrainOptionParser(CLI::App & app);
    // After app.parse(): the preset, the flags given, the files they name; validated for `world_size`
    // ranks (tp x pp x dp); throws loom::Error (identically on every rank, before any collective).
    TrainOptions resolve(int64_t world_size = 1);
    // What every rank of a job must hold alike, for comm::check_agreement before the first collective:
    // each flag of the tables with its value as parsed (given or default), and the model `resolved` has
    // (its shape may come from files: --load-hf, --use-checkpoint-args, a tokenizer).
    std::vector<comm::Setting> settings(const TrainOptions & resolved) const;
    // `loom export-hf` builds a model and reads no data: no data source is required.
    void         data_optional() { data_optional_ = true; }
    // `loom plan` runs nothing here: the model need not fit this machine's memory.
    void         plan_only() { plan_only_ = true; }
    // True when --vocab-size, --load-hf, --use-checkpoint-args or a tokenizer (its type, or GPT-2's files
    // alone) fixed the vocabulary (otherwise the dataset's is used).
    bool vocab_given() const {
        const TrainOptions & o = values_.options;
        return app_.count("--vocab-size") > 0 || !o.load_hf.empty() || o.use_checkpoint_args || !o.tokenizer_type.empty() ||
               !o.vocab_file.empty() || !o.merge_file.empty();
    }

private:
    CLI::App &               app_;
    FlagValues               values_;
    std::vector<std::string> noop_values_;   // values of the flags accepted without effect (megatron_flags.h)
    bool                     data_optional_ = false;
    bool                     plan_only_     = false;
};

}  // namespace loom::train
