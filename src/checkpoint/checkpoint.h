// Checkpoints in parameter space: what each rank holds, written as the pieces of the full logical tensors
// it owns, so that any saved layout (DP x TP x PP x VPP, ZeRO-1 on or off, any offload fraction) loads into
// any other (docs/design/conventions.md B3 and C1-C5: never save optimizer state in buffer space).
//
// Layout on disk (Megatron's folder names; the files are Loom's own, in open formats):
//
//   DIR/latest_checkpointed_iteration.txt     the iteration of the newest complete checkpoint ("10\n")
//   DIR/iter_0000010/index.json               rank 0: format, iteration, metadata (the args, consumed
//                                             samples, the saved layout), the optimizer step, every file
//                                             with its size and CRC-32C, every tensor with its full shape,
//                                             dtype and pieces
//   DIR/iter_0000010/rank_00003.safetensors   world rank 3's pieces (safetensors, see model/hf_gpt2.h)
//
// A piece is a flat range [begin, end) of one rank's tensor-parallel part of a parameter (its TpSlice:
// which rows or columns of the full tensor that part holds). Its entries in the rank's file are
//   "<name>:<begin>:values"       the model's values in the model's dtype (F32, BF16 or F16)
//   "<name>:<begin>:master"       the f32 master weights (only for 16-bit values; F32 values are the master)
//   "<name>:<begin>:exp_avg"      Adam's m, f32
//   "<name>:<begin>:exp_avg_sq"   Adam's v, f32
// A buffer (RankContents::buffers: state without an optimizer slot, such as a MoE router's expert bias) is
// one F32 piece "<name>:0:values" covering it, written by one of the ranks that hold the same copy.
// Pieces are the optimizer's slots (optim/optimizer.h): whole parameters for AdamW, the ZeRO-1 shard pieces
// for the distributed optimizer, so every element is written once, by the rank that steps it. Left out:
// the last stage's copy of the tied word embedding (`shared`), a TP-replicated parameter on TP ranks other
// than 0 (`tp_duplicate`), and everything on data-parallel replicas when the optimizer is not sharded
// (RankContents::writes false; for expert parameters, expert-data-parallel replicas: writes_experts).
//
// Saving (every rank calls save(); the world communicator orders the steps):
//   1. rank 0 removes stale DIR/iter_*.tmp folders and creates DIR/iter_0000010.tmp;      barrier
//   2. each writing rank writes rank_N.safetensors (through core/atomic_file.h: temporary file, fsync,
//      rename, fsync of the folder) and rank_N.json (its pieces, its file's size and CRC-32C);   barrier
//   3. rank 0 merges the rank_N.json files into index.json (atomically), removes them, renames the
//      folder to DIR/iter_0000010, fsyncs DIR, then writes latest_checkpointed_iteration.txt atomically;
//      barrier.
// A kill at any instant leaves the tracker naming the previous complete checkpoint (or none), and that
// folder untouched. LOOM_CHECKPOINT_KILL_AT=k (a test seam) sends SIGKILL to the process at the k-th of the
// points between those steps (counted from 1 over the whole run, 9 per save: after step 1, after a shard's
// header, half-way through its entries, after its rename, after rank_N.json, after index.json, after the
// merge, after the folder's rename, after the tracker). LOOM_CHECKPOINT_WRITE_DELAY_MS=t (a test seam) holds
// each rank's writing of its shard for t ms (a slow disk), to show --async-save training on meanwhile.
//
// Loading (each rank on its own, no collective): the index is parsed and checked in full (format, every
// file's size, every tensor's shape and that its pieces tile it exactly); each shard file's CRC-32C is
// checked the first time the rank reads from it. For every parameter it holds, the rank assembles the full
// tensor from the saved pieces (one tensor and one kind at a time), takes its own TpSlice, and for each of
// its optimizer slots the slot's range of master, m and v, loaded slot by slot
// (HybridDeviceOptimizer::load_slot_state); the buffers are reused from tensor to tensor. Values come from the f32 master when the checkpoint has one, so
// a bf16 checkpoint resumes an f32 run at full precision. A vocabulary tensor (word embedding, output
// layer) whose padded row count differs (another --tensor-model-parallel-size pads differently) keeps the
// common rows; both must hold the real vocabulary, and the padding rows, which no token reads and no loss
// column trains, are zero. Every failure names the file (or the index) and the tensor.
#pragma once

