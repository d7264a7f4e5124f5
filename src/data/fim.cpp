#include "data/fim.h"

#include "core/error.h"
#include "data/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace loom::data {

std::u32string decode_utf8_lossy(std::string_view bytes) {
    std::u32string out;
    out.reserve(bytes.size());
    size_t i = 0;
    while (i < bytes.size()) {
        const auto lead = static_cast<uint8_t>(bytes[i]);
        if (lead < 0x80) {
            out.push_back(lead);
            ++i;
            continue;
        }
        // The continuation bytes a lead byte takes, and the range its first continuation must fall in
        // (which excludes overlong forms, surrogates and code points above U+10FFFF).
        int      need = 0;
        uint32_t cp   = 0;
        uint8_t  lo = 0x80, hi = 0xBF;
        if (lead >= 0xC2 && lead <= 0xDF) {
            need = 1, cp = lead & 0x1Fu;
        } else if (lead >= 0xE0 && lead <= 0xEF) {
            need = 2, cp = lead & 0x0Fu;
            lo   = lead == 0xE0 ? 0xA0 : 0x80;
            hi   = lead == 0xED ? 0x9F : 0xBF;
        } else if (lead >= 0xF0 && lead <= 0xF4) {
            need = 3, cp = lead & 0x07u;
            lo   = lead == 0xF0 ? 0x90 : 0x80;
            hi   = lead == 0xF4 ? 0x8F : 0xBF;
        } else {   // a continuation byte, or a lead byte no well-formed sequence starts with
            out.push_back(U'\uFFFD');
            ++i;
            continue;
        }
        size_t j     = i + 1;
        bool   whole = true;
        for (int k = 0; k < need; ++k, ++j) {
            const uint8_t first = k == 0 ? lo : 0x80, last = k == 0 ? hi : 0xBF;
            if (j >= bytes.size() || static_cast<uint8_t>(bytes[j]) < first || static_cast<uint8_t>(bytes[j]) > last) {
                whole = false;
                break;
            }
            cp = cp << 6 | (static_cast<uint8_t>(bytes[j]) & 0x3Fu);
        }
        // An incomplete sequence is one maximal subpart: bytes [i, j) become one U+FFFD, and reading goes on
        // at the byte that broke it.
        out.push_back(whole ? static_cast<char32_t>(cp) : U'\uFFFD');
        i = j;
    }
    return out;
}

std::string encode_utf8(std::u32string_view text) {
    std::string out;
    out.reserve(text.size());
    for (char32_t c : text) append_utf8(out, static_cast<uint32_t>(c));
    return out;
}

namespace {

void check_probability(double p, const char * flag) {
    LOOM_CHECK(std::isfinite(p) && p >= 0 && p <= 1, flag << " must be a probability in [0, 1], got " << p, "");
}

void append(std::vector<int32_t> & to, const std::vector<int32_t> & from) { to.insert(to.end(), from.begin(), from.end()); }

}  // namespace

FimTransform::FimTransform(std::shared_ptr<Gpt2BpeTokenizer> tokenizer, FimOptions options, uint64_t seed)
    : tokenizer_(std::move(tokenizer)), options_(std::move(options)), seed_(seed) {
    LOOM_CHECK(tokenizer_ != nullptr, "--fim-data needs the GPT-2 BPE tokenizer", "give --vocab-file and --merge-file");
    LOOM_CHECK(tokenizer_->has_eod(), "--fim-data: --vocab-file '" << tokenizer_->vocab_file() << "' has no \""
                                                                   << kGpt2EndOfText << "\"",
               "FIM looks its tokens up in a GPT-2 vocabulary, whose unknown token is \"<|endoftext|>\"");
    check_probability(options_.rate, "--fim-rate");
    check_probability(options_.spm_rate, "--fim-spm-rate");
    if (!options_.split_sample.empty()) {
        LOOM_CHECK(options_.fragment_rate.has_value(), "--fim-split-sample needs --fim-fragment-rate",
                   "the rate at which each fragment between the split tokens is transformed");
    }
    if (options_.fragment_rate) check_probability(*options_.fragment_rate, "--fim-fragment-rate");
    special_          = tokenizer_->eod();
    const auto lookup = [&](const std::string & token) {
        const int32_t id = tokenizer_->token_id(token);
        return id >= 0 ? id : special_;
    };
    ids_.prefix = lookup(options_.prefix_token);
    ids_.middle = lookup(options_.middle_token);
    ids_.suffix = lookup(options_.suffix_token);
    ids_.pad    = lookup(options_.pad_token);
    ids_.eod    = lookup(options_.eod_token);
    if (!options_.split_sample.empty()) ids_.split = lookup(options_.split_sample);
}

