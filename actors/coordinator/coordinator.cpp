#include "actors/coordinator/coordinator.hpp"
#include "actors/coordinator/state.hpp"
#include "actors/simulated/simulated.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <deque>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <caf/all.hpp>
#include <nlohmann/json.hpp>

#include "actors/request_all.hpp"
#include "actors/supervisor_actor.hpp"
#include "actors/trace.hpp"
#include "actors/wait_graph.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "compute/runtime/kernel_profile.hpp"
#include "compute/optim/optimizer.hpp"
#include "compute/trainer/local_pipeline.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "messages/type_ids.hpp"

namespace troupe::coordinator {


/// Where the gradient-norm partial of virtual stage `x`'s shard of pipeline `pipe` goes
/// among a step's partials: (virtual stage, tensor-parallel rank, data-parallel rank)
/// order, the local loop's.
std::size_t partial_index(const runtime_context& ctx, int x, int pipe) {
  return (std::size_t(x) * ctx.t + ctx.tp_of(pipe)) * ctx.d + ctx.dp_of(pipe);
}


/// True the first time report `index` of this step arrives; a duplicate (a resent or
/// duplicated control message) is logged and dropped.
bool first_report(std::vector<bool>& seen, std::size_t index, const char* what, std::int64_t step) {
  if (index >= seen.size() || !seen[index]) {
    if (index < seen.size()) seen[index] = true;
    return true;
  }
  spdlog::warn("step {}: duplicate {} {} dropped", step + 1, what, index);
  return false;
}

void begin(self_ptr self);

std::function<bool(std::size_t, caf::error&)> fail_with(self_ptr self, std::string what) {
  return [self, what](std::size_t, caf::error& err) {
    fail(self, what + ": " + self->system().render(err));
    return false;
  };
}

void finish_after_write(self_ptr self, int code, const std::string& error) {
  auto& s = self->state;
  if (!s.pending) return finish(self, code, error);
  if (s.ending) return;
  s.ending = true;
  spdlog::warn("{}; the run ends once the background write of step {}'s checkpoint is over", error, s.pending->step);
  s.pending->waiting.push_back([=] { finish(self, code, error); });
}

/// Stops everything and answers the run request.
void finish(self_ptr self, int code, const std::string& error) {
  auto& s = self->state;
  if (s.at == phase::finished) return;
  abandon_pending_checkpoint(self);
  enter(self, phase::finished);
  s.result->exit_code = code;
  s.result->error = error;
  if (code != 0) spdlog::error("{}", error);
  if (!s.opts.trace_path.empty()) {
    // Checked writable at the start; should it fail now (a full disk), the run's result
    // stands and the reason is logged: an exception here would leave the run unanswered.
    try {
      write_chrome_trace(s.opts.trace_path, s.result->events, s.ctx->pipes, s.ctx->p);
      spdlog::info("trace written to {}", s.opts.trace_path);
    } catch (const std::exception& e) {
      spdlog::error("trace not written: {}", e.what());
    }
  }
  s.done.deliver(code);
  for (auto& sup : s.supervisors) self->send_exit(sup, caf::exit_reason::user_shutdown);
  self->quit();
}

/// Aborts the step and ends the run. `recoverable`: a restart from the last checkpoint
/// can cure it (a node or actor lost, a step timed out; exit_recoverable) rather than a
/// problem that would come back the same way (exit 1).
void retry_in_place(self_ptr self);

void fail(self_ptr self, const std::string& why, bool recoverable, bool new_round) {
  auto& s = self->state;
  if (s.at == phase::finished || s.ending || (s.at == phase::rebuilding && !new_round)) return;
  const bool evaluating = s.at == phase::evaluating;
  // Step not committed, every node process alive: rebuild the actors from the snapshots
  // of the state before this step and run it again (bounded), instead of exiting for a
  // restart of the whole job.
  const bool committed = s.at == phase::between_steps || evaluating;
  const bool in_place = recoverable && !committed && !s.node_lost && s.attempt < s.ctx->cfg.max_step_retries;
  if (!in_place)
    for (auto& sup : s.supervisors) self->send(sup, abort_step{s.step, why});
  if (s.metrics.is_open())  // when and why, for the time to detect and to recover
    s.metrics << nlohmann::json{{"event", "abort"},
                                {"step", s.step},
                                {"attempt", s.attempt},
                                {"reason", why},
                                {"recoverable", recoverable},
                                {"retry_in_place", in_place},
                                {"seconds_into_step", (s.ctx->now_us() - s.started_us) * 1e-6},
                                {"unix_time", std::chrono::duration<double>(
                                                  std::chrono::system_clock::now().time_since_epoch())
                                                  .count()}}
                         .dump()
              << '\n'
              << std::flush;
  // Steps count from 1 in what people read (progress lines), from 0 in metrics and faults.
  const auto what = (evaluating ? "the evaluation after step " : "step ") + std::to_string(s.step + 1) + "/" +
                    std::to_string(s.ctx->cfg.steps) + (evaluating ? " failed: " : " aborted: ") + why;
  if (!in_place) return finish_after_write(self, recoverable ? exit_recoverable : 1, what);
  spdlog::warn("{}; retrying it in place ({} of at most {})", what, s.attempt + 1, s.ctx->cfg.max_step_retries);
  retry_in_place(self);
}

void wire_and_start(self_ptr self, std::shared_ptr<std::vector<node_actors>> nodes);

/// Has every supervisor rebuild its node's actors from the state before this step (with
/// fresh communicators), sends every node the new handles, then runs the step again.
/// Messages of the old actors are dropped meanwhile: they are all gone when their
/// supervisor answers, what they sent came before that answer over the same connection,
/// and failures their transfers report later carry the old generation.
void retry_in_place(self_ptr self) {
  auto& s = self->state;
  enter(self, phase::rebuilding);
  const auto round = ++s.rounds;
  const double t0 = s.ctx->now_us();
  auto nodes = std::make_shared<std::vector<node_actors>>();
  auto rejoined = std::make_shared<std::vector<int>>();
  auto collect = [=](const node_actors& n) {
    auto& s = self->state;
    if (s.at != phase::rebuilding || s.rounds != round) return;
    nodes->push_back(n);
    if (nodes->size() < s.supervisors.size()) return;
    enter(self, phase::wiring);
    ++s.attempt;
    s.skipped = s.skipped_before;
    const double took = (s.ctx->now_us() - t0) * 1e-6;
    spdlog::info("step {}: actors rebuilt from the in-memory snapshots in {:.2f} s; running it again", s.step + 1,
                 took);
    if (s.metrics.is_open())
      s.metrics << nlohmann::json{{"event", "retry"},
                                  {"step", s.step},
                                  {"attempt", s.attempt},
                                  {"rebuild_seconds", took},
                                  {"rejoined_nodes", *rejoined}}
                       .dump()
                << '\n'
                << std::flush;
    wire_and_start(self, nodes);  // the new handles to every node, then begin
  };
  auto failed = [=](const std::string& why) {
    auto& s = self->state;
    if (s.at != phase::rebuilding || s.rounds != round) return;
    s.attempt = s.ctx->cfg.max_step_retries;  // no further in-place attempt
    fail(self, why, true, /*new_round=*/true);
  };
  const auto rebuild_failed = [=](caf::error& err) {
    failed("rebuilding the actors failed: " + self->system().render(err));
  };
  const auto wait = std::chrono::seconds(120 + s.ctx->cfg.rejoin_timeout);
  for (std::size_t i = 0; i < s.supervisors.size(); ++i) {
    if (!s.lost.count(int(i))) {
      self->request(s.supervisors[i], wait, recover_atom_v, s.step, round).then(collect, rebuild_failed);
      continue;
    }
    // A lost node: wait for the process the launcher starts in its place, then have it
    // rebuild from the copies of its shards on the next node (its buddy).
    self->request(s.registrar, std::chrono::seconds(s.ctx->cfg.rejoin_timeout), rejoin_atom_v, std::int32_t(i),
                  caf::actor_cast<caf::actor>(s.lost.at(int(i))))
        .then(
            [=](const caf::actor& plain) {
              const auto sup = caf::actor_cast<supervisor_actor>(plain);
              auto& s = self->state;
              if (s.at != phase::rebuilding || s.rounds != round) return;
              const auto buddy = (i + 1) % s.supervisors.size();
              spdlog::info("node {} rejoined {:.2f} s after the abort: rebuilding its actors from the copies on node {}",
                           i, (s.ctx->now_us() - t0) * 1e-6, buddy);
              s.lost.erase(int(i));
              s.supervisors[i] = sup;
              self->monitor(sup);
              rejoined->push_back(int(i));
              self->request(sup, wait, recover_atom_v, s.step, round, caf::actor_cast<caf::actor>(s.supervisors[buddy]))
                  .then(collect, rebuild_failed);
            },
            [=](caf::error& err) {
              if (self->state.at != phase::rebuilding || self->state.rounds != round) return;
              self->state.node_lost = true;
              failed("node " + std::to_string(i) + " did not rejoin within " +
                     std::to_string(self->state.ctx->cfg.rejoin_timeout) + " s (" + self->system().render(err) + ")");
            });
  }
}

/// After a clean reset: evaluation / checkpoint when due, then the next step or the end.
void after_reset(self_ptr self, nlohmann::json line) {
  auto& s = self->state;
  const auto& cfg = s.ctx->cfg;
  const int done_steps = int(s.step) + 1;
  const bool last = done_steps == cfg.steps;
  // (A simulated model has no outputs to score: no evaluation.)
  const bool eval = !s.ctx->simulated && (last || (cfg.eval_interval > 0 && done_steps % cfg.eval_interval == 0));
  // Asked to stop (SIGTERM, SIGUSR1): this committed step is the run's last, checkpointed.
  const int stop = last ? 0 : stop_requested();
  const bool due = last || stop || (cfg.checkpoint_interval > 0 && done_steps % cfg.checkpoint_interval == 0);
  const bool save = !cfg.save.empty() && due;
  const bool folder = !cfg.checkpoint_dir.empty() && due;
  auto proceed = [self, last, stop, done_steps](state_dict state) {
    auto& s = self->state;
    if ((last || stop) && !s.save_failure.empty()) return finish(self, 1, save_failure_text(s));
    if (stop) return finish(self, exit_stopped, stopped_text(stop, done_steps, s.ctx->cfg));
    if (last) {
      s.result->final_state = std::move(state);
      spdlog::info("done: {} steps in {}", s.timed, duration_text(s.elapsed));
      if (s.checkpoints > 0 && s.background_checkpoints == 0)
        spdlog::info("checkpoint folders: {} written between steps in {:.2f} s ({:.0f} ms each)",
                     s.checkpoints, s.checkpoint_seconds, s.checkpoint_seconds / s.checkpoints * 1e3);
      else if (s.checkpoints > 0)
        spdlog::info("checkpoint folders: {} written ({} in the background, durable {:.2f} s after their snapshot "
                     "on average); training waited {:.2f} s for them ({:.0f} ms each)",
                     s.checkpoints, s.background_checkpoints, s.durable_seconds / s.background_checkpoints,
                     s.checkpoint_seconds, s.checkpoint_seconds / s.checkpoints * 1e3);
      if (s.checkpoint_failures > 0)
        spdlog::warn("{} checkpoint(s) due during the run could not be written (see the errors above)",
                     s.checkpoint_failures);
      return finish(self, 0, "");
    }
    ++s.step;
    s.attempt = 0;
    begin(self);
  };
  // (Parameters sharded: the stages hold no parameters between steps; the model is
  // gathered from the shards and evaluated here.)
  const bool gathered_eval = eval && (cfg.eval_mode == "gather" || s.ctx->shards_params());
  // The checkpoint folder (written by the stages, nothing gathered), then the next step.
  auto write_then_proceed = [=](state_dict model) {
    if (!folder) return proceed(std::move(model));
    write_folder(self, last || stop, [=, model = std::move(model)]() mutable { proceed(std::move(model)); });
  };
  // After the evaluation (if any): the gathered model where something needs it (a gathered
  // evaluation, --save, the run's end when the caller wants the final state), the metrics
  // line, the checkpoints, then the next step.
  auto rest = [=](nlohmann::json line) {
    if (!gathered_eval && !save && !(last && self->state.opts.final_state)) {
      write_metrics(self, line);
      return write_then_proceed({});
    }
    const double t0 = self->state.ctx->now_us();
    fetch_state(self, [=](state_dict model) mutable {
      if (gathered_eval) evaluate(self, model, line, t0);  // with the parameters the stages compute with
      write_metrics(self, line);
      const bool rounded = self->state.ctx->compute_dtype != torch::kFloat32;
      if (!save && !(last && rounded)) return write_then_proceed(std::move(model));
      with_shard_state(self, std::move(model), [=](state_dict model, named_moments moments) {
        if (save && !save_file(self, model, moments, last || stop)) return;
        write_then_proceed(std::move(model));
      });
    });
  };
  if (!eval || gathered_eval) return rest(std::move(line));
  const double t0 = s.ctx->now_us();
  evaluate_in_pipeline(self, [=](const evaluation& e) mutable {
    auto& s = self->state;
    const double seconds = (s.ctx->now_us() - t0) * 1e-6;
    spdlog::info("step {}: {} ({} forward(s) through the pipeline in {:.2f} s)", done_steps, e.summary(),
                 s.eval_scores.size(), seconds);
    record_evaluation(self, e, seconds, line);
    rest(std::move(line));
  });
}

// --- the hang watchdog and the wait-for graph ---

/// The watchdog's limit: a step without progress (no report arriving) for this long is a
/// hang. A few times (train.hang_factor) the recent steps' median, never under
/// train.hang_min_seconds; before a step's time is known, first_step_hang_seconds.
/// train.step_timeout stays the hard limit.
double hang_limit_seconds(const coordinator_state& s) {
  const auto& cfg = s.ctx->cfg;
  if (s.recent_steps.empty()) return std::max(first_step_hang_seconds, double(cfg.hang_min_seconds));
  std::vector<double> v(s.recent_steps.begin(), s.recent_steps.end());
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return std::max(double(cfg.hang_min_seconds), cfg.hang_factor * v[v.size() / 2]);
}

/// The coordinator's own part of the graph: the reports of this step it still waits for.
wait_report coordinator_waits(const coordinator_state& s) {
  const auto& ctx = *s.ctx;
  wait_report rep;
  rep.actor = "coordinator";
  rep.node = 0;
  const auto begun = "begin of step " + std::to_string(s.step + 1);
  for (int r = 0; r < ctx.pipes && s.sent_begin; ++r) {
    rep.sent.push_back(message_key(begun, "coordinator", ctx.loader_name(r)));
    for (int k = 0; k < ctx.p; ++k) {
      rep.sent.push_back(message_key(begun, "coordinator", ctx.stage_name(r, k)));
      rep.sent.push_back(message_key(begun, "coordinator", ctx.shard_name(k, r)));
    }
  }
  for (int k = 0; k < ctx.p && s.sent_clip; ++k)
    for (int r = 0; r < ctx.pipes; ++r) rep.sent.push_back(message_key("the clip factor", "coordinator", ctx.shard_name(k, r)));
  if (s.at != phase::stepping) {
    rep.state = s.step < ctx.cfg.steps ? "between steps (an evaluation, a checkpoint or the next step's start)"
                                       : "at the run's end";
    return rep;
  }
  int missing[4] = {0, 0, 0, 0};
  std::unordered_set<std::string> waited;  // (rep.from without repeats, in first-seen order)
  auto expect = [&](bool seen, int kind, const std::string& what, const std::string& actor) {
    if (seen) return;
    ++missing[kind];
    rep.keys.push_back(message_key(what, actor, "coordinator"));
    if (waited.insert(actor).second) rep.from.push_back(actor);
  };
  for (int r = 0; r < ctx.d; ++r)  // (tensor parallelism: rank 0 of each replica reports)
    for (int mb = 0; mb < ctx.m; ++mb)
      expect(s.seen_losses.at(std::size_t(r) * ctx.m + mb), 0, "loss mb " + std::to_string(mb),
             ctx.stage_name(r * ctx.t, ctx.loss_stage()));
  for (int x = 0; x < ctx.n_virtual; ++x)
    for (int rank = 0; rank < ctx.pipes; ++rank)
      expect(s.seen_partials.at(partial_index(ctx, x, rank)), 1,
             "gradient-norm partial of chunk " + std::to_string(ctx.place(x).second), ctx.shard_name(ctx.place(x).first, rank));
  for (int r = 0; r < ctx.pipes; ++r)
    for (int k = 0; k < ctx.p; ++k) expect(s.seen_stages.at(std::size_t(r) * ctx.p + k), 2, "stage done", ctx.stage_name(r, k));
  for (int k = 0; k < ctx.p; ++k)
    for (int r = 0; r < ctx.pipes; ++r)
      expect(s.seen_shards.at(std::size_t(k) * ctx.pipes + r), 3, "shard done", ctx.shard_name(k, r));
  const char* kinds[4] = {"loss reports", "gradient-norm partials", "stage-done reports", "shard-done reports"};
  std::vector<std::string> parts;
  for (int i = 0; i < 4; ++i)
    if (missing[i]) parts.push_back(std::to_string(missing[i]) + " " + kinds[i]);
  for (std::size_t i = 0; i < parts.size(); ++i)
    rep.waits_for += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
  rep.state = "step " + std::to_string(s.step + 1) + ", attempt " + std::to_string(s.attempt + 1);
  return rep;
}

/// Asks every actor what it waits for in this step (each answers within
/// wait_answer_timeout, or counts as blocked), logs the wait-for graph and its root, and
/// then, for a hang (`hang`), aborts the step, which is retried in place; for a status
/// request (SIGUSR2 to node 0) the job goes on undisturbed.
void diagnose(self_ptr self, bool hang, double idle_s, double limit_s) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  s.diagnosing = true;
  const auto step = s.step;
  const auto attempt = s.attempt;
  struct asked_actor {
    step_actor handle;
    wait_report stub;  // its name and node, should it not answer
  };
  auto asked = std::make_shared<std::vector<asked_actor>>();
  auto stub = [](std::string name, int node) {
    wait_report r;
    r.actor = std::move(name);
    r.node = node;
    return r;
  };
  for (int r = 0; r < ctx.pipes; ++r)
    for (int k = 0; k < ctx.p; ++k)
      asked->push_back({s.wiring->stages[r][k], stub(ctx.stage_name(r, k), s.stage_nodes.at(std::size_t(r) * ctx.p + k))});
  for (int k = 0; k < ctx.p; ++k)
    for (int r = 0; r < ctx.pipes; ++r)
      asked->push_back({s.wiring->shards[k][r], stub(ctx.shard_name(k, r), s.stage_nodes.at(std::size_t(r) * ctx.p + k))});
  for (int r = 0; r < ctx.pipes; ++r)
    asked->push_back({s.wiring->loaders[r], stub(ctx.loader_name(r), s.loader_nodes.at(r))});
  auto answers = std::make_shared<std::vector<std::optional<wait_report>>>(asked->size());
  auto boards = std::make_shared<std::vector<wait_report>>();  // what the nodes' threads compute
  auto answered = std::make_shared<std::vector<bool>>(s.supervisors.size(), false);  // by node: its board came
  auto finish = [=] {
    auto& s = self->state;
    s.diagnosing = false;
    // Its own waits after every answer and every node's board: what an actor reported
    // before answering has arrived. Its supervisor had it before the actor answered, and
    // sends what it holds before its board (CAF keeps the order of one actor's messages
    // to another).
    const auto own = coordinator_waits(s);
    std::vector<wait_report> reports{own}, silent;
    // The nodes' word for each actor: its board entry inside an op (waits_for set) before
    // any other (one lookup per silent actor, not a scan of every board).
    std::unordered_map<std::string, const wait_report*> board_of;
    for (const auto& r : *boards) {
      auto& at = board_of[r.actor];
      if (!at || (at->waits_for.empty() && !r.waits_for.empty())) at = &r;
    }
    for (std::size_t i = 0; i < asked->size(); ++i) {
      if ((*answers)[i]) {
        reports.push_back(std::move(*(*answers)[i]));
        continue;
      }
      // An actor that did not answer because its thread is inside an op: its node's word
      // for it (in a collective: a wait for the members not in the same call).
      auto stub = (*asked)[i].stub;
      const auto board = board_of.find(stub.actor);
      if (board != board_of.end() && !board->second->waits_for.empty()) {
        reports.push_back(*board->second);
        continue;
      }
      if (board != board_of.end())
        stub.state = board->second->state;
      else if (stub.node >= 0 && std::size_t(stub.node) < answered->size() && (*answered)[std::size_t(stub.node)])
        stub.state = "its node answered, but its thread is in no op: frozen or stuck in the actor's own code";
      else if (answered->size() > 1)
        stub.state = "its node process did not answer either: frozen, cut off or gone";
      silent.push_back(std::move(stub));
    }
    const auto d =
        diagnose_waits(reports, silent, std::chrono::duration<double>(wait_answer_timeout).count(), /*settled=*/hang);
    std::string block;
    for (const auto& line : d.lines) block += "\n  " + line;
    if (d.lines.size() < d.all_lines.size() && spdlog::should_log(spdlog::level::debug)) {
      std::string all;
      for (const auto& line : d.all_lines) all += "\n  " + line;
      spdlog::debug("every actor's wait in step {}:{}", step + 1, all);
    }
    const auto what = "step " + std::to_string(step + 1) + "/" + std::to_string(s.ctx->cfg.steps);
    const bool same = step == s.step && attempt == s.attempt && s.at == phase::stepping;
    if (!hang) {
      spdlog::info("status of {} (the coordinator: {}; {:.1f} s since the step's last progress, hang limit {:.1f} "
                   "s); what each actor waits for:{}\n  root: {}",
                   what, own.state, idle_s, limit_s, block, d.root);
    } else if (!same) {
      spdlog::warn("{} was slow: no progress for {:.1f} s (hang limit {:.1f} s), then it went on", what, idle_s, limit_s);
    } else {
      spdlog::error("{}: no progress for {:.1f} s (hang limit {:.1f} s); what each actor waits for:{}\n  root: {}",
                    what, idle_s, limit_s, block, d.root);
      fail(self, fmt::format("no progress for {:.1f} s: {}", idle_s, d.root));
    }
  };
  // After the actors' answers, the nodes' supervisors send the reports they hold and say
  // what the threads of the actors that did not answer compute (activity_board).
  auto conclude = [=] {
    auto& s = self->state;
    request_all<std::vector<wait_report>>(
        self, s.supervisors, wait_answer_timeout,
        [boards, answered](std::size_t i, std::vector<wait_report>& found) {
          (*answered)[i] = true;
          boards->insert(boards->end(), found.begin(), found.end());
        },
        finish, [](std::size_t, caf::error&) { return true; }, activity_atom_v, step);
  };
  std::vector<step_actor> handles;
  for (const auto& a : *asked) handles.push_back(a.handle);
  request_all<wait_report>(
      self, handles, wait_answer_timeout, [answers](std::size_t i, wait_report& rep) { (*answers)[i] = std::move(rep); },
      conclude, [](std::size_t, caf::error&) { return true; }, wait_atom_v, step);
}

