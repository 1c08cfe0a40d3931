#pragma once
// Hang diagnosis: the coordinator asks every actor what it waits for (wait_atom, step)
// and builds the job's wait-for graph from the answers (actors/wait_graph.hpp).
#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>

namespace troupe {

/// The key that names one message in the wait-for graph: the receiver's "waits for" and
/// the sender's "sent" use the same text, so a message sent and never received shows.
inline std::string message_key(const std::string& what, const std::string& from, const std::string& to) {
  return what + " from " + from + " to " + to;
}

/// Actor -> coordinator: what it is doing in the step asked about, what it waits for and
/// from whom (nothing: `waits_for` empty), and the keys of what it sent in the step.
struct wait_report {
  std::string actor;              ///< its name, as the graph names it
  std::int32_t node = 0;          ///< the node process it runs in
  std::string state;              ///< e.g. "ran 3 of 8 ops (last F2)"
  std::string waits_for;          ///< e.g. "activation mb 3 chunk 0"; empty: nothing
  std::vector<std::string> from;  ///< whom it waits on (actor names)
  std::vector<std::string> keys;  ///< message_key of each awaited message (none: a collective)
  std::vector<std::string> sent;  ///< message_key of every message it sent in the step
  /// In a group collective: the call's name ("<group> #<n>"), the same for every member
  /// in it; members found in the same call are not waited for. Empty: none.
  std::string collective;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wait_report& x) {
  return f(caf::meta::type_name("wait_report"), x.actor, x.node, x.state, x.waits_for, x.from, x.keys, x.sent,
           x.collective);
}

}  // namespace troupe
