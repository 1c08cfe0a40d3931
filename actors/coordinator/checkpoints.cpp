#include "actors/coordinator/state.hpp"

#include "actors/request_all.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"
#include "messages/type_ids.hpp"

namespace troupe::coordinator {

void fetch_state(self_ptr self, std::function<void(state_dict)> then) {
  auto& s = self->state;
  const int p = s.ctx->p, t = s.ctx->t;
  // Pipelines 0 .. t - 1 (replica 0's tensor-parallel ranks), stage by stage; with expert
  // parallelism at least 0 .. EP - 1, which hold every share of the experts.
  std::vector<stage_actor> stages;
  for (int q = 0; q < std::max(t, s.ctx->ep); ++q)
    stages.insert(stages.end(), s.wiring->stages[q].begin(), s.wiring->stages[q].end());
  auto parts = std::make_shared<std::vector<std::map<std::string, torch::Tensor>>>(t);
  request_all<state_reply>(
      self, stages, state_timeout,
      [parts, p, t](std::size_t i, state_reply& rep) { add_stage_state(*parts, int(i) / p % t, rep); },
      [self, parts, then] {
        const auto& spec = self->state.ctx->spec;
        const auto by_name = parts->size() == 1 ? parts->front() : unshard_by_name(spec, {}, *parts);
        state_dict full;
        for (const auto& name : parameter_names(spec)) full.emplace_back(name, by_name.at(name));
        if (!self->state.ctx->shards_params()) return then(std::move(full));
        // Parameters sharded: the stages sent placeholders; the shards hold the only copy,
        // in fp32. What the stages compute with is that rounded to the compute dtype (bf16
        // jobs; their final state is the fp32 one: fetch_final_state).
        with_shard_state(self, std::move(full), [self, then](state_dict model, named_moments) {
          const auto dtype = self->state.ctx->compute_dtype;
          if (dtype != torch::kFloat32)
            for (auto& [name, t] : model) t = t.to(dtype).to(torch::kFloat32);
          then(std::move(model));
        });
      },
      fail_with(self, "no parameters from a stage"), state_atom_v);
}

void fetch_moments(self_ptr self, const state_dict& model, std::function<void(named_moments)> then) {
  const auto& ctx = *self->state.ctx;
  auto parts = std::make_shared<std::vector<named_moments>>(ctx.t);
  request_all<shard_moments>(
      self, all_of(self->state.wiring->shards), state_timeout,  // [stage][pipeline]
      [parts, pipes = ctx.pipes, t = ctx.t](std::size_t i, shard_moments& rep) {
        add_shard_moments(*parts, int(i % std::size_t(pipes)) % t, rep);
      },
      [self, parts, model, then] {
        if (parts->size() == 1) return then(std::move(parts->front()));
        then(unshard_moments(self->state.ctx->spec, model, *parts));
      },
      fail_with(self, "no optimizer state from a shard"), state_atom_v);
}

void with_shard_state(self_ptr self, state_dict model, std::function<void(state_dict, named_moments)> then) {
  fetch_moments(self, model, [=](named_moments moments) mutable {
    use_main_params(model, moments);
    then(std::move(model), std::move(moments));
  });
}

void fetch_final_state(self_ptr self, std::function<void(state_dict)> then) {
  fetch_state(self, [=](state_dict model) {
    if (self->state.ctx->compute_dtype == torch::kFloat32) return then(std::move(model));
    with_shard_state(self, std::move(model), [=](state_dict model, named_moments) { then(std::move(model)); });
  });
}

bool checkpoint_failed(self_ptr self, std::int64_t next, const std::string& what, bool final) {
  auto& s = self->state;
  if (final) {
    fail(self, "cannot write the checkpoint of step " + std::to_string(next) + " (the run's last): " + what, false);
    return false;
  }
  log_checkpoint_not_written(next, what, s.ctx->cfg.checkpoint_interval);
  ++s.checkpoint_failures;
  return true;
}

bool save_file(self_ptr self, const state_dict& model, const named_moments& moments, bool final) {
  auto& s = self->state;
  const auto& cfg = s.ctx->cfg;
  const auto next = s.step + 1;
  try {
    save_state_dict_pair(cfg.save, model, optimizer_state_dict(moments, model, next), next, saved_model_toml(cfg));
    s.saved_step = next;
    spdlog::info("step {}: checkpoint written to {} (and {}.optim)", next, cfg.save, cfg.save);
    return true;
  } catch (const std::exception& e) {
    if (!final) return checkpoint_failed(self, next, e.what(), final);
    // The run's last: the checkpoint folder (if the job has one) is still written, and the
    // run then fails, saying where its weights are (save_failure_text).
    s.save_failure = "cannot write --save " + cfg.save + " at step " + std::to_string(next) + " (the run's last): " +
                     e.what();
    if (!dynamic_cast<const mixed_pair_error*>(&e))
      s.save_failure += "; " + cfg.save + " and " + cfg.save + ".optim are as " +
                        (s.saved_step >= 0 ? "this run wrote them at step " + std::to_string(s.saved_step)
                                           : std::string("they were before this run"));
    spdlog::error("{}", s.save_failure);
    return true;
  }
}

std::string save_failure_text(const coordinator_state& s) {
  return s.save_failure + "; the run's final weights are " +
         (s.last_folder.empty() ? std::string("not saved (the job has no checkpoint_dir)")
                                : "in checkpoint folder " + s.last_folder);
}

void write_folder(self_ptr self, bool final, std::function<void()> then) {
  auto& s = self->state;
  const auto& cfg = s.ctx->cfg;
  const auto next = s.step + 1;
  if (s.pending) {  // at most one in flight: this one waits for it
    spdlog::info("step {}: the checkpoint of step {} is still being written; this one waits for it", next,
                 s.pending->step);
    s.pending->waiting.push_back([=] { write_folder(self, final, then); });
    return;
  }
  const double t0 = s.ctx->now_us();
  std::string tmp;
  try {
    tmp = begin_checkpoint_dir(cfg.checkpoint_dir, next);
  } catch (const std::exception& e) {
    if (checkpoint_failed(self, next, e.what(), final)) then();
    return;
  }
  const bool background = cfg.checkpoint_async && !final;
  // Who writes: replica 0's stages (their files, the optimizer state gathered from their
  // shards), or with parameters sharded every shard (its own pieces: no gather at all).
  const bool by_shards = s.ctx->shards_params();
  const auto shards = by_shards ? all_of(s.wiring->shards) : std::vector<shard_actor>{};  // [stage][pipeline]
  const std::size_t asked = by_shards ? shards.size() : std::size_t(s.ctx->p);
  const char* const noun = by_shards ? "shard" : "stage";
  auto label = [ctx = s.ctx, by_shards](int i) {
    return by_shards ? ctx->shard_name(i / ctx->pipes, i % ctx->pipes) : "stage " + std::to_string(i);
  };
  auto files = std::make_shared<std::vector<checkpoint_file>>();
  auto errors = std::make_shared<std::vector<std::string>>(asked);  // per writer, reported in their order
  auto writers = std::make_shared<std::vector<caf::actor>>();
  auto writer_index = std::make_shared<std::vector<int>>();
  auto snapshot_bytes = std::make_shared<std::int64_t>(0);
  auto add = [self, errors, files, label](int k, stage_checkpoint& rep) {
    if (!rep.error.empty()) (*errors)[k] = label(k) + ": " + rep.error;
    auto& events = self->state.result->events;
    events.insert(events.end(), rep.events.begin(), rep.events.end());
    for (const auto& f : rep.files) files->push_back({f.name, f.stage, f.kind, f.bytes, f.crc32});
  };
  auto no_answer = [self, errors, label](int k, const caf::error& err) {
    (*errors)[k] = label(k) + ": no answer (" + self->system().render(err) + ")";
  };
  // Every part is in (written, or why not): the folder completed, or abandoned. True
  // unless the run failed.
  auto conclude = [=](double waited_us) {
    auto& s = self->state;
    const auto& cfg = s.ctx->cfg;
    if (s.at == phase::finished) {  // ended meanwhile (a node lost)
      abandon_checkpoint_dir(cfg.checkpoint_dir, next);
      return false;
    }
    std::string what;
    for (const auto& e : *errors)
      if (!e.empty()) what += (what.empty() ? "" : "; ") + e;
    try {
      if (!what.empty()) throw checkpoint_error(what);
      const auto where = finish_checkpoint_dir(cfg.checkpoint_dir, cfg, *files, next, cfg.keep_checkpoints);
      s.last_folder = where;
      const double seconds = (s.ctx->now_us() - t0) * 1e-6, waited = waited_us * 1e-6;
      if (writers->empty())
        spdlog::info("step {}: checkpoint written to {} ({} {}(s) wrote their files in {:.2f} s)", next, where,
                     files->size() / (by_shards ? 1 : 2), noun, seconds);
      else {
        spdlog::info("step {}: checkpoint written to {}: durable {:.2f} s after its snapshot (training waited "
                     "{:.2f} s for the snapshot; {} {}(s) wrote in the background)",
                     next, where, seconds, waited, writers->size(), noun);
        s.durable_seconds += seconds;
        ++s.background_checkpoints;
      }
      s.checkpoint_seconds += waited;
      ++s.checkpoints;
    } catch (const std::exception& e) {
      abandon_checkpoint_dir(cfg.checkpoint_dir, next);
      return checkpoint_failed(self, next, e.what(), final);
    }
    return true;
  };
  // The stages' answers are in: written (then `then`), or the snapshots taken (then
  // `then` at once, the folder completed once every writer has answered).
  auto answered = [=] {
    auto& s = self->state;
    const double waited_us = s.ctx->now_us() - t0;
    if (writers->empty()) {
      if (conclude(waited_us)) then();
      return;
    }
    auto pending = std::make_shared<pending_checkpoint>(pending_checkpoint{next, {}, {}});
    s.pending = pending;
    spdlog::info("step {}: checkpoint snapshot taken in {:.2f} s ({:.0f} MiB in host memory); {} {}(s) write it "
                 "while training goes on",
                 next, waited_us * 1e-6, double(*snapshot_bytes) / (1 << 20), writers->size(), noun);
    // Each writer answers once (its files, an error), or ends before it could (monitored:
    // its node lost): the folder is then abandoned.
    auto settled = std::make_shared<std::vector<bool>>(writers->size(), false);
    auto left = std::make_shared<std::size_t>(writers->size());
    auto settle = [=](std::size_t i, const std::function<void()>& record) {
      if ((*settled)[i]) return;
      (*settled)[i] = true;
      record();
      if (--*left > 0) return;
      auto& s = self->state;
      if (s.pending != pending) return;  // abandoned (the run ended)
      s.pending.reset();
      if (!conclude(waited_us)) return;
      for (auto& w : pending->waiting) w();
    };
    pending->on_down = [=](const caf::down_msg& msg) {
      for (std::size_t i = 0; i < writers->size(); ++i) {
        if (msg.source != (*writers)[i].address()) continue;
        settle(i, [&] {
          (*errors)[(*writer_index)[i]] = label((*writer_index)[i]) +
                                          ": its background writer ended before its files were durable (" +
                                          self->system().render(msg.reason) + ")";
        });
        return true;
      }
      return false;
    };
    for (std::size_t i = 0; i < writers->size(); ++i) {
      self->monitor((*writers)[i]);
      const int k = (*writer_index)[i];
      self->request((*writers)[i], checkpoint_write_timeout, durable_atom_v)
          .then([=](stage_checkpoint& rep) { settle(i, [&] { add(k, rep); }); },
                [=](caf::error& err) { settle(i, [&] { no_answer(k, err); }); });
    }
    then();
  };
  auto ask = [&](const auto& to) {
    request_all<stage_checkpoint>(
        self, to, checkpoint_write_timeout,
        [add, writers, writer_index, snapshot_bytes](std::size_t k, stage_checkpoint& rep) {
          add(int(k), rep);
          if (!rep.writer) return;
          writers->push_back(rep.writer);
          writer_index->push_back(int(k));
          *snapshot_bytes += rep.snapshot_bytes;
        },
        answered,
        [no_answer](std::size_t k, caf::error& err) {
          no_answer(int(k), err);
          return true;
        },
        write_checkpoint{tmp, next, background});
  };
  if (by_shards)
    ask(shards);
  else
    ask(s.wiring->stages[0]);
}

void abandon_pending_checkpoint(self_ptr self) {
  auto& s = self->state;
  if (!s.pending) return;
  spdlog::warn("step {}: checkpoint abandoned: the run ends before its background write is durable; the newest "
               "complete checkpoint is {}",
               s.pending->step, s.last_folder.empty() ? std::string("one written before this run, if any") : s.last_folder);
  abandon_checkpoint_dir(s.ctx->cfg.checkpoint_dir, s.pending->step);
  s.pending.reset();
}

}  // namespace troupe::coordinator
