// Untrusted JSON (safetensors headers, config.json, checkpoint indexes, vocabularies, params files) may nest
// arbitrarily deep: nlohmann::json parses it without recursion, but destroying or dumping the result
// recurses once per level, and 100 000 levels overflow the stack. Every parse of a file's JSON passes this
// callback, which refuses the document at the first level past `max_depth`, before it is built. For the
// formats whose keys are names (checkpoint indexes, safetensors headers), JsonKeys::unique also refuses an
// object that holds a key twice: nlohmann::json would keep the last silently, so a second tensor entry could
// replace the first unseen.
//
//   json j = json::parse(text, json_parse_checks<json>("safetensors header of 'x.safetensors'", JsonKeys::unique));
//
// json_error_text(e) is a parse or type error in Loom's words: the message without nlohmann's
// "[json.exception.type_error.302] " prefix.
#pragma once

#include "core/error.h"

#include <exception>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace loom {

inline constexpr int kMaxJsonDepth = 64;

enum class JsonKeys { any, unique };

template <typename Json>
auto json_parse_checks(std::string what, JsonKeys keys = JsonKeys::any, int max_depth = kMaxJsonDepth) {
    auto seen = std::make_shared<std::vector<std::unordered_set<std::string>>>();   // one set per open object
    return [what = std::move(what), keys, max_depth, seen](int depth, typename Json::parse_event_t event, Json & parsed) {
        LOOM_CHECK(depth <= max_depth, what << " nests deeper than " << max_depth << " levels",
                   "the file is not what it claims to be; no format Loom reads nests that deep");
        if (keys == JsonKeys::unique) {
            if (event == Json::parse_event_t::object_start) seen->emplace_back();
            if (event == Json::parse_event_t::object_end && !seen->empty()) seen->pop_back();
            if (event == Json::parse_event_t::key && !seen->empty()) {
                const std::string & key = parsed.template get_ref<const std::string &>();
                LOOM_CHECK(seen->back().insert(key).second, what << " holds the key \"" << key << "\" twice in one object",
                           "the file was edited or damaged: each name appears once");
            }
        }
        return true;
    };
}

inline std::string json_error_text(const std::exception & e) {
    std::string text = e.what();
    if (text.rfind("[json.exception.", 0) == 0) {
        const size_t end = text.find("] ");
        if (end != std::string::npos) text.erase(0, end + 2);
    }
    return text;
}

}  // namespace loom
