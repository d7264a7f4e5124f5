// Untrusted JSON (safetensors headers, config.json, checkpoint indexes, vocabularies, params files) may nest
// arbitrarily deep: nlohmann::json parses it without recursion, but destroying or dumping the result
// recurses once per level, and 100 000 levels overflow the stack. Every parse of a file's JSON passes this
// callback, which refuses the document at the first level past `max_depth`, before it is built.
//
//   json j = json::parse(text, json_depth_limit<json>("safetensors header of 'x.safetensors'"));
#pragma once

#include "core/error.h"

#include <string>

namespace loom {

inline constexpr int kMaxJsonDepth = 64;

template <typename Json>
auto json_depth_limit(std::string what, int max_depth = kMaxJsonDepth) {
    return [what = std::move(what), max_depth](int depth, typename Json::parse_event_t, Json &) {
        LOOM_CHECK(depth <= max_depth, what << " nests deeper than " << max_depth << " levels",
                   "the file is not what it claims to be; no format Loom reads nests that deep");
        return true;
    };
}

}  // namespace loom
