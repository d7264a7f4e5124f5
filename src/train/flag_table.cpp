#include "train/flag_table.h"

#include "core/error.h"

#include "train/megatron_flags.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <sstream>

namespace loom::train {

namespace {

bool python_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view strip(std::string_view s) {
    while (!s.empty() && python_space(s.front())) s.remove_prefix(1);
    while (!s.empty() && python_space(s.back())) s.remove_suffix(1);
    return s;
}

// Decimal digits with single underscores between them (PEP 515), returned without the underscores.
std::optional<std::string> digits(std::string_view s) {
    if (s.empty() || s.front() == '_' || s.back() == '_') return std::nullopt;
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] >= '0' && s[i] <= '9') {
            out += s[i];
        } else if (s[i] != '_' || s[i - 1] == '_') {
            return std::nullopt;
        }
    }
    return out;
}

// The sign ("-" or "") taken off the front of `s`.
std::string take_sign(std::string_view & s) {
    if (s.empty() || (s.front() != '+' && s.front() != '-')) return "";
    const bool minus = s.front() == '-';
    s.remove_prefix(1);
    return minus ? "-" : "";
}

}  // namespace

std::optional<std::string> python_int_text(std::string_view text) {
    std::string_view        s    = strip(text);
    const std::string       sign = take_sign(s);
    std::optional<std::string> d = digits(s);
    if (!d) return std::nullopt;
    const size_t first = std::min(d->find_first_not_of('0'), d->size() - 1);   // "000" is 0
    return sign + d->substr(first);
}

std::optional<std::string> python_float_text(std::string_view text) {
    std::string_view  s    = strip(text);
    const std::string sign = take_sign(s);
    std::string       lower(s);
    for (char & c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "inf" || lower == "infinity" || lower == "nan") return sign + lower;
    std::string      exponent;
    const size_t     e = s.find_first_of("eE");
    if (e != std::string_view::npos) {
        std::string_view exp = s.substr(e + 1);
        const std::string exp_sign = take_sign(exp);
        std::optional<std::string> d = digits(exp);
        if (!d) return std::nullopt;
        exponent = "e" + exp_sign + *d;
        s        = s.substr(0, e);
    }
    const size_t     dot = s.find('.');
    std::string_view whole = s.substr(0, dot), fraction = dot == std::string_view::npos ? "" : s.substr(dot + 1);
    if (whole.empty() && fraction.empty()) return std::nullopt;   // "", ".", "e5"
    std::optional<std::string> w = whole.empty() ? std::string() : digits(whole);
    std::optional<std::string> f = fraction.empty() ? std::string() : digits(fraction);
    if (!w || !f) return std::nullopt;
    return sign + (w->empty() ? "0" : *w) + (f->empty() ? "" : "." + *f) + exponent;
}

CLI::Validator float32_range() {
    return CLI::Validator(
        [](std::string & value) {
            const double v = std::strtod(value.c_str(), nullptr);
            if (!std::isfinite(v)) return std::string();   // inf and nan: the flag's own check decides
            const double a = std::fabs(v);
            if (a > std::numeric_limits<float>::max() || (a != 0 && a < std::numeric_limits<float>::denorm_min())) {
                return "value " + value + " is outside what a 32-bit float holds (Loom keeps this value as one)";
            }
            return std::string();
        },
        "", "float32");
}

void read_numbers_as_argparse(CLI::App & app) {
    CLI::Validator as_int(
        [](std::string & value) {
            const std::optional<std::string> text = python_int_text(value);
            if (!text) return "invalid int value: '" + value + "'";
            errno = 0;
            std::strtoll(text->c_str(), nullptr, 10);
            if (errno == ERANGE) return std::string("value out of the range of a 64-bit integer");
            value = *text;
            return std::string();
        },
        "", "python_int");
    CLI::Validator as_float(
        [](std::string & value) {
            const std::optional<std::string> text = python_float_text(value);
            if (!text) return "invalid float value: '" + value + "'";
            value = *text;
            return std::string();
        },
        "", "python_float");
    for (CLI::Option * option : app.get_options()) {
        const std::string type = option->get_type_name();
        if (type == "INT" || type == "UINT") option->transform(as_int);
        if (type == "FLOAT") option->transform(as_float);
    }
}