/// The per-(replica, stage) figures of a step's metrics line: each entry up to
/// per_rank_metrics_limit of them; beyond, per pipeline stage (p entries) the median and
/// the maximum over the replicas, since a line with an entry per rank of a job of thousands
/// is megabytes (and copying it cost seconds between steps).
void add_stage_metrics(nlohmann::json& line, const std::vector<double>& busy, const std::vector<double>& idle,
                       const std::vector<int>& peaks, int p) {
  constexpr std::size_t per_rank_metrics_limit = 1024;
  if (busy.size() <= per_rank_metrics_limit) {
    line["stage_busy_s"] = busy;
    line["stage_idle_s"] = idle;
    line["peak_in_flight"] = peaks;
    return;
  }
  auto by_stage = [p](const auto& xs, const char* name, nlohmann::json& out) {
    std::vector<nlohmann::json> median, max;
    for (int k = 0; k < p; ++k) {  // [replica * p + stage]
      std::vector<double> col;
      for (std::size_t i = std::size_t(k); i < xs.size(); i += std::size_t(p)) col.push_back(double(xs[i]));
      std::sort(col.begin(), col.end());
      median.emplace_back(col.empty() ? 0.0 : col[col.size() / 2]);
      max.emplace_back(col.empty() ? 0.0 : col.back());
    }
    out[std::string(name) + "_median"] = median;
    out[std::string(name) + "_max"] = max;
  };
  by_stage(busy, "stage_busy_s", line);
  by_stage(idle, "stage_idle_s", line);
  by_stage(peaks, "peak_in_flight", line);
}

