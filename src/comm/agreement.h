// Agreement before the first collective: every rank of a job must have been launched alike (the same
// resolved flags, the same build, the same data). A wrapper that adds a flag on one rank only, a stale
// environment or a per-node file that differs would otherwise train ranks that compute different things,
// or reach a collective with mismatched shapes (an MPI error far from the cause, or a hang until the
// watchdog fires).
//
//   check_agreement(*mpi.world(), cpu::device(), settings, "the ranks were launched with different options");
//
// The exchange cannot itself mismatch: first an all-gather of two integers per rank (a 64-bit digest of
// the settings and their encoded length); only when the digests differ, an all-gather of every rank's
// settings padded to the longest, from which every rank builds the same report and throws the same
// loom::Error (exit status 2), naming each setting that differs, its values and the ranks holding each:
//
//   the ranks were launched with different options:
//     --lr: 0.0001 on ranks 0-2; 0.0002 on rank 3
//     --bf16: false on ranks 0, 2-3; true on rank 1
#pragma once

#include "comm/communicator.h"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::comm {

// One named value that must be the same on every rank: a flag and its resolved value, the build, a
// dataset's identity.
struct Setting {
    std::string name;
    std::string value;
};

// Returns when every rank of `world` holds the same `settings`; otherwise throws loom::Error on every rank
// with the report above, headed by `what`. Collective over `world` (blocking), its messages staged in
// `device`'s memory as the communicator needs them.
void check_agreement(Communicator & world, Device & device, std::span<const Setting> settings, std::string_view what);

// The report's lines for the settings of each rank (per_rank[r]: rank r's), one per name whose values
// differ, in the order names first appear (rank 0's first); a name a rank lacks reads "(absent)", or, with
// `absent_differs` false, leaves that rank out of the comparison. Empty when every rank agrees.
std::vector<std::string> disagreements(const std::vector<std::vector<Setting>> & per_rank, bool absent_differs = true);

// The running check, at every log interval: each group's count and digest of issued collectives
// (Communicator::issued), gathered over `world` (one all-gather of a fixed-size table: `groups` lists the
// same kinds on every rank, null where this rank holds none). Where the members of a group differ, a
// second exchange gathers the last 16 collectives of each member (and the digest of those before), and
// every rank throws the same RunError (exit status 1) naming the group, its first divergent collective
// with each member's version of it, the counts where they differ, and the ranks holding each:
//
//   the ranks' collective operations diverged (a schedule that differs between ranks):
//     group 'dp' of ranks 0-1, collective #12: all_reduce of 1 float32 (sum) on rank 0; all_reduce of
//     1 float32 (max) on rank 1
void check_issued(Communicator & world, Device & device, std::span<Communicator * const> groups);

// The same for point-to-point channels (the pipeline's): each direction's sender and receiver must have
// issued the same transfers (Communicator::transfers: the count and a digest of each one's element count,
// dtype and tag, in order). A transfer one end issued and the other has not matched shows at the next log
// line instead of corrupting a later receive or hanging until the watchdog; every rank throws the same
// RunError naming the channel, its two ranks and what each issued:
//
//   the pipeline's point-to-point transfers diverged (a schedule that differs between ranks):
//     channel 'pp-activations-0-1', rank 0 to rank 1: sent 14 transfer(s), digest ..., #14: transfer of 1024
//     float32 (tag 14) on rank 0; received 13 transfer(s), digest ..., #13: ... on rank 1
// Collective over `world`: one exchange of every rank's records.
void check_transfers(Communicator & world, Device & device, std::span<Communicator * const> channels);

// Every rank's `mine` (any lengths), in rank order: two all-gathers over `world` (the lengths, then the bytes
// padded to the longest).
std::vector<std::string> all_gather_strings(Communicator & world, Device & device, const std::string & mine);

// FNV-1a, 64 bits, of `bytes`: the same on every host and build (std::hash is not), so ranks may compare
// digests (accidental equality of different bytes: about 2^-64).
uint64_t digest(std::string_view bytes);

// "rank 3", "ranks 0-2, 5": the ranks of a sorted list, runs collapsed.
std::string rank_list(std::span<const int> ranks);

// The settings as bytes (name, NUL, value, NUL each) and back; decode throws on bytes encode did not make.
std::string          encode_settings(std::span<const Setting> settings);
std::vector<Setting> decode_settings(std::string_view bytes);

}  // namespace loom::comm
