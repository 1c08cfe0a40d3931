#pragma once
// What the threads that compute stage ops are doing right now, readable from any thread
// of the process. A stage actor computes its ops on its own thread, so while an op runs
// (a long kernel, or a group collective waiting for a peer) the actor cannot answer the
// hang diagnosis: its node's supervisor answers for it from this board (which op, for
// how long, and which collective of which group, the how-manyth of that group).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "messages/wait_messages.hpp"

namespace troupe {

/// A group of stage actors that meet in collectives, as the diagnosis names it.
struct group_identity {
  std::string label;                 ///< e.g. "tensor-parallel group of replica 0, stage 1"
  std::vector<std::string> members;  ///< the members' actor names, in rank order
};

class activity_board {
 public:
  /// The calling thread computes `kind` (an op letter, "F3 (mb 3, chunk 0)" in reports;
  /// longer text as is) for `actor` until the scope ends. Nested scopes restore the outer.
  class op_scope {
   public:
    op_scope(const std::string& actor, int node, std::int32_t generation, std::int64_t step, const char* kind,
             int mb, int chunk);
    ~op_scope();
    op_scope(const op_scope&) = delete;
    op_scope& operator=(const op_scope&) = delete;

   private:
    struct saved;
    std::unique_ptr<saved> outer_;  // (null when the thread computed nothing before)
  };

  /// The calling thread's op enters (`seq`: the group's how-manyth collective, from 0) or
  /// leaves a collective of `group`. Outside an op_scope: nothing.
  static void enter_collective(const char* name, std::shared_ptr<const group_identity> group, std::int64_t seq);
  static void leave_collective();

  /// What every thread of this process computing an op of `generation`'s step `step`
  /// is doing, as the hang diagnosis takes it: in a collective, a report that waits for
  /// it from the other members (`collective` names the call, so that members found in
  /// the same call drop out of `from`); otherwise a report with only `state` set (the
  /// actor's thread is inside a long op). Ages as of now.
  static std::vector<wait_report> reports(std::int32_t generation, std::int64_t step);
};

}  // namespace troupe
