#pragma once
// The job's wait-for graph, built from what every actor says it waits for (wait_report),
// and its root: a message sent and never received, an actor that does not answer or
// waits for nothing while others wait on it, a group collective that every member has
// entered and none left, or a cycle (a deadlock).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "messages/wait_messages.hpp"

namespace troupe {

/// The part of an actor's wait report (rep.actor set) that its step decides: at step `at`
/// (-1: none yet), behind the step `asked` about, it waits for that step's begin from the
/// coordinator; ahead of it, for nothing. Returns false when `at` is `asked`.
bool report_other_step(wait_report& rep, std::int64_t at, std::int64_t asked);

struct wait_diagnosis {
  /// One per actor that waits or is waited on ("X (node n) waits for ...", naming at most
  /// 8 of whom it waits on and how many more).
  std::vector<std::string> all_lines;
  /// What to log: all_lines where they are at most brief_lines; else the lines of the
  /// actors on the chains from the coordinator to the root (up to 3 chains), up to 8 more
  /// silent actors, and one line that counts the rest.
  std::vector<std::string> lines;
  std::string root;  ///< the root, in one sentence
};
inline constexpr std::size_t brief_lines = 24;

/// `reports`: the coordinator's own first, then every actor that answered (or that its
/// node reported inside a group collective: `collective` set, `from` its group's other
/// members, of which those in the same call are dropped); `silent`: the actors that did
/// not answer within `answer_seconds` (name and node; `state`: what its node says its
/// thread computes, if anything).
/// `settled`: nothing has moved for a while (a hang), so a message sent and not received
/// is lost; otherwise (a status request of a running job) it may be in flight.
wait_diagnosis diagnose_waits(const std::vector<wait_report>& reports, const std::vector<wait_report>& silent,
                              double answer_seconds, bool settled = true);

}  // namespace troupe
