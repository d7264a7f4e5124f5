// TensorBoard event files, written without TensorFlow: what Megatron's SummaryWriter writes for
// --tensorboard-dir, and what TensorBoard reads.
//
// A file `events.out.tfevents.<unix seconds>.<host>.<pid>.0` is a sequence of TFRecords:
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data
// with mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. Each record's data is a serialized tensorflow.Event
// protobuf: wall_time (field 1, double), step (2, int64), then file_version (3, "brain.Event:2", the first
// record) or summary (5, a Summary whose value (1) holds tag (1, string) and simple_value (2, float)).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace loom::train {

class TensorBoardWriter {
public:
    // Creates `dir` (and its parents) and a new event file in it; throws loom::Error naming --tensorboard-dir.
    explicit TensorBoardWriter(const std::string & dir);
    ~TensorBoardWriter();
    TensorBoardWriter(const TensorBoardWriter &)             = delete;
    TensorBoardWriter & operator=(const TensorBoardWriter &) = delete;

    // One scalar at `step` (Megatron's add_scalar: the value is stored as a float).
    void add_scalar(const std::string & tag, double value, int64_t step);
    // Writes what is buffered; a write error (a full disk) throws naming the file.
    void flush();

    const std::string & path() const { return path_; }

private:
    void write_record(const std::string & data);

    std::string  path_;
    std::FILE *  file_ = nullptr;
};

}  // namespace loom::train
