// MappedFile: a whole file mapped read-only into memory (RAII), the way the dataset readers see their
// files. The mapping is shared and read-only, so many readers (ranks, datasets) of one file share its
// pages through the page cache; nothing is copied.
//
//   MappedFile f("corpus_text_document.idx", "Megatron index");
//   f.size();   // bytes, checked by the reader against what the header says
//   f.data();   // const uint8_t *, valid while f lives; nullptr for an empty file
//
// A file truncated by another process while it is mapped would kill the reader with SIGBUS; a handler
// installed with the first mapping names the file and exits with status 2 instead.
//
// Multi-byte fields of a mapped file may sit at any byte offset (the int64 arrays of an .idx start at
// 34 + 4N), so read them with load<T>(offset), which copies through memcpy, never through a cast pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace loom::data {

class MappedFile {
public:
    // Throws loom::Error naming `path` and `what` (e.g. "Megatron index") when the file cannot be opened
    // or mapped.
    MappedFile(const std::string & path, const std::string & what);
    ~MappedFile();
    MappedFile(const MappedFile &) = delete;
    MappedFile & operator=(const MappedFile &) = delete;

    const uint8_t *     data() const { return data_; }
    size_t              size() const { return size_; }
    const std::string & path() const { return path_; }

    // The little-endian T at byte `offset` (caller has checked offset + sizeof(T) <= size()).
    template <typename T> T load(size_t offset) const {
        T value;
        std::memcpy(&value, data_ + offset, sizeof(T));
        return value;
    }

private:
    std::string     path_;
    const uint8_t * data_ = nullptr;
    size_t          size_ = 0;
};

}  // namespace loom::data
