// The training data of `loom train`, chosen by the options: --text-file (bytes), or the built-in
// synthetic dataset by default. Megatron datasets (--data-path) and llm.c shards (--llmc-shard) are
// rejected with a clear message until their readers land.
#pragma once

#include "data/token_dataset.h"
#include "train/options.h"
#include "train/trainer.h"

#include <memory>

namespace loom::train {

// Builds the dataset and loader for data-parallel rank dp_rank of dp_size; sets options.model.vocab_size
// from the dataset unless --vocab-size was given (then it must hold the dataset's tokens).
std::unique_ptr<BatchSource> make_batch_source(TrainOptions & options, Device & device, bool vocab_given,
                                               int64_t dp_rank = 0, int64_t dp_size = 1);

}  // namespace loom::train
