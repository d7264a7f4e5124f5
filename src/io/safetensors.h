// safetensors files: reading with the whole header validated first, and writing F32 tensors atomically. The
// format of Hugging Face checkpoints (model/hf_gpt2.h) and of Loom's own checkpoint shards
// (checkpoint/checkpoint.h).
//
// safetensors (the layout the safetensors crate documents), little-endian throughout:
//
//   offset   bytes  field
//   0        8      uint64 N, the length of the JSON header
//   8        N      JSON: {name: {"dtype": "F32"|"BF16"|"F16"|..., "shape": [...], "data_offsets": [begin, end]},
//                          "__metadata__": {string: string}}            (optional key; padded with spaces)
//   8 + N    ...    the tensors' raw bytes, C order; [begin, end) is relative to offset 8 + N
//
// SafetensorsFile validates the whole header before anything is read, as the safetensors crate does:
// the file holds the 8-byte length and the N header bytes, the header is a JSON object, each tensor has
// a known dtype, a shape of non-negative sizes and end - begin = numel x dtype bytes, and the tensors,
// sorted by offset, tile the data bytes exactly (no overlap, no gap, nothing past the end, no trailing
// bytes). Every failure is a loom::Error naming the file and the tensor. read_f32() converts F32, BF16
// and F16 tensors to float32 (other dtypes are listed but cannot be read as weights).
#pragma once

#include "core/input_file.h"
#include "core/tensor.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::io {

struct SafetensorsEntry {
    std::string name;
    std::string dtype;       // "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"
    Shape       shape;
    uint64_t    begin = 0;   // bytes, relative to the start of the data
    uint64_t    end   = 0;
};

// Bytes per element of a safetensors dtype name; 0 for a name this reader does not know.
size_t safetensors_dtype_size(const std::string & dtype);

class SafetensorsFile {
public:
    // Opens `path` and validates its header (see the top of this file); throws loom::Error.
    explicit SafetensorsFile(const std::string & path);

    const std::string &                        path() const { return path_; }
    const std::vector<SafetensorsEntry> &      entries() const { return entries_; }   // by offset
    const std::map<std::string, std::string> & metadata() const { return metadata_; }
    bool                                       contains(const std::string & name) const;
    // Throws naming the file when `name` is absent.
    const SafetensorsEntry &                   entry(const std::string & name) const;
    // The tensor's elements as float32 (F32, BF16, F16); throws for other dtypes. Reads through one
    // FILE position: not for concurrent calls on one SafetensorsFile.
    std::vector<float>                         read_f32(const std::string & name) const;
    // The same into `out` (numel elements; F32 entries are read straight into it).
    void                                       read_f32(const std::string & name, float * out) const;

private:
    std::string                            path_;
    InputStream                            file_;
    uint64_t                               data_start_ = 0;   // 8 + N
    std::vector<SafetensorsEntry>          entries_;           // sorted by begin
    std::map<std::string, size_t>          index_;             // name -> position in entries_
    std::map<std::string, std::string>     metadata_;
};

struct SafetensorsTensor {
    std::string        name;
    Shape              shape;
    std::vector<float> data;   // numel(shape) elements, C order
};

// Writes F32 tensors in the given order to `path` atomically (<path>.tmp.<pid>, flushed, then renamed).
void write_safetensors(const std::string & path, const std::vector<SafetensorsTensor> & tensors,
                       const std::map<std::string, std::string> & metadata = {});

}  // namespace loom::io