void commit(self_ptr self) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  enter(self, phase::between_steps);  // committed
  s.stats.loss = 0;
  const double weight = ctx.loss_weight();
  for (double l : s.losses) s.stats.loss += l * weight;  // replica order, micro-batch order
  s.stats.seconds = (ctx.now_us() - s.started_us) * 1e-6;
  s.stats.tokens = std::int64_t(ctx.cfg.global_batch) *
                   (ctx.spec.type == model_spec::kind::decoder ? ctx.spec.decoder.seq_len : 1);
  if (!std::isfinite(s.stats.loss) && !s.skipping) return fail(self, "loss is " + std::to_string(s.stats.loss), false);
  s.elapsed += s.stats.seconds;
  ++s.timed;
  s.recent_steps.push_back(s.stats.seconds);
  if (s.recent_steps.size() > recent_step_count) s.recent_steps.pop_front();
  const auto timing = measure_step(s.events, ctx.pipes, ctx.p);
  if (s.profile && s.step == s.profile_request->last && s.profile->running()) {
    s.profile->stop(s.profile_request->path);
    spdlog::info("kernel profile of steps {}..{} written to {}", s.profile_request->first + 1, s.step + 1,
                 s.profile_request->path);
  }
  s.result->losses.push_back(s.stats.loss);
  s.result->bubbles.push_back(timing.bubble);
  s.result->step_seconds.push_back(s.stats.seconds);
  s.result->events.insert(s.result->events.end(), s.events.begin(), s.events.end());
  const bool text = ctx.spec.type == model_spec::kind::decoder;
  if (!s.opts.quiet) {
    const double eta = s.elapsed / s.timed * (ctx.cfg.steps - s.step - 1);
    const auto simulated = ctx.simulated ? fmt::format(" | simulated: modelled {:.4g} s, runtime {:+.4g} s",
                                                       ctx.simulated->step_seconds(),
                                                       s.stats.seconds - ctx.simulated->step_seconds())
                                         : std::string();
    std::printf("%s | bubble %.2f%s\n", progress_line(s.stats, ctx.cfg.steps, eta, text).c_str(), timing.bubble,
                simulated.c_str());
    std::fflush(stdout);
  }
  nlohmann::json line{{"step", s.step},
                      {"loss", s.stats.loss},
                      {"lr", s.stats.lr},
                      {"grad_norm", s.stats.grad_norm},
                      {"tokens_per_s", s.stats.tokens / s.stats.seconds},
                      {"step_seconds", s.stats.seconds},
                      {"bubble", timing.bubble},
                      {"grad_reduce_tail_s", timing.reduce_tail_s},
                      {"skipped", s.skipping},
                      {"since_start_seconds", ctx.now_us() * 1e-6},
                      {"coordinator_cpu_seconds", s.step_cpu_s},
                      {"process_cpu_seconds", cpu_meter::process_seconds() - s.step_process_cpu0},
                      {"coordinator_messages", s.step_messages_in + s.step_messages_out}};
  add_stage_metrics(line, timing.busy_s, timing.idle_s, s.peaks, ctx.p);
  // A simulated step: the cost model's step (scaled) and what the runtime added to it.
  if (ctx.simulated) {
    line["modelled_step_seconds"] = ctx.simulated->step_seconds();
    line["runtime_overhead_seconds"] = s.stats.seconds - ctx.simulated->step_seconds();
  }
  // The step ran while a checkpoint folder was being written in the background.
  if (s.writing_at_begin >= 0) line["checkpoint_writing"] = s.writing_at_begin;
  add_expert_metrics(line, s.stats, ctx.spec);
  // Reset: the supervisors drop every actor's per-step state and report leftovers.
  auto reports = std::make_shared<std::vector<reset_report>>();
  request_all<std::vector<reset_report>>(
      self, s.supervisors, reset_check_timeout,
      [reports](std::size_t, std::vector<reset_report>& mine) { reports->insert(reports->end(), mine.begin(), mine.end()); },
      [self, reports, line] {
        if (reports->empty()) return after_reset(self, line);
        std::string msg = "per-step state left after reset:";
        for (const auto& r : *reports)
          for (const auto& l : r.leftovers) msg += " " + r.actor + ": " + l + ";";
        fail(self, msg, false);
      },
      fail_with(self, "reset check failed"), check_atom_v, reset_step{s.step});
}

