#include "comm/agreement.h"

#include "core/error.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

namespace loom::comm {

uint64_t digest(std::string_view bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

namespace {

// Every rank's `mine` (each the same size), gathered in rank order: host bytes staged through `device`.
std::string gather(Communicator & world, Device & device, std::string mine) {
    const int64_t size = static_cast<int64_t>(mine.size());
    const MemoryKind host_kind = device.type() == DeviceType::cpu ? MemoryKind::device : MemoryKind::pageable_host;
    std::string all(mine.size() * static_cast<size_t>(world.size()), '\0');
    Tensor      in  = Tensor::from_blob(mine.data(), {size}, DType::u8, device, host_kind);
    Tensor      out = Tensor::from_blob(all.data(), {size * world.size()}, DType::u8, device, host_kind);
    if (device.type() == DeviceType::cpu) {
        world.all_gather(in, out)->wait();
        return all;
    }
    Tensor in_device  = Tensor::empty(in.shape(), DType::u8, device);
    Tensor out_device = Tensor::empty(out.shape(), DType::u8, device);
    copy_now(in_device, in);
    world.all_gather(in_device, out_device)->wait();
    copy_now(out, out_device);
    return all;
}

void put_u64(std::string & bytes, size_t at, uint64_t v) { std::memcpy(bytes.data() + at, &v, sizeof v); }
uint64_t get_u64(const std::string & bytes, size_t at) {
    uint64_t v = 0;
    std::memcpy(&v, bytes.data() + at, sizeof v);
    return v;
}

}  // namespace

std::string encode_settings(std::span<const Setting> settings) {
    std::string bytes;
    for (const Setting & s : settings) {
        bytes.append(s.name).push_back('\0');
        bytes.append(s.value).push_back('\0');
    }
    return bytes;
}

std::vector<Setting> decode_settings(std::string_view bytes) {
    std::vector<Setting> settings;
    size_t               at = 0;
    auto next = [&]() {
        const size_t end = bytes.find('\0', at);
        LOOM_CHECK(end != std::string_view::npos, "an agreement message ends inside a setting (" << bytes.size() << " bytes)",
                   "the ranks run different builds of loom?");
        std::string part(bytes.substr(at, end - at));
        at = end + 1;
        return part;
    };
    while (at < bytes.size()) {
        std::string name  = next();
        std::string value = next();
        settings.push_back({std::move(name), std::move(value)});
    }
    return settings;
}

std::vector<std::string> all_gather_strings(Communicator & world, Device & device, const std::string & mine) {
    std::string head(sizeof(uint64_t), '\0');
    put_u64(head, 0, mine.size());
    const std::string heads = gather(world, device, head);
    std::vector<size_t> sizes(static_cast<size_t>(world.size()));
    size_t              longest = 0;
    for (size_t r = 0; r < sizes.size(); ++r) longest = std::max(longest, sizes[r] = get_u64(heads, r * sizeof(uint64_t)));
    std::string padded = mine;
    padded.resize(longest, '\0');
    const std::string        all = longest > 0 ? gather(world, device, padded) : std::string();
    std::vector<std::string> out;
    for (size_t r = 0; r < sizes.size(); ++r) out.push_back(all.substr(r * longest, sizes[r]));
    return out;
}

std::string rank_list(std::span<const int> ranks) {
    std::string out = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size();) {
        size_t j = i;
        while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
        if (i > 0) out += ", ";
        out += std::to_string(ranks[i]);
        if (j > i) out += "-" + std::to_string(ranks[j]);
        i = j + 1;
    }
    return out;
}

std::vector<std::string> disagreements(const std::vector<std::vector<Setting>> & per_rank, bool absent_differs) {
    // Names in the order they first appear, each with its value on every rank.
    std::vector<std::string>                             names;
    std::map<std::string, std::vector<const std::string *>> values;
    for (size_t r = 0; r < per_rank.size(); ++r) {
        for (const Setting & s : per_rank[r]) {
            auto [it, added] = values.try_emplace(s.name, per_rank.size(), nullptr);
            if (added) names.push_back(s.name);
            it->second[r] = &s.value;
        }
    }
    static const std::string absent = "(absent)";
    std::vector<std::string> lines;
    for (const std::string & name : names) {
        const std::vector<const std::string *> & held = values[name];
        // Each distinct value with the ranks holding it, in the order of their first rank.
        std::vector<std::pair<const std::string *, std::vector<int>>> groups;
        for (size_t r = 0; r < held.size(); ++r) {
            if (!held[r] && !absent_differs) continue;
            const std::string * v = held[r] ? held[r] : &absent;
            auto g = std::find_if(groups.begin(), groups.end(), [&](const auto & p) { return *p.first == *v; });
            if (g == groups.end()) {
                groups.push_back({v, {}});
                g = groups.end() - 1;
            }
            g->second.push_back(static_cast<int>(r));
        }
        if (groups.size() == 1) continue;
        std::string line = name + ":";
        for (size_t g = 0; g < groups.size(); ++g) {
            line += (g == 0 ? " " : "; ") + (groups[g].first->empty() ? std::string("''") : *groups[g].first) +
                    " on " + rank_list(groups[g].second);
        }
        lines.push_back(std::move(line));
    }
    return lines;
}

namespace {

// Every rank's settings when some rank's differ from another's (the exchange of check_agreement); empty
// when the digests agree.
// (`always`: every rank's settings in any case.)
std::vector<std::vector<Setting>> settings_if_different(Communicator & world, Device & device,
                                                        std::span<const Setting> settings, bool always = false) {
    const std::string mine = encode_settings(settings);
    std::string       head(2 * sizeof(uint64_t), '\0');
    put_u64(head, 0, digest(mine));
    put_u64(head, sizeof(uint64_t), mine.size());
    const std::string heads = gather(world, device, head);
    bool              same  = true;
    size_t            most  = 0;
    for (int r = 0; r < world.size(); ++r) {
        const size_t at = static_cast<size_t>(r) * head.size();
        same            = same && get_u64(heads, at) == get_u64(heads, 0);
        most            = std::max<size_t>(most, get_u64(heads, at + sizeof(uint64_t)));
    }
    if (same && !always) return {};
    // Every rank's settings, each padded to the longest (every rank computed the same `most`).
    std::string padded = mine;
    padded.resize(most, '\0');
    const std::string                 all = gather(world, device, padded);
    std::vector<std::vector<Setting>> per_rank;
    for (int r = 0; r < world.size(); ++r) {
        const size_t length = get_u64(heads, static_cast<size_t>(r) * head.size() + sizeof(uint64_t));
        per_rank.push_back(decode_settings(std::string_view(all).substr(static_cast<size_t>(r) * most, length)));
    }
    return per_rank;
}

}  // namespace

void check_agreement(Communicator & world, Device & device, std::span<const Setting> settings, std::string_view what) {
    const std::vector<std::vector<Setting>> per_rank = settings_if_different(world, device, settings);
    if (per_rank.empty()) return;
    std::string report(what);
    report += ":";
    const std::vector<std::string> lines = disagreements(per_rank);
    for (const std::string & line : lines) report += "\n    " + line;
    if (lines.empty()) report += " the same settings in another order (different builds of loom?)";
    LOOM_THROW(report, "launch every rank with the same flags, build and files: a wrapper script or environment "
                       "that differs on some ranks or nodes?");
}

void check_issued(Communicator & world, Device & device, std::span<Communicator * const> groups) {
    // Per group kind: whether this rank holds one, its first member (which instance), count and digest, from
    // one snapshot taken before any exchange (`world` may be one of the groups: the exchanges add to it).
    constexpr size_t       kFields = 4;
    std::string            table(groups.size() * kFields * sizeof(uint64_t), '\0');
    std::vector<IssuedOps> snapshot(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) {
        if (groups[g] == nullptr) continue;
        const IssuedOps & issued = snapshot[g] = groups[g]->issued();
        const size_t      at     = g * kFields * sizeof(uint64_t);
        put_u64(table, at, 1);
        put_u64(table, at + 8, static_cast<uint64_t>(groups[g]->global_ranks().front()));
        put_u64(table, at + 16, issued.count);
        put_u64(table, at + 24, issued.digest);
    }
    const std::string all = gather(world, device, table);
    // The kinds where two members of one instance differ (every rank finds the same ones).
    std::vector<bool> differs(groups.size(), false);
    bool              any = false;
    for (size_t g = 0; g < groups.size(); ++g) {
        std::map<uint64_t, std::pair<uint64_t, uint64_t>> first_seen;   // instance -> (count, digest)
        for (int r = 0; r < world.size(); ++r) {
            const size_t at = static_cast<size_t>(r) * table.size() + g * kFields * sizeof(uint64_t);
            if (get_u64(all, at) == 0) continue;
            const std::pair<uint64_t, uint64_t> seen{get_u64(all, at + 16), get_u64(all, at + 24)};
            auto [it, added] = first_seen.try_emplace(get_u64(all, at + 8), seen);
            if (!added && it->second != seen) differs[g] = any = true;
        }
    }
    if (!any) return;
    // What each member has issued on those groups, compared within each instance only: the digest of what
    // came before the collectives it keeps, each kept collective by number, and the count. The first line
    // of a group that differs is its first divergent collective (or "before #k": older than those kept).
    std::vector<Setting> mine;
    for (size_t g = 0; g < groups.size(); ++g) {
        if (!differs[g] || groups[g] == nullptr) continue;
        const IssuedOps & issued = snapshot[g];
        std::vector<int> members = groups[g]->global_ranks();
        std::sort(members.begin(), members.end());
        const std::string prefix = "group '" + groups[g]->name() + "' of " + rank_list(members);
        const uint64_t    kept   = std::min<uint64_t>(issued.count, issued.last.size());
        const uint64_t    first  = issued.count - kept;   // 0-based number of the oldest kept
        const uint64_t    before = kept > 0 ? issued.last[first % issued.last.size()].digest_before : issued.digest;
        char              hex[20];
        std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(before));
        mine.push_back({prefix + ", collectives before #" + std::to_string(first + 1), std::string("digest ") + hex});
        for (uint64_t k = first; k < issued.count; ++k) {
            mine.push_back({prefix + ", collective #" + std::to_string(k + 1), describe(issued.last[k % issued.last.size()])});
        }
        mine.push_back({prefix + ", collectives issued", std::to_string(issued.count)});
    }
    std::vector<std::vector<Setting>> per_rank = settings_if_different(world, device, mine);
    std::string report = "the ranks' collective operations diverged (a schedule that differs between ranks):";
    std::vector<std::string> lines = disagreements(per_rank, false);
    // Per group, its first divergent line and its counts.
    std::map<std::string, int> shown;
    for (const std::string & line : lines) {
        const std::string group = line.substr(0, line.find(", collective"));
        const bool        count = line.find(", collectives issued:") != std::string::npos;
        if (shown[group]++ > 0 && !count) continue;
        report += "\n    " + line;
    }
    if (lines.empty()) report += " their digests differ, and no kept collective does";
    throw RunError(report,
                   "every member of a group must issue the same collectives in the same order with the same sizes; "
                   "this is a bug in the schedule of the ranks named (please report it with the command line)",
                   __FILE__, __LINE__);
}

