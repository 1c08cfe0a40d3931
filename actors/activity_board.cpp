#include "actors/activity_board.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

namespace troupe {

namespace {

using clock_type = std::chrono::steady_clock;

/// One thread's current op (actor null: none) and collective (name null: none).
struct thread_activity {
  const std::string* actor = nullptr;  // the actor's own name: valid while its op runs
  int node = 0;
  std::int32_t generation = 0;
  std::int64_t step = -1;
  const char* kind = "";
  int mb = 0, chunk = 0;
  clock_type::time_point since;
  const char* collective = nullptr;
  std::shared_ptr<const group_identity> group;
  std::int64_t seq = 0;
  clock_type::time_point collective_since;
};

struct board {
  std::mutex m;
  std::vector<thread_activity*> threads;
};

board& the_board() {
  static auto* b = new board;  // never destroyed: threads may end after static destruction
  return *b;
}

/// The calling thread's entry, on the board from its first op to the thread's end.
struct registration {
  thread_activity a;
  registration() {
    auto& b = the_board();
    std::lock_guard<std::mutex> lock(b.m);
    b.threads.push_back(&a);
  }
  ~registration() {
    auto& b = the_board();
    std::lock_guard<std::mutex> lock(b.m);
    b.threads.erase(std::remove(b.threads.begin(), b.threads.end(), &a), b.threads.end());
  }
};

thread_activity& mine() {
  thread_local registration r;
  return r.a;
}

std::string op_text(const thread_activity& a) {
  if (std::strlen(a.kind) == 1) return fmt::format("op {}{} (mb {}, chunk {})", a.kind, a.mb, a.mb, a.chunk);
  return fmt::format("{} (chunk {})", a.kind, a.chunk);
}

double seconds_since(clock_type::time_point t, clock_type::time_point now) {
  return std::chrono::duration<double>(now - t).count();
}

}  // namespace

struct activity_board::op_scope::saved {
  thread_activity outer;
};

activity_board::op_scope::op_scope(const std::string& actor, int node, std::int32_t generation, std::int64_t step,
                                   const char* kind, int mb, int chunk) {
  auto& a = mine();
  std::lock_guard<std::mutex> lock(the_board().m);
  if (a.actor) outer_ = std::make_unique<saved>(saved{a});
  a = thread_activity{};
  a.actor = &actor;
  a.node = node;
  a.generation = generation;
  a.step = step;
  a.kind = kind;
  a.mb = mb;
  a.chunk = chunk;
  a.since = clock_type::now();
}

activity_board::op_scope::~op_scope() {
  auto& a = mine();
  std::lock_guard<std::mutex> lock(the_board().m);
  a = outer_ ? std::move(outer_->outer) : thread_activity{};
}

void activity_board::enter_collective(const char* name, std::shared_ptr<const group_identity> group,
                                      std::int64_t seq) {
  auto& a = mine();
  std::lock_guard<std::mutex> lock(the_board().m);
  if (!a.actor) return;
  a.collective = name;
  a.group = std::move(group);
  a.seq = seq;
  a.collective_since = clock_type::now();
}

void activity_board::leave_collective() {
  auto& a = mine();
  std::lock_guard<std::mutex> lock(the_board().m);
  a.collective = nullptr;
  a.group = nullptr;
}

std::vector<wait_report> activity_board::reports(std::int32_t generation, std::int64_t step) {
  std::vector<wait_report> out;
  auto& b = the_board();
  const auto now = clock_type::now();
  std::lock_guard<std::mutex> lock(b.m);
  for (const auto* a : b.threads) {
    if (!a->actor || a->generation != generation || a->step != step) continue;
    wait_report rep;
    rep.actor = *a->actor;
    rep.node = a->node;
    rep.state = fmt::format("its thread is in {} for {:.1f} s", op_text(*a), seconds_since(a->since, now));
    if (a->collective && a->group) {
      rep.state += fmt::format(", in the {} for {:.1f} s", a->collective, seconds_since(a->collective_since, now));
      rep.waits_for = fmt::format("{} #{} of the {}", a->collective, a->seq + 1, a->group->label);
      rep.collective = fmt::format("{} #{}", a->group->label, a->seq + 1);
      for (const auto& m : a->group->members)
        if (m != rep.actor) rep.from.push_back(m);
    }
    out.push_back(std::move(rep));
  }
  return out;
}

}  // namespace troupe