void maybe_commit(self_ptr self) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  if (s.n_losses == ctx.d * ctx.m && s.n_stages == ctx.pipes * ctx.p && s.n_shards == ctx.p * ctx.pipes)
    commit(self);
}

void begin(self_ptr self) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  s.step_cpu_s = 0;
  s.step_messages_in = s.step_messages_out = 0;
  s.step_process_cpu0 = cpu_meter::process_seconds();
  const cpu_meter meter(s);
  s.stats = step_stats{};
  s.stats.step = int(s.step);
  s.stats.lr = s.lrs.at(int(s.step), ctx.cfg.steps);
  s.losses.assign(std::size_t(ctx.d) * ctx.m, 0.0);
  s.partials.assign(std::size_t(ctx.n_virtual) * ctx.pipes, 0.0);
  s.n_losses = s.n_partials = s.n_stages = s.n_shards = 0;
  s.seen_losses.assign(s.losses.size(), false);
  s.seen_partials.assign(s.partials.size(), false);
  s.seen_stages.assign(std::size_t(ctx.pipes) * ctx.p, false);
  s.seen_shards.assign(std::size_t(ctx.p) * ctx.pipes, false);
  s.skipping = false;
  s.writing_at_begin = s.pending ? s.pending->step : -1;
  s.events.clear();
  s.peaks.assign(std::size_t(ctx.pipes) * ctx.p, 0);
  if (s.profile && s.step == s.profile_request->first && !s.profile->running()) s.profile->start();
  s.started_us = ctx.now_us();
  if (const auto& plant = s.opts.plant_leftover; plant && plant->step == s.step)
    self->send(s.supervisors.front(), plant_atom_v, plant->replica, plant->stage);
  s.skipped_before = s.skipped;
  enter(self, phase::stepping);
  s.last_progress_us = s.started_us;
  s.sent_begin = true;
  s.sent_clip = false;
  // Through each node's supervisor, which sends it on to its shards, stages and loaders.
  const begin_step msg{s.step, s.stats.lr, s.attempt};
  for (const auto& sup : s.supervisors) self->send(sup, msg);
  s.step_messages_out += std::int64_t(s.supervisors.size());
  self->delayed_send(self, std::chrono::seconds(ctx.cfg.step_timeout), timeout_atom_v, s.step, s.attempt);
}


