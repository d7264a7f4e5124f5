// The training data of `loom train`, chosen by the options: a Megatron dataset or a weighted blend of
// them (--data-path; the train range of --split, train_iters x global batch samples; or the per-split
// --train-data-path ..., data/blended_dataset.h), an llm.c token shard (--llmc-shard), a text file of bytes
// (--text-file), or the built-in synthetic dataset by default.
#pragma once

#include "data/gpt_dataset.h"
#include "data/token_dataset.h"
#include "train/options.h"
#include "train/trainer.h"

#include <memory>

namespace loom::train {

// Builds the dataset and loader for data-parallel rank dp_rank of dp_size; sets options.model.vocab_size
// from the dataset unless --vocab-size was given (then it must hold the dataset's tokens).
// `split` picks the range of a Megatron dataset (--split); other sources ignore it. num_samples 0 means
// train_iters x global batch.
std::unique_ptr<BatchSource> make_batch_source(TrainOptions & options, Device & device, bool vocab_given,
                                               int64_t dp_rank = 0, int64_t dp_size = 1,
                                               data::Split split = data::Split::train, int64_t num_samples = 0);

// A loader over `dataset` for data-parallel rank dp_rank of dp_size: what make_batch_source builds over the
// flags' dataset (loom plan's over a dataset of the right shapes and no content).
std::unique_ptr<BatchSource> loader_source(std::unique_ptr<data::TokenDataset> dataset, int64_t micro_batch_size,
                                           int64_t dp_rank, int64_t dp_size, Device & device);

// Context parallelism (model::ContextParallel): each micro-batch of `source` cut to this CP rank's two
// chunks of every sequence, with the whole sequences' loss-mask sum (MicroBatch::sequence_tokens). Every CP
// rank of a data-parallel rank reads the same samples. size 1 returns `source`.
// With mtp_depths (--mtp-num-layers), each micro-batch's MTP planes are cut from the whole sequences first
// (model::add_mtp_targets), so a depth's token k + 1 ahead may come from another rank's chunk.
std::unique_ptr<BatchSource> context_parallel_part(std::unique_ptr<BatchSource> source, int rank, int size,
                                                   int64_t mtp_depths = 0);

}  // namespace loom::train
