#include "actors/clock_probe_actor.hpp"

#include <algorithm>
#include <vector>

#include <caf/all.hpp>


namespace troupe {

namespace {

struct clock_probe_state {
  std::vector<clock_sample> samples;
  std::chrono::milliseconds wait{100};  ///< until the next round
};

/// A node on another machine than node 0's: probe rounds (8 round trips to the registrar,
/// one at a time), each refitting `clock`'s line, so trace events stay on node 0's
/// timeline while the two clocks drift apart. The first comes 0.1 s after the join probe
/// and the waits double up to `interval`: the rate is known early, and each estimate of it
/// (good to the offset's error over the span probed) is used for no longer than that span.
clock_probe_actor::behavior_type clock_probe_keeper(clock_probe_actor::stateful_pointer<clock_probe_state> self,
                                                    registrar_actor registrar, std::shared_ptr<job_clock> clock,
                                                    std::chrono::milliseconds interval) {
  self->state.wait = std::min(self->state.wait, interval);
  self->delayed_send(self, self->state.wait, timeout_atom_v);
  return {
      [=](timeout_atom) {
        const auto sent = clock->local_ns();
        self->request(registrar, std::chrono::seconds(10), clock_atom_v)
            .then(
                [=](std::int64_t remote) {
                  auto& s = self->state;
                  s.samples.push_back({sent, remote, clock->local_ns()});
                  if (s.samples.size() < 8) {
                    self->send(self, timeout_atom_v);
                    return;
                  }
                  clock->add_probe(s.samples);
                  s.samples.clear();
                  s.wait = std::min(2 * s.wait, interval);
                  self->delayed_send(self, s.wait, timeout_atom_v);
                },
                [=](caf::error&) {  // no answer in 10 s: try a new round later (node 0 gone: the node ends)
                  self->state.samples.clear();
                  self->delayed_send(self, self->state.wait, timeout_atom_v);
                });
      },
  };
}

}  // namespace

clock_probe_actor spawn_clock_probe(caf::actor_system& sys, registrar_actor registrar, std::shared_ptr<job_clock> clock,
                                    std::chrono::milliseconds interval) {
  return sys.spawn(clock_probe_keeper, std::move(registrar), std::move(clock), interval);
}

}  // namespace troupe