/// Builds the job's wiring from every supervisor's node_actors and sends it to all of
/// them; then starts the first step (or ends at once when nothing is left to run).
void wire_and_start(self_ptr self, std::shared_ptr<std::vector<node_actors>> nodes) {
  auto& s = self->state;
  const auto& ctx = *s.ctx;
  wiring_msg w;
  w.coordinator = caf::actor_cast<caf::actor>(self);
  w.stages.resize(std::size_t(ctx.pipes) * ctx.p);
  w.shards.resize(std::size_t(ctx.p) * ctx.pipes);
  w.loaders.resize(ctx.pipes);
  w.nodes.assign(std::size_t(ctx.pipes) * ctx.p, -1);
  // Buddy copies of the shards only where a lost node can come back (they cost time).
  if (s.opts.node_restarts > 0 && ctx.cfg.rejoin_timeout > 0) w.supervisors = plain_handles(s.supervisors);
  s.stage_nodes.assign(std::size_t(ctx.pipes) * ctx.p, 0);
  s.loader_nodes.assign(ctx.pipes, 0);
  for (const auto& n : *nodes) {
    for (int r : n.loader_replicas) s.loader_nodes.at(r) = n.node;
    for (std::size_t i = 0; i < n.slot_replicas.size(); ++i) {
      const int r = n.slot_replicas[i], k = n.slot_stages[i];
      s.stage_nodes.at(std::size_t(r) * ctx.p + k) = n.node;
      w.stages.at(std::size_t(r) * ctx.p + k) = n.stages.at(i);
      w.shards.at(std::size_t(k) * ctx.pipes + r) = n.shards.at(i);
      w.nodes.at(std::size_t(r) * ctx.p + k) = n.node;
    }
    for (std::size_t i = 0; i < n.loader_replicas.size(); ++i) w.loaders.at(n.loader_replicas[i]) = n.loaders.at(i);
  }
  for (std::size_t i = 0; i < w.stages.size(); ++i)
    if (!w.stages[i] || !w.shards[i]) return fail(self, "the nodes do not cover every stage", false);
  for (const auto& l : w.loaders)
    if (!l) return fail(self, "the nodes do not cover every data loader", false);
  s.wiring->coordinator = caf::actor_cast<coordinator_actor>(self);
  s.wiring->stages.assign(ctx.pipes, std::vector<stage_actor>(ctx.p));
  s.wiring->shards.assign(ctx.p, std::vector<shard_actor>(ctx.pipes));
  for (int r = 0; r < ctx.pipes; ++r)
    for (int k = 0; k < ctx.p; ++k) {
      s.wiring->stages[r][k] = caf::actor_cast<stage_actor>(w.stages[std::size_t(r) * ctx.p + k]);
      s.wiring->shards[k][r] = caf::actor_cast<shard_actor>(w.shards[std::size_t(k) * ctx.pipes + r]);
    }
  s.wiring->loaders = typed_handles<loader_actor>(w.loaders);
  request_all<bool>(
      self, s.supervisors, std::chrono::seconds(60), [](std::size_t, bool&) {},
      [self] {
        if (self->state.step < self->state.ctx->cfg.steps) return begin(self);
        if (!self->state.opts.final_state) return finish(self, 0, "");
        fetch_final_state(self, [=](state_dict state) {  // nothing left to run
          self->state.result->final_state = std::move(state);
          finish(self, 0, "");
        });
      },
      fail_with(self, "a supervisor was not wired"), w);
}

