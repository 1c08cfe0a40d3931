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
  // The callbacks once, shared by every request (they may hold much: a step's metrics
  // line; copied into each of thousands of requests, they took seconds per step).
  struct wait {
    std::size_t left;
    bool given_up;
    std::function<void(std::size_t, Reply&)> each;
    std::function<void()> done;
    std::function<bool(std::size_t, caf::error&)> failed;
  };
  auto w = std::make_shared<wait>(wait{to.size(), false, std::move(each), std::move(done), std::move(failed)});
  if (to.empty()) return w->done();
  for (std::size_t i = 0; i < to.size(); ++i)
    self->request(to[i], timeout, msg...)
        .then(
            [w, i](Reply& reply) {
              if (w->given_up) return;
              w->each(i, reply);
              if (--w->left == 0) w->done();
            },
            [w, i](caf::error& err) {
              if (w->given_up) return;
              if (!w->failed(i, err)) {
                w->given_up = true;
                return;
              }
              if (--w->left == 0) w->done();
            });
}

}  // namespace troupe