namespace {

// The order arguments.py adds its groups (parse_args: _add_network_size_args, _add_regularization_args,
// ...), then Loom's own flags and the ones accepted without effect.
// (_add_network_size_args builds the TransformerConfig group, "transformer configuration", first.)
constexpr const char * kGroupOrder[] = {"transformer configuration", "network size", "regularization",  "training",
                                        "initialization", "learning rate", "checkpointing",  "mixed precision",
                                        "distributed", "validation",    "data and dataloader", "tokenizer", "logging",
                                        "inference", kLoomGroup, "accepted without effect"};

// Megatron's groups in their order, then any other group of `app` (CLI11's "Options", holding --help).
std::vector<std::string> groups_in_order(const CLI::App & app) {
    std::vector<std::string> groups(std::begin(kGroupOrder), std::end(kGroupOrder));
    for (const std::string & g : app.get_groups()) {
        if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    }
    return groups;
}

class MegatronHelpFormatter : public CLI::Formatter {
public:
    std::string make_help(const CLI::App * app, std::string name, CLI::AppFormatMode mode) const override {
        if (mode == CLI::AppFormatMode::Sub) return CLI::Formatter::make_help(app, name, mode);
        std::string out = make_description(app) + make_usage(app, name);
        for (const std::string & group : groups_in_order(*app)) {
            std::vector<const CLI::Option *> opts =
                app->get_options([&](const CLI::Option * o) { return o->get_group() == group && o->nonpositional(); });
            if (!opts.empty()) out += make_group(group, false, opts) + "\n";
        }
        return out + make_footer(app);
    }
};

// A table cell: '|' would end it.
std::string cell(const std::string & text) {
    std::string out;
    for (char c : text) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
}

}  // namespace

void group_like_megatron(CLI::App & app) { app.formatter(std::make_shared<MegatronHelpFormatter>()); }

std::string render_flags_markdown(const CLI::App & app) {
    std::ostringstream md;
    md << "## Flag reference\n\n"
          "Every flag `loom train` reads, in the help groups of Megatron's `arguments.py` and in the order `loom "
          "train --help`\nprints them. The default is the value taken when the flag is not given; where none is "
          "shown, the value\ncomes from the `--model` preset, from another flag, or is none (as Megatron's None).\n";
    for (const std::string & group : groups_in_order(app)) {
        if (group == "accepted without effect") continue;   // the next section, with the values accepted
        std::vector<const CLI::Option *> opts = app.get_options(
            [&](const CLI::Option * o) { return o->get_group() == group && o->nonpositional() && o->get_name() != "--help"; });
        if (opts.empty()) continue;
        md << "\n### " << group << "\n\n| flag | default | meaning |\n|---|---|---|\n";
        for (const CLI::Option * o : opts) {
            const std::string def = o->get_default_str();
            md << "| `" << o->get_name() << "` | " << (def.empty() ? "" : "`" + cell(def) + "`") << " | "
               << cell(o->get_description()) << " |\n";
        }
    }
    md << "\n## Accepted without effect\n\n"
          "These flags only choose an implementation on Megatron's side; Loom's behaviour is the one they ask for, so\n"
          "they are accepted and change nothing. A value outside the list is refused by name, because it would ask for\n"
          "different behaviour.\n\n"
          "| flag | values accepted | why it changes nothing in Loom |\n|---|---|---|\n";
    for (const NoOpFlag & f : noop_flags()) {
        std::string values = "(switch)";
        if (f.values != nullptr && f.values[0] == '\0') values = "any";
        if (f.values != nullptr && f.values[0] != '\0') {
            values.clear();
            std::stringstream list(f.values);
            for (std::string v; std::getline(list, v, '|');) values += (values.empty() ? "`" : ", `") + v + "`";
        }
        md << "| `" << f.name << "` | " << values << " | " << cell(f.reason) << " |\n";
    }
    md << "\n## Refused with a hint\n\n"
          "Any other flag is refused as \"not supported by Loom\"; for these the message says what to use instead.\n\n"
          "| flag | instead |\n|---|---|\n";
    for (const auto & [flag, hint] : refusal_hints()) md << "| `" << flag << "` | " << cell(hint) << " |\n";
    return md.str();
}

std::string splice_generated(const std::string & doc, const std::string & generated) {
    const size_t at   = doc.find(kGeneratedMarker);
    std::string  head = at == std::string::npos ? doc + "\n" : doc.substr(0, at);
    return head + kGeneratedMarker + "\n\n" + generated;
}

void check_choice(const char * flag, const std::string & value, std::span<const char * const> choices) {
    std::string listed;
    bool        known = false;
    for (const char * c : choices) {
        listed += (listed.empty() ? "'" : ", '") + std::string(c) + "'";
        known = known || value == c;
    }
    LOOM_CHECK(known, "argument " << flag << ": invalid choice: '" << value << "' (choose from " << listed << ")", "");
}

}  // namespace loom::train
