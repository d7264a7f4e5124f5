#include "parallel/rank_generator.h"

#include "core/error.h"

#include <algorithm>

namespace loom::parallel {

namespace {

std::vector<std::string> split_order(std::string_view text) {
    std::vector<std::string> tokens;
    if (text.empty()) {
        return tokens;
    }
    size_t start = 0;
    for (;;) {
        size_t dash = text.find('-', start);
        tokens.emplace_back(text.substr(start, dash == std::string_view::npos ? text.npos : dash - start));
        if (dash == std::string_view::npos) {
            break;
        }
        start = dash + 1;
    }
    return tokens;
}

std::vector<int> prefix_product(const std::vector<int> & sizes) {
    std::vector<int> strides(sizes.size() + 1, 1);
    for (size_t i = 0; i < sizes.size(); ++i) {
        strides[i + 1] = strides[i] * sizes[i];
    }
    return strides;
}

}  // namespace

RankGroups masked_orthogonal_rank_groups(int world_size, const std::vector<int> & sizes,
                                         const std::vector<bool> & mask) {
    std::vector<int> global_stride = prefix_product(sizes);
    std::vector<int> masked_sizes, masked_strides, unmasked_sizes, unmasked_strides;
    for (size_t i = 0; i < sizes.size(); ++i) {
        (mask[i] ? masked_sizes : unmasked_sizes).push_back(sizes[i]);
        (mask[i] ? masked_strides : unmasked_strides).push_back(global_stride[i]);
    }
    int group_size = prefix_product(masked_sizes).back();
    int num_groups = world_size / group_size;

    // rank = sum over axes of coordinate * global stride; coordinates of an index decompose it with
    // leftmost fastest.
    auto offset = [](int index, const std::vector<int> & axis_sizes, const std::vector<int> & axis_strides) {
        int result = 0;
        for (size_t a = 0; a < axis_sizes.size(); ++a) {
            result += (index % axis_sizes[a]) * axis_strides[a];
            index /= axis_sizes[a];
        }
        return result;
    };

    RankGroups groups(num_groups, std::vector<int>(group_size));
    for (int g = 0; g < num_groups; ++g) {
        int base = offset(g, unmasked_sizes, unmasked_strides);
        for (int r = 0; r < group_size; ++r) {
            groups[g][r] = base + offset(r, masked_sizes, masked_strides);
        }
    }
    return groups;
}

RankGenerator::RankGenerator(int tp, int ep, int dp, int pp, int cp, std::string_view order) {
    struct Axis { const char * name; int size; };
    // The reference appends missing size-1 axes in this order.
    const Axis all[] = {{"tp", tp}, {"pp", pp}, {"dp", dp}, {"ep", ep}, {"cp", cp}};

    std::vector<std::string> tokens = split_order(order);
    for (const std::string & token : tokens) {
        bool known = std::any_of(std::begin(all), std::end(all), [&](const Axis & a) { return token == a.name; });
        LOOM_CHECK(known, "--order '" << order << "' names an unknown axis '" << token << "'",
                   "the order lists axes from tp, cp, ep, dp, pp separated by '-', e.g. tp-cp-ep-dp-pp");
        LOOM_CHECK(std::count(tokens.begin(), tokens.end(), token) == 1,
                   "--order '" << order << "' names axis '" << token << "' twice", "name every axis once");
    }
    for (const Axis & axis : all) {
        bool named = std::find(tokens.begin(), tokens.end(), axis.name) != tokens.end();
        LOOM_CHECK(named || axis.size == 1,
                   "the " << axis.name << " size is " << axis.size << " but --order '" << order
                          << "' does not name " << axis.name,
                   "add " << axis.name << " to the order, e.g. the default tp-cp-ep-dp-pp");
        if (!named) {
            tokens.emplace_back(axis.name);
        }
    }
    world_size_ = 1;
    for (const std::string & token : tokens) {
        for (const Axis & axis : all) {
            if (token == axis.name) {
                axes_.push_back(token);
                sizes_.push_back(axis.size);
                world_size_ *= axis.size;
            }
        }
        order_ += (order_.empty() ? "" : "-") + token;
    }
}

std::vector<bool> RankGenerator::mask_of(std::string_view token) const {
    std::vector<bool> mask(axes_.size(), false);
    for (const std::string & name : split_order(token)) {
        auto it = std::find(axes_.begin(), axes_.end(), name);
        LOOM_CHECK(it != axes_.end(), "unknown parallel axis '" << name << "' in group '" << token << "'",
                   "group tokens combine tp, cp, ep, dp, pp with '-'");
        size_t index = static_cast<size_t>(it - axes_.begin());
        LOOM_CHECK(!mask[index], "axis '" << name << "' repeated in group '" << token << "'", "");
        mask[index] = true;
    }
    return mask;
}

RankGroups RankGenerator::get_ranks(std::string_view token) const {
    return masked_orthogonal_rank_groups(world_size_, sizes_, mask_of(token));
}

int RankGenerator::size_of(std::string_view axis) const {
    for (size_t i = 0; i < axes_.size(); ++i) {
        if (axes_[i] == axis) {
            return sizes_[i];
        }
    }
    LOOM_THROW("unknown parallel axis '" << axis << "'", "axes are tp, cp, ep, dp, pp");
}

int RankGenerator::coordinate(int rank, std::string_view axis) const {
    LOOM_CHECK(rank >= 0 && rank < world_size_, "rank " << rank << " outside a world of " << world_size_, "");
    int stride = 1;
    for (size_t i = 0; i < axes_.size(); ++i) {
        if (axes_[i] == axis) {
            return (rank / stride) % sizes_[i];
        }
        stride *= sizes_[i];
    }
    LOOM_THROW("unknown parallel axis '" << axis << "'", "axes are tp, cp, ep, dp, pp");
}

}  // namespace loom::parallel