/// A node's supervisor is gone: its actors and snapshots went with it (a rejoin, or the
/// run ends for a restart from its newest checkpoint).
void on_node_down(self_ptr self, const caf::down_msg& msg) {
  auto& s = self->state;
  if (s.pending && s.pending->on_down(msg)) return;  // a background checkpoint writer
  for (std::size_t i = 0; i < s.supervisors.size(); ++i) {
    if (msg.source != s.supervisors[i].address()) continue;
    // Its actors and snapshots went with it. A node other than 0 whose process the
    // launcher restarts rejoins (its shards' state is on its buddy); otherwise the run
    // exits for a restart from the newest checkpoint.
    const bool rejoinable =
        i > 0 && s.registrar && s.rejoins < s.opts.node_restarts && s.ctx->cfg.rejoin_timeout > 0;
    std::string why = (s.supervisors.size() == 1 ? std::string("the supervisor") : "node " + std::to_string(i)) +
                      " is gone: " + self->system().render(msg.reason);
    if (rejoinable) {
      s.lost[int(i)] = s.supervisors[i];
      ++s.rejoins;
    } else {
      s.node_lost = true;
    }
    // A lost node whose buddy (the next node) is lost too: its shards' copies are gone.
    const int n = int(s.supervisors.size());
    for (const auto& [j, gone] : s.lost)
      if (s.lost.count((j + 1) % n)) {
        s.node_lost = true;
        why += " (node " + std::to_string(j) + " and node " + std::to_string((j + 1) % n) + ", which kept node " +
               std::to_string(j) + "'s optimizer shard copies, are both lost)";
        break;
      }
    return fail(self, why, true, /*new_round=*/true);  // an in-place retry under way cannot finish
  }
}

