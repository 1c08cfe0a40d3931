#include "actors/stage/stage.hpp"

#include <signal.h>
#include <unistd.h>

#include "actors/checkpoint_writer.hpp"
#include "actors/stage/logic.hpp"
#include "transport/torch_threads.hpp"

namespace troupe {

using namespace stage_detail;

namespace {

/// A group collective's end, on the trace: on the stage's track inside the op it served.
/// It is told on the thread computing the op (the stage's, an overlapped pair's
/// forward's, or autograd's in a backward while the stage's thread waits for it).
/// `backward`: whether the op is the backward; `prefix`: the tensor-parallel group's
/// events are "tp all-reduce", ...
collective_observer group_observer(stage_state* state, std::function<bool()> backward, std::string prefix = "") {
  return [state, backward, prefix](const char* name, std::int64_t bytes, double seconds) {
    activity_board::leave_collective();
    const double end = state->ctx->now_us();
    const auto k = backward() ? state->computing_backward : state->computing_forward;
    std::lock_guard<std::mutex> lock(state->events_mutex);
    (state->running ? state->events : state->eval_events)
        .push_back({prefix + name, state->replica, state->stage, k.first, k.second, state->step, end - seconds * 1e6,
                    end, bytes});
  };
}

/// The hang diagnosis's view of a thread waiting in one of its group's collectives
/// (activity_board): the group `label`, its members (pipelines `first`, first + stride,
/// ..., `size` of them, of this stage), the call.
collective_entry group_entry(const stage_state& st, std::string label, int first, int size, int stride = 1) {
  group_identity id{std::move(label), {}};
  for (int i = 0; i < size; ++i) id.members.push_back(st.ctx->stage_name(first + i * stride, st.stage));
  auto group = std::make_shared<const group_identity>(std::move(id));
  auto calls = std::make_shared<std::int64_t>(0);
  return [group, calls](const char* name) { activity_board::enter_collective(name, group, (*calls)++); };
}

/// Tensor parallelism (`tensors`: this stage's group, else null): the slices' place.
tensor_parallel join_tensor_group(stage_state& st, const std::shared_ptr<transport::communicator>& tensors) {
  if (!tensors) return {};
  const auto& ctx = *st.ctx;
  if (tensors->size() != ctx.t || tensors->rank() != ctx.tp_of(st.replica))
    throw std::logic_error(st.name + ": tensor-parallel communicator is rank " + std::to_string(tensors->rank()) +
                           " of " + std::to_string(tensors->size()));
  st.tp_size = tensors->size();
  const int dp = ctx.dp_of(st.replica);
  auto* state = &st;
  const auto label = fmt::format("tensor-parallel group of replica {}{}, stage {}", ctx.data_of(st.replica),
                                 ctx.c > 1 ? fmt::format(", cp {}", ctx.cp_of(st.replica)) : "", st.stage);
  st.tp_group = as_collective_group(tensors, nullptr,
                                    group_observer(state, [state] { return state->in_backward; }, "tp "),
                                    group_entry(st, label, dp * ctx.t, ctx.t));
  return {tensors->rank(), tensors->size(), ctx.sequence_parallel, st.tp_group};
}

/// The stage's chunks: bf16 jobs get bf16 parameters (the initial ones rounded, as the
/// all-gather rounds); restarted in place, the parameters before the step being retried
/// (`params`: the shards' fp32 main parameters, which the supervisor gathered in rank
/// order, per region: the dense one's over the data-parallel group, the experts' over
/// theirs; every bucket's pieces go back in place, rounded as the all-gather rounds).
void make_chunks(stage_state& st, const tensor_parallel& tp, const std::vector<torch::Tensor>& params) {
  const auto& ctx = *st.ctx;
  // (The initial parameters' values only for a stage that starts with the job: one made
  // later starts from `params`.)
  const auto init = ctx.take_init();
  if (params.empty() && !init.empty() && init.front().second.is_meta())
    throw std::logic_error(st.name + " made after the job's start without its parameters before the step");
  for (int c = 0; c < ctx.v; ++c) {
    st.chunks.push_back(make_slice(ctx.spec, ctx.ranges[ctx.virtual_stage(st.stage, c)], init, ctx.d, ctx.device,
                                   ctx.compute_dtype, tp, ctx.experts_of(st.replica)));
    auto& chunk = *st.chunks.back();
    chunk.set_recompute(parse_recompute(ctx.cfg.recompute));
    chunk.set_residual_dtype(ctx.residual_dtype);
    // (Experts. Context parallelism: every rank of a group computes the whole sequences'
    // load-balancing loss, whose gradient reaches its own tokens only: not 1/c of it.)
    chunk.set_aux_loss_scale(ctx.loss_weight() * ctx.c);
    if (!params.empty())
      chunk.set_params(from_rank_order(params.at(c), ctx.buckets_of(chunk), ctx.groups_of(st.replica, chunk)));
  }
}

/// Expert parallelism: the chunks compute their share of the experts for the tokens of
/// the group (`experts`: the forwards' all-to-alls, `experts_backward`: the backwards').
void join_expert_groups(stage_state& st, const std::shared_ptr<transport::communicator>& experts,
                        const std::shared_ptr<transport::communicator>& experts_backward) {
  const auto& ctx = *st.ctx;
  const int first = st.replica - experts->rank(), last = first + experts->size() - 1;
  auto label = [&](const char* pass) {
    return fmt::format("expert-parallel group of replicas {}-{}, stage {} ({})", first, last, st.stage, pass);
  };
  auto* state = &st;
  expert_parallel ep{experts->rank(), experts->size(),
                     as_collective_group(experts, nullptr, group_observer(state, [] { return false; }),
                                         group_entry(st, label("forwards"), first, experts->size()),
                                         ctx.launch.all_to_all_delay),
                     as_collective_group(experts_backward, nullptr, group_observer(state, [] { return true; }),
                                         group_entry(st, label("backwards"), first, experts->size()),
                                         ctx.launch.all_to_all_delay)};
  for (auto& chunk : st.chunks) chunk->set_expert_parallel(ep);
  st.ep_size = experts->size();
}

/// An FSDP group of the stage's ops: `comm` (checked to be rank `rank` of `size`), named
/// `what` with the stage actors of pipelines first, first + step, ... as its members (the
/// hang diagnosis's), observed as the stage's other collectives.
std::shared_ptr<collective_group> fsdp_group(stage_state& st, const std::shared_ptr<transport::communicator>& comm,
                                             int size, int rank, std::string what, int first, int step) {
  const auto& ctx = *st.ctx;
  if (!comm || comm->size() != size || comm->rank() != rank)
    throw std::logic_error(st.name + ": " + what + ": no communicator of " + std::to_string(size) +
                           " ranks with its rank " + std::to_string(rank));
  group_identity id{std::move(what), {}};
  for (int r = first; r < ctx.pipes; r += step) id.members.push_back(ctx.stage_name(r, st.stage));
  auto group = std::make_shared<const group_identity>(std::move(id));
  auto calls = std::make_shared<std::int64_t>(0);
  auto* state = &st;
  return as_collective_group(
      comm, nullptr, group_observer(state, [state] { return state->in_backward; }, "fsdp "),
      [group, calls](const char* name) { activity_board::enter_collective(name, group, (*calls)++); });
}

/// Gradients or parameters sharded (parallel.shard): the chunks' FSDP layout (this rank's
/// piece of each gradient bucket, the pieces its shard updates) and the data-parallel
/// group (`shards`: the stage's shards' communicator, which the shards then leave to the
/// stage: their collectives run here, inside the ops). With parameters the chunks'
/// parameter buffers are released until an op gathers them. With expert parallelism the
/// chunks' expert regions are gathered and reduced over `expert_shards` (the shards'
/// expert-data-parallel communicator, rank pipeline / EP) instead.
void join_shard_group(stage_state& st, const std::shared_ptr<transport::communicator>& shards,
                      const std::shared_ptr<transport::communicator>& expert_shards) {
  const auto& ctx = *st.ctx;
  st.dp_group = fsdp_group(st, shards, ctx.g, ctx.dp_of(st.replica) % ctx.g,
                           fmt::format("data-parallel group of stage {}{}", st.stage,
                                       ctx.t > 1 ? fmt::format(", tensor-parallel rank {}", ctx.tp_of(st.replica)) : ""),
                           ctx.tp_of(st.replica), ctx.t);
  if (ctx.ep > 1)
    st.edp_group = fsdp_group(st, expert_shards, ctx.eg, ctx.expert_shard_rank(st.replica),
                              fmt::format("expert-data-parallel group of stage {}, share {}", st.stage, st.replica % ctx.ep),
                              st.replica % ctx.ep, ctx.ep);
  st.fsdp_tied.assign(st.chunks.size(), torch::Tensor());
  for (int c = 0; c < int(st.chunks.size()); ++c)  // (the chunks holding a copy of the tied embedding)
    if (st.is_tied_chunk(c))
      st.fsdp_tied[std::size_t(c)] = torch::zeros(st.chunks[std::size_t(c)]->param(ctx.tied_name).sizes(),
                                                  torch::TensorOptions().dtype(torch::kFloat32).device(ctx.device));
  for (auto& chunk : st.chunks) {
    auto buckets = ctx.buckets_of(*chunk);
    const auto groups = ctx.groups_of(st.replica, *chunk);
    auto layout = bucket_shard(buckets, groups);
    st.sharded.push_back(shard_slice(*chunk, std::move(buckets), std::move(layout), ctx.shards_params(),
                                     &st.fsdp_pool, groups, ctx.fsdp_blocks()));
    if (ctx.fsdp_blocks()) st.fsdp_hooks.push_back(std::make_unique<fsdp_block_hooks>(st, int(st.fsdp_hooks.size())));
  }
}

/// Context parallelism: the chunks compute this rank's tokens of every sequence, their
/// attention meeting the group's (`contexts`: rank cp of the replica's context-parallel
/// group of this stage and tensor-parallel rank). Its collectives are on the trace
/// ("cp ring shift": the time the op waited for a shift that ran beside its compute;
/// "cp all-to-all", ...) and on the activity board, as the tensor-parallel group's.
void join_context_group(stage_state& st, const std::shared_ptr<transport::communicator>& contexts) {
  const auto& ctx = *st.ctx;
  if (contexts->size() != ctx.c || contexts->rank() != ctx.cp_of(st.replica))
    throw std::logic_error(st.name + ": context-parallel communicator is rank " + std::to_string(contexts->rank()) +
                           " of " + std::to_string(contexts->size()));
  st.cp_size = contexts->size();
  auto* state = &st;
  const int first = ctx.data_of(st.replica) * ctx.c * ctx.t + ctx.tp_of(st.replica);  // its cp rank 0
  const auto label = fmt::format("context-parallel group of replica {}{}, stage {}", ctx.data_of(st.replica),
                                 ctx.t > 1 ? fmt::format(", tp {}", ctx.tp_of(st.replica)) : "", st.stage);
  st.cp_group = as_collective_group(contexts, nullptr,
                                    group_observer(state, [state] { return state->in_backward; }, "cp "),
                                    group_entry(st, label, first, ctx.c, ctx.t));
  for (auto& chunk : st.chunks) chunk->set_context_parallel({contexts->rank(), contexts->size(), ctx.cp_kind, st.cp_group});
}

/// A chunk's parameters (shared copies left out) for a checkpoint or the final state.
/// Parameters sharded: zeros of their shapes, the shards' main parameters standing for
/// them (use_main_params), which are the only copy.
state_dict chunk_state(const runtime_context& ctx, const model_slice& c) {
  if (!ctx.shards_params()) return c.state();
  state_dict out;
  for (const auto& e : c.entries())
    if (!e.shared_copy) out.emplace_back(e.name, torch::zeros(e.shape));
  return out;
}

/// Checkpoint folders: replica 0's stages write their own files into the step's
/// temporary folder (no process gathers the whole model): the parameters, and the
/// optimizer state assembled from the stage's shards, whose fp32 main parameters
/// stand for the rounded ones in bf16 jobs. Tensor or expert parallelism: replica 0's
/// rank 0 writes, with the parts of its stage's other ranks (their stage actors' and
/// shards') put together: the files hold whole parameters, as without it. In the
/// background (msg.background, within the snapshot bound): the answer comes once the
/// snapshot is copied, with the handle of the writer that writes it (checkpoint_writer.hpp).
/// (With parameters sharded the coordinator asks the shards instead: each writes its own
/// pieces, optimizer_shard_actor.cpp.)
caf::result<stage_checkpoint> write_stage_checkpoint(stage_self self,
                                                     const write_checkpoint& msg) {
  const auto& ctx = self->state.ctx;
  const auto& wiring = self->state.wiring;
  auto& s = self->state;
  auto rp = self->make_response_promise<stage_checkpoint>();
  // Trace events on this stage's track (step: the one whose checkpoint it is).
  auto gathered = std::make_shared<trace_event>(
      trace_event{"checkpoint gather", s.replica, s.stage, -1, -1, msg.step - 1, ctx->now_us(), 0, 0});
  const int t = ctx->t;
  auto parts = std::make_shared<std::vector<std::map<std::string, torch::Tensor>>>(t);  // by rank: shaped
  auto moments = std::make_shared<std::vector<named_moments>>(t);                       // by rank: flat
  // The stage's parameters in model order (shared copies left out), with their shapes
  // (the experts of other shares: held by pipelines 1 .. EP - 1, shapes unused).
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> names;
  for (auto& c : s.chunks)
    for (const auto& name : slice_parameter_names(ctx->spec, c->range())) {
      const auto& entries = c->entries();
      const auto e = std::find_if(entries.begin(), entries.end(), [&](const auto& x) { return x.name == name; });
      if (e == entries.end() ? expert_of(name) >= 0 : !e->shared_copy)
        names.emplace_back(name, e == entries.end() ? std::vector<std::int64_t>{} : e->shape);
    }
  // bf16 without tensor or expert parallelism: the shards' fp32 main parameters are
  // what is written, so the rounded ones are not copied (use_main_params replaces each).
  const bool from_shards = ctx->compute_dtype != torch::kFloat32 && t == 1 && ctx->ep == 1;
  // The other pipelines holding parts of this stage: replica 0's tensor-parallel
  // ranks, and the pipelines holding the other shares of the experts.
  const int holders = std::max(t, ctx->ep);
  if (!from_shards)
    for (auto& c : s.chunks)
      for (auto& [name, p] : chunk_state(*ctx, *c)) (*parts)[0].emplace(name, std::move(p));
  auto fail_with = [=](const std::string& what) {
    return [=](std::size_t, caf::error& err) mutable {
      rp.deliver(stage_checkpoint{{}, what + ": " + self->system().render(err), {}});
      return false;
    };
  };
  auto write = [=, stage = s.stage, node = wiring->node]() mutable {
    gathered->end_us = ctx->now_us();
    stage_checkpoint out;
    out.events.push_back(*gathered);
    auto now = [ctx] { return ctx->now_us(); };
    stage_files files{msg.folder, stage, {}, {}};
    try {
      named_moments whole;
      if (t == 1) {
        for (const auto& [name, shape] : names)
          files.params.emplace_back(name, from_shards ? torch::zeros({}).expand(shape) : parts->front().at(name));
        whole = std::move(moments->front());
      } else {
        const auto joined = unshard_by_name(ctx->spec, {}, *parts);
        for (const auto& [name, shape] : names) files.params.emplace_back(name, joined.at(name));
        whole = unshard_moments(ctx->spec, files.params, *moments);
      }
      use_main_params(files.params, whole);
      files.optim = optimizer_state_dict(whole, files.params, msg.step);
    } catch (const std::exception& e) {
      out.error = e.what();
      rp.deliver(std::move(out));
      return;
    }
    if (msg.background) {
      // A snapshot in host memory, written while training goes on, if the bound allows.
      const auto bytes = snapshot_bytes(files);
      const auto refused = reserve_snapshot(bytes, ctx->cfg.checkpoint_async_memory);
      if (refused.empty()) {
        auto copied = *gathered;
        copied.name = "checkpoint snapshot";
        copied.start_us = ctx->now_us();
        auto snapshot = copy_snapshot(files);
        files = {};
        copied.end_us = ctx->now_us();
        copied.bytes = bytes;
        out.events.push_back(copied);
        out.snapshot_bytes = bytes;
        out.writer = spawn_checkpoint_writer(self, std::move(snapshot), bytes, *gathered, now,
                                             self->state.faults.write_kill(node, msg.step - 1), node);
        rp.deliver(std::move(out));
        return;
      }
      spdlog::warn("step {}: stage {} writes its checkpoint files before training goes on: {}", msg.step, stage,
                   refused);
    }
    auto written = write_files(files, *gathered, now);
    out.files = std::move(written.files);
    out.error = std::move(written.error);
    out.events.push_back(written.events.front());
    rp.deliver(std::move(out));
  };
  auto fetch_moments = [=, stage = s.stage]() mutable {
    request_all<shard_moments>(
        self, wiring->shards[stage], std::chrono::seconds(60),  // [pipeline]
        [=](std::size_t i, shard_moments& rep) {
          gathered->bytes += add_shard_moments(*moments, ctx->tp_of(int(i)), rep);
        },
        write, fail_with("no optimizer state from a shard"), state_atom_v);
  };
  if (holders == 1) {
    fetch_moments();
    return rp;
  }
  std::vector<stage_actor> peers;  // pipelines 1 .. holders - 1
  for (int q = 1; q < holders; ++q) peers.push_back(wiring->stages[q][s.stage]);
  request_all<state_reply>(
      self, peers, std::chrono::seconds(60),
      [=](std::size_t i, state_reply& rep) { add_stage_state(*parts, ctx->tp_of(int(i) + 1), rep); },
      fetch_moments, fail_with("no parameters from a tensor- or expert-parallel rank"), state_atom_v);
  return rp;
}

stage_actor::behavior_type stage_behavior(stage_self self, std::shared_ptr<const runtime_context> ctx,
                                          std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                                          std::vector<torch::Tensor> params,
                                          std::shared_ptr<transport::communicator> experts,
                                          std::shared_ptr<transport::communicator> experts_backward,
                                          std::shared_ptr<transport::communicator> tensors,
                                          std::shared_ptr<transport::communicator> contexts,
                                          std::shared_ptr<transport::communicator> shards,
                                          std::shared_ptr<transport::communicator> expert_shards) {
  auto& st = self->state;
  st.ctx = ctx;
  st.wiring = wiring;
  st.replica = replica;
  st.stage = stage;
  st.name = ctx->stage_name(replica, stage);
  st.generation = wiring->generation;
  const auto tp = join_tensor_group(st, tensors);
  make_chunks(st, tp, params);
  if (experts) join_expert_groups(st, experts, experts_backward);
  if (contexts) join_context_group(st, contexts);
  if (ctx->shards_grads()) join_shard_group(st, shards, expert_shards);
  if (!ctx->dataflow) st.order = &ctx->sched.ranks[stage];
  if (st.order)
    for (const auto& op : *st.order)
      if (op.split) st.split_keys.insert({op.mb, op.chunk});
  // Ops per chunk: counted in the fixed order, or m F's and B's (and W's) each.
  st.chunk_ops.assign(ctx->v, (ctx->split_backward ? 3 : 2) * ctx->m);
  if (st.order) {
    st.chunk_ops.assign(ctx->v, 0);
    for (const auto& op : *st.order) ++st.chunk_ops.at(op.chunk);
  }
  st.total_ops = std::accumulate(st.chunk_ops.begin(), st.chunk_ops.end(), 0);
  st.faults = fault_injector(ctx->faults);
  // An exception ends the actor with its message as the exit reason (the supervisor
  // reports it to the coordinator, which aborts the step).
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& eptr) { return error_from_exception(eptr); });
  auto logic = std::make_shared<stage_logic>(self);
  // The gradient buckets' watches, made on the actor's own thread once its CUDA stream is
  // current: they hold the parameters' gradient accumulators, which keep the stream
  // current when they were made and accumulate on it.
  auto make_watches = [self, logic, ctx] {
    auto& s = self->state;
    for (int c = 0; c < ctx->v; ++c) {
      auto& slice = *s.chunks[c];
      auto watch = std::make_unique<grad_ready_watch>(slice, ctx->buckets_of(slice),
                                                      [logic, c](int b) { logic->bucket_ready(c, b); });
      std::vector<char> tied(watch->buckets().size(), 0), summed(watch->buckets().size(), 0);
      const auto& entries = slice.entries();
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (entries[i].name == ctx->tied_name)
          for (int b : watch->buckets_holding(i)) tied[b] = 1;
        if (s.sums_replicated() && s.summed_over_tp(entries[i]))
          for (int b : watch->buckets_holding(i)) summed[b] = 1;
      }
      s.tied_bucket.push_back(std::move(tied));
      s.replicated_bucket.push_back(std::move(summed));
      s.held.emplace_back();
      s.watches.push_back(std::move(watch));
    }
  };
  const auto act_shape = [ctx](int x) { return ctx->activation_shape(x); };
  return {
      [=](const begin_step& msg) {
        auto& s = self->state;
        s.attempt = msg.attempt;
        // Every stage of the node sees this begin_step; one of them logs and kills.
        static std::atomic_flag killing = ATOMIC_FLAG_INIT;
        if (s.faults.kills_node(wiring->node, msg.step, msg.attempt) && !killing.test_and_set()) {
          spdlog::warn("fault injected: node {} kills its own process (SIGKILL) as step {} (index {}) begins",
                       wiring->node, msg.step + 1,
                       msg.step);
          spdlog::default_logger()->flush();
          ::kill(::getpid(), SIGKILL);
        }
        if (ctx->cfg.threads > 0) transport::set_intra_op_threads(ctx->cfg.threads);
        if (!s.stream_set) {  // a detached actor: this thread is its own from now on
          use_own_stream(ctx->device);
          s.stream_set = true;
          make_watches();
          if (ctx->device.is_cuda()) s.gpu_clock = std::make_unique<gpu_op_clock>(ctx->device);
        }
        // The stream's last step (its parameters' copy) is done by now: one wait per step.
        if (s.gpu_clock) {
          s.gpu_clock->anchor([&] { return ctx->now_us(); });
          s.gpu_spans.clear();
        }
        s.step = msg.step;
        s.running = true;
        s.next_op = 0;
        s.ops_done = 0;
        s.forwards_done = 0;
        s.chunk_ops_left = s.chunk_ops;
        s.params_received = 0;
        {
          std::lock_guard<std::mutex> lock(s.sent_mutex);
          s.sent.clear();
        }
        s.last_op.reset();
        s.done_reported = false;
        auto stash = std::move(s.stash);
        s.stash.clear();
        for (auto& m : stash) caf::anon_send(caf::actor_cast<caf::actor>(self), std::move(m));  // in order, as they came
        logic->prefetch(0);
        logic->run_ready();
      },
      [=](microbatch_input& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::input, {msg.mb, 0}, "micro-batch input")) return;
        auto& s = self->state;
        const auto problem = check_payload(msg.data, ctx->input_shape(), ctx->input_dtype());
        if (!problem.empty()) return logic->fail("micro-batch input " + std::to_string(msg.mb) + ": " + problem);
        std::string bad;
        auto positions = logic->positions_of(msg.positions, ctx->mbs, bad);
        if (!bad.empty()) return logic->fail("micro-batch input " + std::to_string(msg.mb) + ": " + bad);
        if (positions.defined()) s.positions[msg.mb] = std::move(positions);
        s.inputs[{msg.mb, 0}] = logic->to_device(tensor_of(msg.data));
        logic->run_ready();
      },
      [=](microbatch_target& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::target, {msg.mb, 0}, "micro-batch target")) return;
        self->state.targets[msg.mb] = logic->to_device(tensor_of(msg.data));
        logic->run_ready();
      },
      [=](forward_activation& msg) {
        if (!logic->fetched(msg)) return;
        // An activation entering virtual stage x has the shape of x's input.
        const int x = self->state.virtual_of(msg.chunk);
        logic->receive(self->state.inputs, msg.step, msg.mb, msg.chunk, msg.data, act_shape(x), "activation",
                       &msg.positions);
      },
      [=](backward_grad& msg) {
        if (!logic->fetched(msg)) return;
        // The gradient of x's output has the shape of x + 1's input.
        const int x = self->state.virtual_of(msg.chunk);
        logic->receive(self->state.out_grads, msg.step, msg.mb, msg.chunk, msg.data, act_shape(x + 1), "gradient");
      },
      [=](tied_grad& msg) {
        if (!logic->fetched(msg)) return;
        if (!logic->accept(msg.step) || !logic->first_time(received::tied_gradient, {0, 0}, "tied gradient")) return;
        const auto problem = check_payload(msg.data, logic->tied_slice().param(ctx->tied_name).sizes(), torch::kFloat32);
        if (!problem.empty()) return logic->fail("tied embedding gradient: " + problem);
        auto tied = tensor_of(msg.data).to(ctx->device);
        logic->trace_comm("recv", "tied gradient", -1, -1, ctx->now_us(), payload_bytes(msg.data));
        logic->on_tied(std::move(tied));
      },
      [=](param_shard& msg) {
        if (!logic->accept(msg.step) || !logic->first_time(received::parameters, {msg.chunk, 0}, "parameter buffer")) return;
        logic->on_params(msg);
      },
      [=](eval_activation& msg) {
        if (!logic->fetched(msg)) return;
        logic->on_eval_activation(msg);
      },
      [=](const eval_target& msg) { logic->on_eval_target(msg); },
      [=](eval_atom, std::int64_t) -> std::vector<trace_event> {  // the evaluation is over: its ops
        auto events = std::move(self->state.eval_events);
        self->state.eval_events.clear();
        return events;
      },
      [=](run_atom) {  // dataflow: a W's turn (asked by run_ready)
        self->state.turn_asked = false;
        logic->run_ready(/*weight_turn=*/true);
      },
      [=](run_atom, std::int64_t) {},  // (a simulated stage's op end: not this one's)
      [=](const reset_step&) -> reset_report { return logic->reset(); },
      [=](wait_atom, std::int64_t step) -> wait_report { return logic->waits(step); },
      [=](const abort_step& msg) {
        logic->reset();
        self->state.step = msg.step;
      },
      [=](state_atom) -> state_reply {
        state_reply rep;
        for (auto& c : self->state.chunks)
          for (auto& [name, t] : chunk_state(*ctx, *c)) {
            rep.names.push_back(name);
            rep.tensors.push_back(make_payload(t));
          }
        return rep;
      },
      [=](const write_checkpoint& msg) { return write_stage_checkpoint(self, msg); },
      [=](plant_atom) {  // tests: a stray buffered tensor the next reset must report
        self->state.inputs[{-1, -1}] = torch::zeros({1});
      },
  };
}

}  // namespace

stage_actor spawn_stage_actor(caf::local_actor* supervisor, std::shared_ptr<const runtime_context> ctx,
                             std::shared_ptr<const job_wiring> wiring, int replica, int stage,
                             std::vector<torch::Tensor> params, std::shared_ptr<transport::communicator> experts,
                             std::shared_ptr<transport::communicator> experts_backward,
                             std::shared_ptr<transport::communicator> tensors,
                             std::shared_ptr<transport::communicator> contexts,
                             std::shared_ptr<transport::communicator> shards,
                             std::shared_ptr<transport::communicator> expert_shards) {
  // Detached: a thread of its own, so its LibTorch intra-op thread count is its own
  // and long compute never holds a scheduler thread other actors need.
  return supervisor->spawn<caf::detached + caf::monitored>(stage_behavior, std::move(ctx), std::move(wiring),
                                                          replica, stage, std::move(params), std::move(experts),
                                                          std::move(experts_backward), std::move(tensors),
                                                          std::move(contexts), std::move(shards),
                                                          std::move(expert_shards));
}

}  // namespace troupe
