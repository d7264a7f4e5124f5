// The index cache of --data-cache-path DIR: the GPT dataset's document, sample and shuffle indices and the
// blend's dataset indices, kept between runs as NumPy .npy files, as Megatron's GPTDataset and
// BlendedDataset keep them.
//
// Naming. Every set of indices is described by a JSON text of everything it depends on (the prefix, the
// document range of the split, the number of sequences and tokens in it, the samples asked for, the seed,
// the sequence length, and the version of Loom's index builder; for a blend, its datasets' descriptions,
// the weights and the size). The files are named as Megatron names them, by the MD5 of that text
// (RFC 1321, implemented here; md5_hex("") = d41d8cd98f00b204e9800998ecf8427e):
//   DIR/<md5>-GPTDataset-<split>-description.txt      the description itself
//   DIR/<md5>-GPTDataset-<split>-document_index.npy   int32 (E x documents)
//   DIR/<md5>-GPTDataset-<split>-sample_index.npy     int64 (samples + 1, 2)
//   DIR/<md5>-GPTDataset-<split>-shuffle_index.npy    int64 (samples)
//   DIR/<md5>-BlendedDataset-<split>-{description.txt, dataset_index.npy (int16), dataset_sample_index.npy (int64)}
// Loom's shuffles are not numpy's (gpt_dataset.h), so the description names Loom's builder, and a folder
// shared with Megatron never mixes the two: the hashes differ.
//
// Writing. Each file is written atomically (core/atomic_file.h: a temporary file, fsync, rename), the
// description last, so a crash leaves whole files only, and a set is used only when all its files are
// there. Several ranks writing the same set at once (ranks of one machine, or the data-parallel rank 0 of
// each tensor and pipeline rank) write identical bytes, and each rename replaces a whole file with a whole
// file, so concurrent writers are safe. Only writers (IndexCacheOptions::write: rank 0 of the
// data-parallel group) write; the others load what is there, or build in memory on a miss.
//
// Loading. A set whose files are all there is loaded instead of built, and checked: the description must
// be the expected text, every .npy must have the expected dtype and shape and be exactly as long as its
// header says, and the values must be in range (document ids in the split, sample boundaries inside the
// document index and its documents, the shuffle index a permutation). A file that fails is an error
// naming it, with the hint to delete the set; it is not rebuilt silently, because a damaged cache file
// means damaged storage, which the user should hear about.
//
// .npy: format version 1.0 as numpy.save writes it: "\x93NUMPY", 1, 0, a little-endian uint16 header
// length, the header "{'descr': '<i8', 'fortran_order': False, 'shape': (n, 2), }" padded with spaces and
// a '\n' to a multiple of 64 bytes, then the little-endian values in C order. Versions 2.0 and 3.0 (a
// uint32 header length) are read too.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

// --data-cache-path: the folder (empty: indices are built in memory and nothing is written), and whether
// this rank writes the indices it builds on a miss.
struct IndexCacheOptions {
    std::string path;
    bool        write = true;
};

// MD5 of `bytes`, as 32 lowercase hex digits (Python's hashlib.md5(bytes).hexdigest()).
std::string md5_hex(std::string_view bytes);

// An array read from a .npy file: its shape and its values in C order.
template <typename T> struct NpyArray {
    std::vector<int64_t> shape;
    std::vector<T>       values;
};

// Writes `values` with `shape` (the product of shape = values.size()) as a .npy file, atomically. T is
// int16_t, int32_t or int64_t.
template <typename T>
void write_npy(const std::string & path, std::span<const T> values, std::span<const int64_t> shape);

// Reads a .npy file of dtype T (little-endian, C order); throws naming the file when it is not one, has
// another dtype, or is shorter or longer than its header says.
template <typename T> NpyArray<T> read_npy(const std::string & path);

// The files of one cached set: DIR/<md5(description)>-<cls>-<split>-<suffix>.
class IndexCacheEntry {
public:
    IndexCacheEntry(const IndexCacheOptions & options, std::string description, const std::string & cls,
                    const std::string & split);

    bool                enabled() const { return !options_.path.empty(); }
    bool                writes() const { return enabled() && options_.write; }
    const std::string & description() const { return description_; }
    // DIR/<md5>-<cls>-<split>-<suffix>
    std::string path(const std::string & suffix) const { return base_ + suffix; }
    // True when the description and every one of the `arrays` (suffixes such as "document_index.npy") exist.
    bool complete(std::span<const std::string> arrays) const;
    // Throws naming the description file when it is not exactly description().
    void check_description() const;
    // Writing a set: create_folder(), write_npy(path(suffix), ...) for each array, then write_description()
    // (last, atomically), so that a set is complete only once every array is whole.
    void create_folder() const;
    void write_description() const;
    // Once a set is built: whether this rank writes it now (then its folder exists). `note` is set to what
    // the log line says of it (" [indices written to DIR]", or " [indices built, not in DIR yet]" on a rank
    // that does not write); without a cache it is left as it was.
    bool start_writing(std::string & note) const;

private:
    IndexCacheOptions options_;
    std::string       description_, base_;
};

}  // namespace loom::data