std::string FimTransform::describe() const {
    std::ostringstream os;
    os << "FIM (rate " << options_.rate << ", SPM rate " << options_.spm_rate << ", ids prefix " << ids_.prefix
       << " middle " << ids_.middle << " suffix " << ids_.suffix << " pad " << ids_.pad << " eod " << ids_.eod;
    if (ids_.split >= 0) os << ", split at id " << ids_.split << " with fragment rate " << *options_.fragment_rate;
    if (options_.no_prefix) os << ", not after '" << *options_.no_prefix << "'";
    os << ", seed " << seed_ << ")";
    return os.str();
}

bool FimTransform::decide(Rng & rng, double p) const {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;   // uniform on [0, 1), 53 bits
    return u < p;
}

FimTransform::Ids32 FimTransform::permute(std::span<const int32_t> segment, double rate, Rng & rng) const {
    Ids32 kept(segment.begin(), segment.end());
    if (!decide(rng, rate)) return kept;
    Ids32 visible;
    for (int32_t id : segment) {
        if (id != special_) visible.push_back(id);
    }
    const std::u32string text = decode_utf8_lossy(tokenizer_->decode(visible));
    if (options_.no_prefix && encode_utf8(text).starts_with(*options_.no_prefix)) return kept;
    uint64_t i = draw_below(rng, text.size() + 1), j = draw_below(rng, text.size() + 1);
    if (i > j) std::swap(i, j);
    const std::u32string_view view(text);
    const Ids32 prefix = tokenizer_->encode(encode_utf8(view.substr(0, i)));
    const Ids32 middle = tokenizer_->encode(encode_utf8(view.substr(i, j - i)));
    const Ids32 suffix = tokenizer_->encode(encode_utf8(view.substr(j)));
    Ids32       out;
    out.reserve(prefix.size() + middle.size() + suffix.size() + 3);
    if (decide(rng, options_.spm_rate)) {   // SPM
        out = {ids_.prefix, ids_.suffix};
        append(out, suffix);
        out.push_back(ids_.middle);
        append(out, prefix);
        append(out, middle);
    } else {   // PSM
        out = {ids_.prefix};
        append(out, prefix);
        out.push_back(ids_.suffix);
        append(out, suffix);
        out.push_back(ids_.middle);
        append(out, middle);
    }
    return out;
}

FimTransform::Ids32 FimTransform::split_and_permute(std::span<const int32_t> segment, Rng & rng) const {
    if (ids_.split < 0 || std::find(segment.begin(), segment.end(), ids_.split) == segment.end()) {
        return permute(segment, options_.rate, rng);
    }
    if (!decide(rng, options_.rate)) return Ids32(segment.begin(), segment.end());
    Ids32  out;
    size_t start = 0;
    for (size_t at = 0; at < segment.size(); ++at) {
        if (segment[at] != ids_.split) continue;
        if (at > start) {
            append(out, permute(segment.subspan(start, at - start), *options_.fragment_rate, rng));
            out.push_back(ids_.split);
        }
        start = at + 1;
    }
    append(out, permute(segment.subspan(start), *options_.fragment_rate, rng));
    return out;
}

void FimTransform::apply(int64_t index, std::span<int32_t> sample) const {
    const auto    seed = static_cast<uint64_t>(index);
    std::seed_seq key{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32), static_cast<uint32_t>(seed),
                      static_cast<uint32_t>(seed >> 32)};
    Rng           rng(key);
    const std::lock_guard<std::mutex> lock(mutex_);
    Ids32                             out;
    const std::span<const int32_t>    in(sample.data(), sample.size());
    if (std::find(in.begin(), in.end(), ids_.eod) == in.end()) {
        out = split_and_permute(in, rng);
    } else {
        size_t start = 0;
        for (size_t at = 0; at < in.size(); ++at) {
            if (in[at] != ids_.eod) continue;
            if (at > start) {   // an empty segment is dropped with its end-of-document id, as Megatron does
                append(out, split_and_permute(in.subspan(start, at - start), rng));
                out.push_back(ids_.eod);
            }
            start = at + 1;
        }
        append(out, split_and_permute(in.subspan(start), rng));
    }
    out.resize(sample.size(), ids_.pad);   // cut to the sample's length, or padded
    std::copy(out.begin(), out.end(), sample.begin());
}

}  // namespace loom::data