#include "comm/communicator.h"
#include "core/tensor.h"
#include "model/parameter.h"
#include "optim/optimizer.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace loom::checkpoint {

inline constexpr const char * kTrackerFile = "latest_checkpointed_iteration.txt";
inline constexpr const char * kIndexFile   = "index.json";
inline constexpr int          kFormatVersion = 1;

// "iter_0000010", as Megatron names the folders (seven digits).
std::string iteration_folder(int64_t iteration);

// State of the model that is not a parameter (no gradient, no optimizer slot): the MoE routers' expert
// biases (model/moe/router.h). f32, saved whole ("<name>:0:values", one piece) by one rank of the ranks that
// hold the same copy (RankContents::writes_buffers), loaded whole by every rank that holds it.
struct Buffer {
    std::string name;   // "layers.3.mlp.router.expert_bias"
    Tensor      data;
    // State a checkpoint of another configuration lacks as a matter of course (delayed FP8's histories and
    // scales): absent, it keeps its initial values and is listed in LoadReport::fresh, never refused.
    bool        optional = false;
};

// What one rank contributes to a checkpoint, or receives from one.
struct RankContents {
    std::vector<model::Parameter *> params;               // every parameter this rank holds
    std::vector<Buffer>             buffers;              // and every buffer
    bool                            writes_buffers = true;   // false: another rank holding the same ones writes them
    optim::Optimizer *              optimizer = nullptr;  // its slots are the pieces (null: load values only)
    bool                            writes    = true;     // false: a replica whose pieces another rank writes
    bool                            writes_experts = true;   // the same for expert parameters (Parameter::expert)
    comm::Communicator *            world     = nullptr;  // every rank of the job (null: one process)
};

struct SaveStats {
    int64_t bytes   = 0;   // written by all ranks (files of the checkpoint folder)
    double  seconds = 0;
};

// Writes DIR/iter_<iteration> as above; `metadata` goes into the index as given (rank 0's). Every rank of
// `world` calls it. Throws naming the path when a file cannot be written.
SaveStats save(const std::string & dir, int64_t iteration, const nlohmann::json & metadata,
               const RankContents & rank, bool with_optimizer);

// The same save in two halves, for --async-save: begin_save (collective) creates the temporary folder and,
// with `background`, copies this rank's pieces into pinned host memory (the "checkpoint" pool) and writes them on a
// thread of their own while training goes on (step 2 above; without it, writes them before returning);
// finish_save (collective) waits for this rank's writer, then runs step 3. Until finish_save has returned
// the tracker names the previous checkpoint, so a kill at any instant of either half leaves it loadable.
// Destroying an unfinished save joins its writer and commits nothing.
class SaveInProgress {
public:
    struct State;
    explicit SaveInProgress(std::unique_ptr<State> state);
    ~SaveInProgress();
    SaveInProgress(const SaveInProgress &)             = delete;
    SaveInProgress & operator=(const SaveInProgress &) = delete;
    bool    written() const;   // this rank's writer is done (finish_save will not wait for it)
    int64_t iteration() const;

private:
    friend SaveStats finish_save(SaveInProgress & save, comm::Communicator * world);
    std::unique_ptr<State> state_;
};
std::unique_ptr<SaveInProgress> begin_save(const std::string & dir, int64_t iteration, const nlohmann::json & metadata,
                                           const RankContents & rank, bool with_optimizer, bool background);
SaveStats finish_save(SaveInProgress & save, comm::Communicator * world);

// The --save folder held by the job that writes it, from before its first step to its end: rank 0 takes an
// open-file-description lock (fcntl F_OFD_SETLK, which NFS carries too) on DIR/.loom-save.lock, creating
// DIR, and writes who holds it there. A second job saving into DIR is refused naming the holder (without
// it, its save would also delete the first job's unfinished iter_*.tmp folders as leftovers). The lock is
// released when the holder ends, however it ends; the file stays.
inline constexpr const char * kSaveLockFile = ".loom-save.lock";

