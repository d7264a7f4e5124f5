// The agreement's messages (comm/agreement.h): the settings another rank sent, decoded, then compared with
// this rank's and reported, as check_agreement does with every rank's bytes. The input is two ranks' encoded
// settings separated by the first 0xFF byte (a byte the encoding never writes).
#include "comm/agreement.h"
#include "fuzz/fuzz_input.h"

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string_view bytes(reinterpret_cast<const char *>(data), size);
    const size_t           cut = bytes.find('\xff');
    try {
        std::vector<std::vector<loom::comm::Setting>> per_rank;
        per_rank.push_back(loom::comm::decode_settings(bytes.substr(0, cut)));
        if (cut != std::string_view::npos) per_rank.push_back(loom::comm::decode_settings(bytes.substr(cut + 1)));
        // What was decoded encodes back to the same bytes.
        for (const auto & settings : per_rank) {
            const std::string again = loom::comm::encode_settings(settings);
            if (loom::comm::decode_settings(again).size() != settings.size()) __builtin_trap();
        }
        loom::comm::disagreements(per_rank);
        loom::comm::disagreements(per_rank, false);
    } catch (const loom::Error &) {
    }
    return 0;
}
