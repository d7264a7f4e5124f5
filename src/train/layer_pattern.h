// --moe-layer-freq's Python list expression: sums of lists and parenthesised sums, each repeated with
// "* N" ("([1]*3+[0]*1)*2" -> 1 1 1 0 1 1 1 0), the subset of Python Megatron's examples use.
#pragma once

#include <string>
#include <vector>

namespace loom::train {

// The list `text` evaluates to; throws loom::Error naming --moe-layer-freq and where the text went wrong.
std::vector<int> parse_layer_pattern(const std::string & text);

}  // namespace loom::train
