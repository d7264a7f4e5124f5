#include "train/layer_pattern.h"

#include "core/error.h"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace loom::train {

namespace {

// A recursive-descent parser of sum := atom ('+' atom)*, atom := ('[' ints ']' | '(' sum ')') ('*' int)*.
class LayerPatternParser {
public:
    LayerPatternParser(const std::string & text, const char * flag) : text_(text), flag_(flag) {}
    std::vector<int> parse() {
        std::vector<int> out = sum();
        skip();
        LOOM_CHECK(at_ == text_.size(), flag_ << " '" << text_ << "': unexpected '" << text_.substr(at_) << "'",
                   "write an integer or a list expression such as \"([1]*3+[0]*1)*2\"");
        return out;
    }

private:
    void skip() { while (at_ < text_.size() && text_[at_] == ' ') ++at_; }
    bool take(char c) {
        skip();
        if (at_ < text_.size() && text_[at_] == c) return ++at_, true;
        return false;
    }
    int64_t integer() {
        skip();
        size_t end = at_;
        while (end < text_.size() && std::isdigit(static_cast<unsigned char>(text_[end]))) ++end;
        LOOM_CHECK(end > at_ && end - at_ < 10, flag_ << " '" << text_ << "': a number expected at '" << text_.substr(at_) << "'", "");
        int64_t value = std::stoll(text_.substr(at_, end - at_));
        at_ = end;
        return value;
    }
    std::vector<int> atom() {
        std::vector<int> out;
        if (take('(')) {
            out = sum();
            LOOM_CHECK(take(')'), flag_ << " '" << text_ << "': a ')' is missing", "");
        } else {
            LOOM_CHECK(take('['), flag_ << " '" << text_ << "': a list or '(' expected at '" << text_.substr(at_) << "'", "");
            if (!take(']')) {
                do out.push_back(static_cast<int>(integer())); while (take(','));
                LOOM_CHECK(take(']'), flag_ << " '" << text_ << "': a ']' is missing", "");
            }
        }
        while (take('*')) {
            const int64_t times = integer();
            LOOM_CHECK(times <= 100000, flag_ << " '" << text_ << "': a repeat of " << times, "");
            std::vector<int> repeated;
            for (int64_t i = 0; i < times; ++i) repeated.insert(repeated.end(), out.begin(), out.end());
            out = std::move(repeated);
        }
        return out;
    }
    std::vector<int> sum() {
        std::vector<int> out = atom();
        while (take('+')) {
            std::vector<int> more = atom();
            out.insert(out.end(), more.begin(), more.end());
        }
        return out;
    }

    const std::string & text_;
    const char *        flag_;
    size_t              at_ = 0;
};

}  // namespace

std::vector<int> parse_layer_pattern(const std::string & text, const char * flag) {
    return LayerPatternParser(text, flag).parse();
}

LayerFrequency parse_layer_frequency(const std::string & text, const char * flag, const char * pattern, int64_t num_layers) {
    LayerFrequency f;
    if (text.find('[') != std::string::npos) {
        f.layers = parse_layer_pattern(text, flag);
        LOOM_CHECK(static_cast<int64_t>(f.layers.size()) == num_layers,
                   "Invalid length of " << pattern << ": " << f.layers.size() << ", expected " << num_layers << " (" << flag
                                        << " '" << text << "')", "give one entry per layer");
        for (int v : f.layers) LOOM_CHECK(v == 0 || v == 1, flag << " '" << text << "': entries are 0 or 1", "");
        return f;
    }
    char * end = nullptr;
    errno      = 0;
    const long long n = std::strtoll(text.c_str(), &end, 10);
    LOOM_CHECK(end != text.c_str() && *end == '\0' && errno == 0 && n >= 1,
               flag << " '" << text << "' is neither an integer >= 1 nor a list expression", "");
    f.every = n;
    return f;
}

}  // namespace loom::train