/// A shard's part of the gradient norm: with every part, the clip factor to every shard
/// (none, and the update skipped, for a norm that is not finite).
void on_grad_norm_partial(self_ptr self, const grad_norm_partial& msg) {
  auto& s = self->state;
  if (msg.step != s.step) return;
  const auto i = partial_index(*s.ctx, msg.virtual_stage, msg.rank);
  if (!first_report(s.seen_partials, i, "grad-norm partial", s.step)) return;
  s.partials.at(i) = msg.sq_norm;
  s.last_progress_us = s.ctx->now_us();
  if (++s.n_partials < s.ctx->n_virtual * s.ctx->pipes) return;
  double sq = 0;
  for (double x : s.partials) sq += x;  // (virtual stage, tp rank, rank) order, as the reference
  s.stats.grad_norm = std::sqrt(sq);
  // NaN/inf gradients (a NaN or inf loss): skip this step's update, as Megatron's
  // loss scaler does, up to max_skipped_steps; the shards keep their state.
  s.skipping = !std::isfinite(sq);
  if (s.skipping) {
    ++s.skipped;
    spdlog::warn("step {}: gradient norm is {}: update skipped ({} skipped, at most {})", s.step + 1, std::sqrt(sq),
                 s.skipped, s.ctx->cfg.max_skipped_steps);
    if (s.skipped > s.ctx->cfg.max_skipped_steps)
      return fail(self, "gradients not finite in " + std::to_string(s.skipped) + " steps (max_skipped_steps " +
                            std::to_string(s.ctx->cfg.max_skipped_steps) + ")",
                  false);
  }
  const double factor = s.skipping ? 0.0 : s.ctx->cfg.clip > 0 ? clip_factor(sq, s.ctx->cfg.clip) : 1.0;
  s.sent_clip = true;
  const clip_factor_msg clip{s.step, factor, s.skipping};
  for (const auto& sup : s.supervisors) self->send(sup, clip);  // (each to its node's shards)
  s.step_messages_out += std::int64_t(s.supervisors.size());
}

/// A stage finished its ops of the step: its peak, load-balancing loss, expert counts and
/// trace events.
void on_stage_done(self_ptr self, stage_done& msg) {
  auto& s = self->state;
  if (msg.step != s.step) return;
  if (!first_report(s.seen_stages, std::size_t(msg.replica) * s.ctx->p + msg.stage, "stage-done report", s.step))
    return;
  s.peaks.at(std::size_t(msg.replica) * s.ctx->p + msg.stage) = msg.peak_in_flight;
  s.stats.aux_loss += msg.aux_loss;
  // Per expert layer: its block, E counts, the pairs dropped.
  const std::size_t n = std::size_t(s.ctx->spec.decoder.n_experts) + 1;
  for (std::size_t i = 0; n > 1 && i + n + 1 <= msg.expert_tokens.size(); i += n + 1)
    add_expert_counts(s.stats.expert_tokens,
                      {{int(msg.expert_tokens[i]), std::vector<std::int64_t>(msg.expert_tokens.begin() + std::ptrdiff_t(i) + 1,
                                                                             msg.expert_tokens.begin() + std::ptrdiff_t(i + 1 + n))}});
  s.last_progress_us = s.ctx->now_us();
  s.events.insert(s.events.end(), msg.events.begin(), msg.events.end());
  ++s.n_stages;
  maybe_commit(self);
}

coordinator_actor::behavior_type coordinator_behavior(self_ptr self, std::shared_ptr<const runtime_context> ctx,
                                                      std::shared_ptr<job_wiring> wiring, actor_run_options opts,
                                                      std::shared_ptr<actor_run_result> result,
                                                      std::vector<supervisor_actor> supervisors,
                                                      registrar_actor registrar) {
  auto& st = self->state;
  st.registrar = std::move(registrar);
  st.ctx = ctx;
  st.wiring = wiring;
  st.opts = opts;
  if (ctx->simulated) st.opts.final_state = false;  // (no parameters to gather)
  st.result = result;
  st.lrs = {ctx->cfg.lr, ctx->cfg.min_lr, ctx->cfg.warmup};
  open_metrics(self);
  st.profile_request = parse_kernel_profile(ctx->launch.kernel_profile);  // checked before the run (check_kernel_profile)
  if (st.profile_request && kernel_profile::available()) st.profile = std::make_shared<kernel_profile>();
  if (st.profile && st.profile_request->last >= ctx->cfg.steps)
    spdlog::warn("TROUPE_KERNEL_PROFILE asks for steps up to {}, but the run has {}: no profile will be written",
                 st.profile_request->last + 1, ctx->cfg.steps);
  wiring->coordinator = caf::actor_cast<coordinator_actor>(self);
  if (supervisors.empty() && ctx->simulated && ctx->cfg.simulated_nodes > 1) {
    // Simulated nodes: a supervisor each, and a registrar that replaces a lost one; as a
    // launcher that restarts lost node processes, once per node the faults kill (and at
    // least once), so that the shards keep buddy copies as they would there.
    auto sim = spawn_simulated_nodes(self->system(), ctx, wiring, self->address());
    supervisors = std::move(sim.supervisors);
    st.registrar = std::move(sim.registrar);
    st.opts.node_restarts = std::max({st.opts.node_restarts, int(ctx->faults.kills.size()), 1});
  }
  if (supervisors.empty())  // one process: this node's supervisor hosts every replica
    supervisors.push_back(spawn_supervisor_actor(self->system(), ctx, wiring, local_node_plan(*ctx)));
  st.supervisors = supervisors;
  for (auto& sup : st.supervisors) self->monitor(sup);  // remote ones: the node's connection
  // An exception out of a handler (a bug, or a file system failing under the run) ends the
  // run with its reason: unanswered, the run request would leave the process hanging.
  self->set_exception_handler([=](caf::scheduled_actor*, std::exception_ptr& eptr) {
    auto err = error_from_exception(eptr);
    finish(self, 1, "the coordinator failed: " + self->system().render(err));
    return err;
  });
  self->set_down_handler([self](const caf::down_msg& msg) { on_node_down(self, msg); });
  return idle(self);
}