class SaveFolderLock {
public:
    // Throws loom::Error naming DIR and the holder ("pid 123 on host, since <time>") when another holds it.
    explicit SaveFolderLock(const std::string & dir);
    ~SaveFolderLock();
    SaveFolderLock(const SaveFolderLock &)             = delete;
    SaveFolderLock & operator=(const SaveFolderLock &) = delete;

private:
    int fd_ = -1;
};

// One saved piece (see the top of this file).
struct Piece {
    std::string                              file;
    int                                      tp_dim = -1;
    std::vector<std::pair<int64_t, int64_t>> tp_ranges;
    std::pair<int64_t, int64_t>              tp_outer{0, -1};   // tp_dim >= 1: the range of dim 0 held (model::TpSlice)
    Shape                                    local_shape;   // the saving rank's part of the tensor
    int64_t                                  begin = 0, end = 0;   // flat range of that part
};

struct TensorRecord {
    Shape              shape;   // the full logical tensor
    std::string        dtype;   // of the values: "F32", "BF16" or "F16"
    std::vector<Piece> pieces;
};

struct FileRecord {
    uint64_t bytes  = 0;
    uint32_t crc32c = 0;
};

struct Index {
    std::string                         folder;   // DIR/iter_XXXXXXX
    int64_t                             iteration = 0;
    nlohmann::json                      metadata;
    bool                                has_optimizer = false;
    int64_t                             optimizer_step = 0;
    std::map<std::string, FileRecord>   files;
    std::map<std::string, TensorRecord> tensors;

    std::string path() const { return folder + "/" + kIndexFile; }
};

// The folder `--load DIR [--ckpt-step N]` names: DIR/iter_<N>, or the iteration in DIR's tracker file;
// nothing when DIR holds no tracker file and no step was asked for (Megatron then trains from scratch).
// `dir` may also be an iteration folder itself (it holds index.json). Throws naming the file when the
// tracker cannot be read or the folder does not exist.
std::optional<std::string> find_checkpoint(const std::string & dir, std::optional<int64_t> step = std::nullopt);

// Parses and checks DIR/iter_X/index.json and the sizes of the files it lists; throws naming the index.
Index read_index(const std::string & folder);

struct LoadOptions {
    bool    optimizer  = true;   // load master, m, v and the step (false: master = the loaded values, m = v = 0)
    int64_t vocab_size = 0;      // real rows of the vocabulary tensors (0: their shapes must match exactly)
    // A parameter the index does not list: false, an error naming it; true, it keeps its values (and its
    // optimizer slots a fresh state over them) and is reported in LoadReport::absent.
    bool    allow_absent = false;
};

// What a load found: the parameters of this rank the checkpoint does not hold (Megatron's "unexpected"
// keys: asked for, not there), and the names of the checkpoint's tensors this rank read.
struct LoadReport {
    std::vector<std::string> absent;
    std::vector<std::string> fresh;   // optional buffers the checkpoint lacks, kept at their initial values
    std::set<std::string>    read;
};

// The parameters and buffers of `rank` the index does not list, each once, in the rank's order.
std::vector<std::string> absent_tensors(const Index & index, const RankContents & rank);

// Loads the checkpoint into this rank's parameters and optimizer (see the top of this file).
LoadReport load(const Index & index, const RankContents & rank, const LoadOptions & options);

// The whole logical tensor `name` ("values", "master", "exp_avg", "exp_avg_sq") as f32, assembled from
// every piece; the files read are checksummed. For export and tests.
std::vector<float> read_tensor(const Index & index, const std::string & name, const std::string & kind = "values");

// Every check a --load runs, without a model: each file's size and CRC-32C, its safetensors header, and
// every kind of every tensor the index lists assembled from its pieces (each entry present, of the
// index's dtype and size, its values finite). Throws naming the first bad file and entry.
void verify(const Index & index);

}  // namespace loom::checkpoint