void check_transfers(Communicator & world, Device & device, std::span<Communicator * const> channels) {
    // Each direction of each channel as both its ends name it, with what this end issued.
    std::vector<Setting> mine;
    for (Communicator * channel : channels) {
        if (channel == nullptr) continue;
        const std::vector<int> members = channel->global_ranks();
        const int              me      = members[static_cast<size_t>(channel->rank())];
        for (const Transfers & t : channel->transfers()) {
            const int peer = members[static_cast<size_t>(t.peer)];
            const int from = t.sent ? me : peer, to = t.sent ? peer : me;
            char      hex[20];
            std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(t.ops.digest));
            std::string what = std::to_string(t.ops.count) + " transfer(s), digest " + hex;
            if (t.ops.count > 0) {
                what += ", #" + std::to_string(t.ops.count) + ": " + describe(t.ops.last[(t.ops.count - 1) % t.ops.last.size()]);
            }
            mine.push_back({"channel '" + channel->name() + "', rank " + std::to_string(from) + " to rank " +
                                std::to_string(to),
                            (t.sent ? "sent " : "received ") + what});
        }
    }
    // A direction agrees when its two ends' values are the same but for the verb.
    auto same_but_verb = [](std::vector<Setting> settings) {
        for (Setting & s : settings) s.value = s.value.substr(s.value.find(' ') + 1);
        return settings;
    };
    std::vector<std::vector<Setting>> per_rank = settings_if_different(world, device, mine, /*always=*/true);
    std::vector<std::vector<Setting>> compared;
    for (const std::vector<Setting> & r : per_rank) compared.push_back(same_but_verb(r));
    std::set<std::string> differing;   // the directions whose two ends differ
    for (const std::string & line : disagreements(compared, false)) differing.insert(line.substr(0, line.find(':')));
    if (differing.empty()) return;
    std::string report = "the pipeline's point-to-point transfers diverged (a schedule that differs between ranks):";
    for (const std::string & line : disagreements(per_rank, false)) {   // the verbs always differ: shown where more does
        if (differing.count(line.substr(0, line.find(':')))) report += "\n    " + line;
    }
    throw RunError(report,
                   "a transfer one end issued and the other did not: this is a bug in the pipeline schedule of the "
                   "ranks named (please report it with the command line)",
                   __FILE__, __LINE__);
}

}  // namespace loom::comm
