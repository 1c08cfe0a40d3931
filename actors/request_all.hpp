#pragma once
// Waiting for N replies: one request to each of several actors, the replies handled as
// they come, and one continuation after the last.
#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include <caf/actor.hpp>
#include <caf/error.hpp>

namespace troupe {

/// Sends the message `msg...` to every actor of `to` (plain or typed handles; a typed one
/// must answer it with `Reply`) as a request (each with `timeout`).
/// `each(i, reply)` handles actor i's reply as it comes; `failed(i, error)` its error, and
/// returns true to count it as answered (the wait goes on) or false to give up (nothing
/// more is called). After the last answer, `done()` runs once; with no actor to ask, at
/// once.
template <class Reply, class Self, class Handle, class... Message>
void request_all(Self* self, const std::vector<Handle>& to, caf::timespan timeout,
                 std::function<void(std::size_t, Reply&)> each, std::function<void()> done,
                 std::function<bool(std::size_t, caf::error&)> failed, const Message&... msg) {
  struct wait {
    std::size_t left;
    bool given_up = false;
  };
  auto w = std::make_shared<wait>(wait{to.size()});
  if (to.empty()) return done();
  for (std::size_t i = 0; i < to.size(); ++i)
    self->request(to[i], timeout, msg...)
        .then(
            [w, i, each, done](Reply& reply) {
              if (w->given_up) return;
              each(i, reply);
              if (--w->left == 0) done();
            },
            [w, i, done, failed](caf::error& err) {
              if (w->given_up) return;
              if (!failed(i, err)) {
                w->given_up = true;
                return;
              }
              if (--w->left == 0) done();
            });
}

}  // namespace troupe