caf::typed_response_promise<int> on_run(self_ptr self) {
  auto& s = self->state;
  s.done = self->make_response_promise<int>();
  enter(self, phase::wiring);
  self->delayed_send(self, watchdog_tick, watchdog_atom_v);
  s.step = s.ctx->start_step;
  if (s.step > 0)
    spdlog::info("resumed from {}: continuing with step {}", s.ctx->cfg.resume.empty() ? s.ctx->cfg.load : s.ctx->cfg.resume,
                 s.step + 1);
  auto nodes = std::make_shared<std::vector<node_actors>>();
  request_all<node_actors>(
      self, s.supervisors, std::chrono::seconds(60), [nodes](std::size_t, node_actors& n) { nodes->push_back(n); },
      [self, nodes] { wire_and_start(self, nodes); }, fail_with(self, "a supervisor did not start"), run_atom_v);
  return s.done;
}

void on_step_reports(self_ptr self, step_reports& msg) {
  auto& s = self->state;
  if (msg.step != s.step || msg.attempt != s.attempt) {
    spdlog::debug("coordinator: node {}'s reports of step {} (attempt {}) dropped", msg.node, msg.step + 1,
                  msg.attempt + 1);
    return;
  }
  // Each in turn, as if it had come on its own, while the step runs (one of them may fail
  // it, the last one commits it).
  auto each = [&](auto& list, auto handle) {
    for (auto& x : list) {
      if (s.at != phase::stepping || s.step != msg.step) return;
      handle(self, x);
    }
  };
  each(msg.losses, on_loss_report);
  each(msg.partials, on_grad_norm_partial);
  each(msg.stages, on_stage_done);
  each(msg.shards, on_shard_done);
}

void on_loss_report(self_ptr self, const loss_report& msg) {
  auto& s = self->state;
  if (msg.step != s.step) return;
  const auto i = std::size_t(s.ctx->dp_of(msg.replica)) * s.ctx->m + msg.mb;
  if (!first_report(s.seen_losses, i, "loss report", s.step)) return;
  s.losses.at(i) = msg.loss;
  ++s.n_losses;
  s.last_progress_us = s.ctx->now_us();
  maybe_commit(self);
}

void on_shard_done(self_ptr self, shard_done& msg) {
  auto& s = self->state;
  if (msg.step != s.step) return;
  if (!first_report(s.seen_shards, std::size_t(msg.stage) * s.ctx->pipes + msg.rank, "shard-done report", s.step))
    return;
  s.events.insert(s.events.end(), msg.events.begin(), msg.events.end());
  ++s.n_shards;
  s.last_progress_us = s.ctx->now_us();
  maybe_commit(self);
}

void on_failure(self_ptr self, const runtime_failure& msg) {
  if (msg.generation != self->state.rounds) {  // from actors replaced since
    spdlog::debug("stale failure report dropped: {}: {}", msg.actor, msg.what);
    return;
  }
  fail(self, msg.actor + ": " + msg.what);
}

void on_watchdog(self_ptr self) {
  auto& s = self->state;
  const double idle = (s.ctx->now_us() - s.last_progress_us) * 1e-6;
  const double limit = hang_limit_seconds(s);
  if (take_status_request())
    diagnose(self, false, idle, limit);
  else if (s.at == phase::stepping && !s.diagnosing && s.ctx->cfg.hang_factor > 0 && idle > limit)
    diagnose(self, true, idle, limit);
  self->delayed_send(self, watchdog_tick, watchdog_atom_v);
}

void on_step_timeout(self_ptr self, std::int64_t step, std::int32_t attempt) {
  auto& s = self->state;
  if (step != s.step || attempt != s.attempt) return;
  fail(self, "step did not finish within " + std::to_string(s.ctx->cfg.step_timeout) + " s (losses " +
                 std::to_string(s.n_losses) + "/" + std::to_string(s.ctx->d * s.ctx->m) + ", stages done " +
                 std::to_string(s.n_stages) + "/" + std::to_string(s.ctx->pipes * s.ctx->p) + ", shards done " +
                 std::to_string(s.n_shards) + "/" + std::to_string(s.ctx->p * s.ctx->pipes) + ")");
}

}  // namespace troupe::coordinator

namespace troupe {

coordinator_actor spawn_coordinator_actor(caf::actor_system& sys, std::shared_ptr<const runtime_context> ctx,
                                          std::shared_ptr<job_wiring> wiring, actor_run_options opts,
                                          std::shared_ptr<actor_run_result> result,
                                          std::vector<supervisor_actor> supervisors, registrar_actor registrar) {
  return sys.spawn(coordinator::coordinator_behavior, std::move(ctx), std::move(wiring), std::move(opts), std::move(result),
                   std::move(supervisors), std::move(registrar));
}

}  // namespace troupe
