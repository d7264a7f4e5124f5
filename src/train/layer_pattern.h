// The layer-frequency flags' values (Megatron's moe_freq_type and la_freq_type: --moe-layer-freq,
// --window-attn-skip-freq, --linear-attention-freq): an integer, or a Python list expression of sums of lists and
// parenthesised sums, each repeated with "* N" ("([1]*3+[0]*1)*2" -> 1 1 1 0 1 1 1 0), the subset of Python
// Megatron's examples use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::train {

// The list `text` evaluates to; throws loom::Error naming `flag` and where the text went wrong.
std::vector<int> parse_layer_pattern(const std::string & text, const char * flag);

// A frequency: `every` N >= 1, or (text with a '[') `layers`, one 0 or 1 per layer of the model's num_layers.
// Megatron's message names the pattern (`pattern`, as "moe_layer_pattern") when the list's length is wrong.
struct LayerFrequency {
    int64_t          every = 0;
    std::vector<int> layers;
};
LayerFrequency parse_layer_frequency(const std::string & text, const char * flag, const char * pattern, int64_t num_layers);

}  // namespace loom::train
