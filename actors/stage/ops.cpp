// The stage's ops in a step: which runs next, forward, backward and weight passes,
// overlapped pairs, gradient buckets, the tied embedding, parameters (actors/stage/logic.hpp).
#include "actors/stage/logic.hpp"
#include "actors/compute_gate.hpp"
#include "transport/torch_threads.hpp"

namespace troupe::stage_detail {

bool stage_logic::ready(const pipeline_op& op) const {
  const key k{op.mb, op.chunk};
  if (op.kind == op_kind::forward) {
    if (!s_.inputs.count(k)) return false;
    return !s_.is_last_virtual(op.chunk) || s_.targets.count(op.mb);
  }
  if (op.kind == op_kind::weight) return s_.deferred.count(k) && !s_.saved.count(k);
  if (!s_.saved.count(k)) return false;
  return s_.is_last_virtual(op.chunk) || s_.out_grads.count(k);
}

void stage_logic::run_ready(bool weight_turn) {
  if (!s_.running) return;
  if (s_.order) {
    const auto& order = *s_.order;
    while (s_.next_op < order.size()) {
      const auto& op = order[s_.next_op];
      if (op.paired && s_.next_op + 1 < order.size() && overlaps_pairs()) {
        if (!ready(op) || !ready(order[s_.next_op + 1])) break;
        s_.next_op += 2;
        execute_pair(op, order[s_.next_op - 1]);
        continue;
      }
      if (!ready(op)) break;
      ++s_.next_op;
      execute(op);
    }
  } else {
    for (;;) {
      if (auto op = next_dataflow_op()) {
        execute(*op);
      } else if (auto w = next_weight_op(); w && weight_due()) {
        if (!weight_turn) {
          if (!s_.turn_asked) self_->send(self_, run_atom_v);  // a turn after what waits in the mailbox
          s_.turn_asked = true;
          break;
        }
        execute(*w);
        weight_turn = false;
      } else {
        break;
      }
    }
  }
  if (s_.ops_done == s_.total_ops && s_.running) {
    s_.fsdp_pool.clear();  // (FSDP: between steps no buffer holds memory)
    report_losses();
    after_backward();
  }
}

void stage_logic::report_losses() {
  if (s_.ctx->tp_of(s_.replica) != 0) s_.losses.clear();
  if (s_.losses.empty()) return;
  // The step's losses reach the host in one copy (on a GPU one synchronisation, not one
  // per micro-batch).
  std::vector<torch::Tensor> each;
  for (const auto& [mb, loss] : s_.losses) each.push_back(loss.reshape({}));
  const auto values = torch::stack(each).to(torch::kCPU, torch::kFloat64);
  const auto* value = values.data_ptr<double>();
  for (const auto& [mb, loss] : s_.losses) {
    loss_report rep{s_.step, s_.replica, mb, *value++};
    s_.record_sent({stage_state::sent_message::loss, mb});
    if (!report_fault(s_.wiring->supervisor, message_target::loss_report, "loss report", rep))
      self_->send(s_.wiring->supervisor, rep);
  }
  s_.losses.clear();
}

std::chrono::microseconds stage_logic::delay_of(const message_fault& f) {
  return std::chrono::microseconds(std::int64_t(f.delay_seconds * 1e6));
}

std::optional<pipeline_op> stage_logic::next_dataflow_op() const {
  // Backwards first (they free memory), lowest micro-batch first; then forwards if
  // the in-flight bound allows.
  for (const auto& [k, sv] : s_.saved) {
    pipeline_op op{op_kind::backward, k.first, k.second};
    if (ready(op)) return op;
  }
  if (s_.in_flight >= in_flight_bound()) return std::nullopt;
  for (const auto& [k, t] : s_.inputs) {
    pipeline_op op{op_kind::forward, k.first, k.second};
    if (ready(op)) return op;  // inputs leave the buffer when forwarded
  }
  return std::nullopt;
}

bool stage_logic::weight_due() const {
  return s_.in_flight >= in_flight_bound() || s_.forwards_done == s_.ctx->m * s_.ctx->v;
}

std::optional<pipeline_op> stage_logic::next_weight_op() const {
  for (const auto& [k, store] : s_.deferred) {
    pipeline_op op{op_kind::weight, k.first, k.second};
    if (ready(op)) return op;
  }
  return std::nullopt;
}

void stage_logic::inject_op_faults() {
  if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, s_.attempt, throw_point::in_step)) {
    spdlog::warn("fault injected: {} throws in step {} (index {})", s_.name, s_.step + 1, s_.step);
    throw std::runtime_error("injected fault: " + s_.name + " throws in step " + std::to_string(s_.step + 1));
  }
  if (const auto seconds = s_.faults.take_freeze(s_.replica, s_.stage, s_.step, s_.attempt)) {
    spdlog::warn("fault injected: {} blocks its thread for {} s in step {} (index {})", s_.name, *seconds,
                 s_.step + 1, s_.step);
    std::this_thread::sleep_for(std::chrono::duration<double>(*seconds));
  }
}

stage_logic::op_work stage_logic::begin_op(const pipeline_op& op) {
  const auto& ctx = *s_.ctx;
  op_work w;
  w.op = op;
  w.k = {op.mb, op.chunk};
  w.x = s_.virtual_of(op.chunk);
  w.ev = trace_event{op_letter(op.kind), s_.replica, s_.stage, op.mb, op.chunk, s_.step, ctx.now_us(), 0};
  w.gpu_start = s_.gpu_clock ? s_.gpu_clock->mark() : -1;
  w.split = s_.splits(w.k);
  if (op.kind == op_kind::weight) {
    w.store = &s_.deferred[w.k];
  } else if (op.kind == op_kind::forward) {
    w.in = std::move(s_.inputs[w.k]);
    s_.inputs.erase(w.k);
    if (w.x > 0) w.in = w.in.detach().requires_grad_(true);
    if (s_.is_last_virtual(op.chunk)) w.target = s_.targets[op.mb];
    if (const auto p = s_.positions.find(op.mb); p != s_.positions.end()) w.positions = p->second;
    if (w.split) w.store = &s_.deferred[w.k];
  } else {
    w.sv = std::move(s_.saved[w.k]);
    s_.saved.erase(w.k);
    // The chunk's last op: its buckets go to the shard as this backward finishes them
    // (split backwards: after their W's, in chunk_done).
    // (Gradients sharded: each backward's are reduce-scattered as it ends, in compute.)
    if (!w.split && s_.chunk_ops_left.at(op.chunk) == 1 && !ctx.shards_grads()) s_.watches.at(op.chunk)->arm();
    if (!s_.is_last_virtual(op.chunk)) {
      w.grad = std::move(s_.out_grads[w.k]);
      s_.out_grads.erase(w.k);
    }
  }
  return w;
}

void stage_logic::compute(op_work& w) {
  const auto& ctx = *s_.ctx;
  auto& slice = *s_.chunks[w.op.chunk];
  activity_board::op_scope busy(s_.name, s_.wiring->node, s_.generation, s_.step, op_letter(w.op.kind), w.op.mb,
                                w.op.chunk);
  if (w.op.kind == op_kind::forward) s_.computing_forward = w.k;
  if (w.op.kind == op_kind::backward) s_.computing_backward = w.k;
  s_.in_backward = w.op.kind == op_kind::backward;
  sharded_slice* sharded = ctx.shards_grads() ? &s_.sharded.at(std::size_t(w.op.chunk)) : nullptr;
  const bool blocks = sharded && ctx.fsdp_blocks();
  if (sharded) {  // FSDP: the chunk's parameters gathered, its gradient buffers made
    // (The chunk's rest: by chunks its one unit, the chunk; by blocks the blocks come
    // around their forwards and backwards, fsdp_block_hooks. A weight pass's gradients,
    // and a split backward's, stay until the run ends.)
    if (w.op.kind != op_kind::weight) gather_params(slice, *sharded, sharded->rest(), *s_.dp_group, s_.edp_group.get());
    if (w.op.kind == op_kind::backward) make_grads(*sharded, sharded->rest());
    if (w.op.kind == op_kind::weight) make_grads(*sharded);
    prefetch(s_.next_op);  // (the next op's chunk, where it is another one)
  }
  s_.fsdp_split = w.split;
  if (blocks) slice.set_block_hooks(s_.fsdp_hooks.at(std::size_t(w.op.chunk)).get());
  try {
    compute_op(w, slice);
  } catch (...) {
    slice.set_block_hooks(nullptr);
    throw;
  }
  slice.set_block_hooks(nullptr);
  // Released once the stage's next op is on another chunk (or the step's ops end), the
  // gradients accumulated since they were made reduce-scattered into this rank's pieces:
  // a chunk's consecutive ops share one gather and one reduction (one chunk per stage:
  // once a step, ZeRO-1's sums; torchtitan keeps a pipeline stage's parameters so too).
  // By blocks: the rest of the chunk so, and the blocks' gradients that split backwards
  // and weight passes left.
  // (Dataflow, by chunks with one chunk: the run is the step, ended by the chunk's last op.)
  const bool run_goes_on = s_.order ? s_.next_op < s_.order->size() && (*s_.order)[s_.next_op].chunk == w.op.chunk
                                    : s_.chunk_ops_left.at(w.op.chunk) > 1;
  if (sharded && !run_goes_on) {
    release_params(*sharded);
    // Sequence parallelism: the gradients of the parameters every tensor-parallel rank
    // holds whole (norms) are summed over the group before they are reduced, for each run
    // as ZeRO-1 sums them once a step (the tensor-parallel ranks run the same order).
    if (s_.sums_replicated())
      for (auto& u : sharded->units)
        if (storage_held(u.grads)) sum_replicated(s_, slice, &u);
    // The tied embedding's copy: kept out of this reduction, reduced once summed with the
    // other copy's (reduce_tied).
    if (auto* sum = s_.tied_sum(w.op.chunk); sum && grads_held(*sharded, sharded->rest())) {
      torch::NoGradGuard no_grad;
      auto& g = slice.param(ctx.tied_name).mutable_grad();
      sum->add_(g);
      g.zero_();
    }
    reduce_grads(*sharded, *s_.dp_group, s_.edp_group.get());
  }
}

void fsdp_block_hooks::before(int block, bool backward) {
  auto& sh = s_.sharded.at(std::size_t(chunk_));
  const auto u = sh.unit_of(block);
  if (sh.units[u].block != block) return;
  auto& slice = *s_.chunks.at(std::size_t(chunk_));
  gather_params(slice, sh, u, *s_.dp_group, s_.edp_group.get());
  if (backward) make_grads(sh, u);
  // The next block's gather runs while this one computes (forward: the one after it;
  // backward: the one before).
  if (!s_.ctx->cfg.fsdp_prefetch) return;
  const auto next = sh.unit_of(backward ? block - 1 : block + 1);
  if (next != sh.rest()) start_gather(sh, next, *s_.dp_group, s_.edp_group.get(), /*ahead=*/true);
}

void fsdp_block_hooks::after(int block, bool backward) {
  auto& sh = s_.sharded.at(std::size_t(chunk_));
  const auto u = sh.unit_of(block);
  if (sh.units[u].block != block) return;
  release_params(sh, u);
  // Its gradients are in: reduce-scattered now (a split backward's wait for its weight
  // pass, and are reduced when the run ends).
  if (!backward || s_.fsdp_split) return;
  auto& slice = *s_.chunks.at(std::size_t(chunk_));
  if (s_.sums_replicated()) sum_replicated(s_, slice, &sh.units[u]);
  reduce_grads(sh, u, *s_.dp_group, s_.edp_group.get());
}

void stage_logic::prefetch(std::size_t i) {
  const auto& ctx = *s_.ctx;
  if (!ctx.shards_params() || !ctx.cfg.fsdp_prefetch || !s_.order || i >= s_.order->size()) return;
  const auto& op = (*s_.order)[i];
  if (op.kind == op_kind::weight) return;  // (a weight pass needs no parameters)
  // The chunk's rest (by chunks: the chunk); by blocks also the block its op begins with.
  // (Where op i is on the chunk the stage is on, the rest is held and the op gathers its
  // own blocks.)
  if (i > 0 && (*s_.order)[i - 1].chunk == op.chunk) return;
  auto& sh = s_.sharded.at(std::size_t(op.chunk));
  start_gather(sh, sh.rest(), *s_.dp_group, s_.edp_group.get(), /*ahead=*/true);
  if (ctx.fsdp_blocks() && sh.rest() > 0)
    start_gather(sh, op.kind == op_kind::forward ? 0 : sh.rest() - 1, *s_.dp_group, s_.edp_group.get(), true);
}

void stage_logic::compute_op(op_work& w, model_slice& slice) {
  const auto& ctx = *s_.ctx;
  if (w.op.kind == op_kind::weight) {
    w.store->apply();
  } else if (w.op.kind == op_kind::forward) {
    precision_scope amp(ctx.device, ctx.compute_dtype);
    if (w.split) slice.defer_weight_grads(w.store);
    w.out = slice.forward(w.in, w.positions);
    slice.defer_weight_grads(nullptr);
    if (s_.is_last_virtual(w.op.chunk)) w.loss = slice.loss(w.out, w.target);
  } else {
    // Expert parallelism on a GPU: the backward on this thread, not on LibTorch's one
    // autograd thread for the device, where the group's backward all-to-alls would
    // wait for each other (compute/runtime/device.hpp).
    backward_on_this_thread here(s_.backward_here());
    if (s_.is_last_virtual(w.op.chunk))
      w.sv.output.backward();
    else
      torch::autograd::backward({w.sv.output}, {w.grad.to(w.sv.output.scalar_type())});
  }
}

void stage_logic::end_op(op_work& w) {
  const auto& ctx = *s_.ctx;
  const auto& op = w.op;
  if (op.kind == op_kind::weight) {
    s_.deferred.erase(w.k);
    --s_.in_flight;
  } else if (op.kind == op_kind::forward) {
    auto out = std::move(w.out);
    if (s_.is_last_virtual(op.chunk)) {
      auto loss = std::move(w.loss);
      if (s_.faults.nan_loss(s_.step, s_.attempt))  // fault injection
        loss = loss * std::numeric_limits<double>::quiet_NaN();
      s_.targets.erase(op.mb);
      s_.losses.emplace_back(op.mb, loss.detach());  // reported after the last op: no sync now
      out = loss * ctx.loss_weight();
    } else {
      const auto next = s_.owner(w.x + 1);
      // Activations travel in the compute dtype (bf16 jobs: half the bytes, as Megatron's
      // pipeline sends bf16); the receiver widens them to fp32.
      send_tensor(next.stage, next.actor,
                  forward_activation{s_.step, op.mb, next.chunk,
                                     make_payload(out.detach().to(ctx.compute_dtype), ctx.cfg.checksum),
                                     optional_payload(w.positions)},
                  "activation", op.mb, op.chunk);
      deallocate(out);
    }
    // A credit asks the loader for micro-batch mb + ahead: none once that is past the
    // step's last (each credit wakes the loader's thread: docs/performance.md measured about
    // 70 us per micro-batch on the 2-core VM).
    if (w.x == 0 && op.mb + ctx.ahead < ctx.m) {
      s_.record_sent({stage_state::sent_message::credit, op.mb});
      self_->send(s_.wiring->loaders[s_.replica], credit{s_.step, op.mb});
    }
    s_.saved[w.k] = {w.in, out};
    s_.peak_in_flight = std::max(s_.peak_in_flight, ++s_.in_flight);
    ++s_.forwards_done;
  } else {
    if (w.x > 0) {
      const auto prev = s_.owner(w.x - 1);
      send_tensor(prev.stage, prev.actor,
                  backward_grad{s_.step, op.mb, prev.chunk,
                                make_payload(w.sv.input.grad().to(ctx.compute_dtype), ctx.cfg.checksum)},
                  "gradient",
                  op.mb, op.chunk);
    }
    if (!w.split) --s_.in_flight;  // split: the W's inputs stay until it runs
  }
  s_.last_op = op;
  w.ev.end_us = w.computed_us >= 0 ? w.computed_us : ctx.now_us();
  if (w.gpu_start >= 0) s_.gpu_spans.push_back({s_.events.size(), w.gpu_start, s_.gpu_clock->mark()});
  push_event(std::move(w.ev));
  ++s_.ops_done;
  if (--s_.chunk_ops_left.at(op.chunk) == 0) chunk_done(op.chunk);
}

void stage_logic::push_event(trace_event ev) {
  std::lock_guard<std::mutex> lock(s_.events_mutex);
  s_.events.push_back(std::move(ev));
}

void stage_logic::execute(const pipeline_op& op) {
  if (s_.ops_done == 1) inject_op_faults();
  auto w = begin_op(op);
  {
    // A CPU job with more stage actors than cores: the ops take turns. The trace's op
    // starts when it was ready (as without turns, where the kernel slices the cores).
    compute_slot slot;
    compute(w);
  }
  end_op(w);
}

bool stage_logic::overlaps_pairs() const {
  const auto& ctx = *s_.ctx;
  // (Not with FSDP: each op's gathers and reductions run in the data-parallel groups in
  // one order, which two ops at once would not keep.)
  return ctx.cfg.overlap_pairs && s_.ep_size > 1 && s_.tp_size == 1 && ctx.device.is_cpu() &&
         ctx.cfg.recompute == "none" && !ctx.shards_grads();
}

void stage_logic::execute_pair(const pipeline_op& f, const pipeline_op& b) {
  if (s_.ops_done <= 1) inject_op_faults();
  auto wf = begin_op(f), wb = begin_op(b);
  const int threads = s_.ctx->cfg.threads;
  auto forward = std::async(std::launch::async, [this, &wf, threads] {
    if (threads > 0) transport::set_intra_op_threads(threads);
    compute(wf);
    wf.computed_us = s_.ctx->now_us();
  });
  std::exception_ptr failed;
  try {
    compute(wb);
    wb.computed_us = s_.ctx->now_us();
  } catch (...) {
    failed = std::current_exception();
  }
  try {
    forward.get();
  } catch (...) {
    if (!failed) failed = std::current_exception();
  }
  if (failed) std::rethrow_exception(failed);
  end_op(wf);
  end_op(wb);
}

void stage_logic::chunk_done(int chunk) {
  const auto& ctx = *s_.ctx;
  if (ctx.shards_grads()) {  // FSDP: the step's reduced pieces of the chunk's gradients, at once
    if (auto* sum = s_.tied_sum(chunk)) {  // (once the copies' sum is reduced too)
      if (!s_.tied_here()) send_tied(*sum);  // (both copies here: summed once every op ran, after_backward)
      return;
    }
    return send_reduced(chunk);
  }
  s_.watches.at(chunk)->finish();
  if (s_.sums_replicated()) {
    activity_board::op_scope busy(s_.name, s_.wiring->node, s_.generation, s_.step,
                                  "the sum of the replicated parameters' gradients", -1, chunk);
    sum_replicated(s_, *s_.chunks.at(chunk));
    if (!s_.is_tied_chunk(chunk)) send_held(chunk);  // (a tied chunk's wait for the tied sum too)
  }
  if (!s_.is_tied_chunk(chunk)) return;
  if (s_.tied_here()) return;  // both copies here: summed once every op ran (after_backward)
  send_tied(tied_slice().param(ctx.tied_name).mutable_grad());
}

void stage_logic::send_tied(const torch::Tensor& mine) {
  const auto peer = s_.tied_peer();
  send_tensor(peer, s_.wiring->stages[s_.replica][peer],
              tied_grad{s_.step, make_payload(mine.clone(), s_.ctx->cfg.checksum)}, "tied gradient", -1, -1);
  s_.tied_pending = true;
  if (s_.tied_in.defined()) on_tied(std::move(s_.tied_in));
}

void stage_logic::send_reduced(int chunk) {
  s_.record_sent({stage_state::sent_message::bucket, chunk, -1});
  caf::anon_send(s_.wiring->shards[s_.stage][s_.replica],
                 grad_shard{s_.step, chunk, s_.replica, -1, make_payload(s_.sharded.at(chunk).grads)});
}

void stage_logic::reduce_tied(const torch::Tensor& other) {
  const int chunk = s_.tied_chunk();
  auto& sum = *s_.tied_sum(chunk);
  {
    torch::NoGradGuard no_grad;
    sum.add_(other);  // this copy's and the other's, in the order ZeRO-1 adds them
  }
  reduce_tied_chunk(chunk, sum);
  sum.zero_();
}

void stage_logic::reduce_tied_chunk(int chunk, const torch::Tensor& sum) {
  const auto& ctx = *s_.ctx;
  auto& slice = *s_.chunks.at(chunk);
  auto& sh = s_.sharded.at(chunk);
  {
    torch::NoGradGuard no_grad;
    make_grads(sh, sh.rest());  // (zeroed: only the tied embedding's elements are reduced)
    slice.param(ctx.tied_name).mutable_grad().copy_(sum);
  }
  const auto& entries = slice.entries();
  const auto e = std::find_if(entries.begin(), entries.end(), [&](const auto& x) { return x.name == ctx.tied_name; });
  const flat_range range{e->offset, e->offset + e->numel};
  activity_board::op_scope busy(s_.name, s_.wiring->node, s_.generation, s_.step,
                                "the reduction of the tied embedding's gradient", -1, chunk);
  reduce_grads(sh, sh.rest(), *s_.dp_group, s_.edp_group.get(), &range);
  if (s_.ops_done == s_.total_ops) s_.fsdp_pool.clear();  // (between steps no buffer holds memory)
  send_reduced(chunk);
}

void sum_replicated(stage_state& s, model_slice& slice, const fsdp_unit* within) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  const auto in_unit = [within](const param_entry& e) {
    if (!within) return true;
    for (const auto& [begin, end] : within->ranges)
      if (e.offset >= begin && e.offset < end) return true;
    return false;
  };
  for (const auto& e : slice.entries())
    if (s.summed_over_tp(e) && in_unit(e)) grads.push_back(slice.param(e.name).mutable_grad());
  if (grads.empty()) return;
  std::vector<torch::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape({-1}));
  auto sum = torch::cat(flat);
  s.tp_group->all_reduce(sum);
  std::int64_t at = 0;
  for (auto& g : grads) {
    g.copy_(sum.narrow(0, at, g.numel()).view(g.sizes()));
    at += g.numel();
  }
}

void stage_logic::after_backward() {
  s_.running = false;
  const auto& ctx = *s_.ctx;
  if (s_.holds_tied_copy() && s_.tied_here() && ctx.shards_grads()) {  // FSDP: the copies' step sums
    const int a = ctx.place(0).second, b = ctx.place(ctx.n_virtual - 1).second;
    auto &first = *s_.tied_sum(a), &last = *s_.tied_sum(b);
    {
      torch::NoGradGuard g;
      first.add_(last);
      last.copy_(first);
    }
    reduce_tied_chunk(a, first);
    reduce_tied_chunk(b, last);
    first.zero_();
    last.zero_();
    return;
  }
  if (s_.holds_tied_copy() && s_.tied_here()) {  // both copies here: sum locally, as the reference does
    auto& first = s_.chunks.at(ctx.place(0).second)->param(ctx.tied_name).mutable_grad();
    auto& last = s_.chunks.at(ctx.place(ctx.n_virtual - 1).second)->param(ctx.tied_name).mutable_grad();
    {
      torch::NoGradGuard g;
      first.add_(last);
      last.copy_(first);
    }
    for (int c = 0; c < ctx.v; ++c) send_held(c);
  }
}

void stage_logic::on_tied(torch::Tensor other) {
  if (!s_.tied_pending) {  // our own tied chunk is not done yet: keep it for later
    s_.tied_in = std::move(other);
    return;
  }
  if (s_.tied_sum(s_.tied_chunk())) {
    s_.tied_pending = false;
    s_.tied_in = torch::Tensor();
    return reduce_tied(other);
  }
  {
    torch::NoGradGuard g;
    tied_slice().param(s_.ctx->tied_name).mutable_grad().add_(other);
  }
  s_.tied_pending = false;
  s_.tied_in = torch::Tensor();
  send_held(s_.tied_chunk());
}

void stage_logic::bucket_ready(int chunk, int b) {
  if ((s_.tied_bucket.at(chunk).at(b) && s_.is_tied_chunk(chunk)) || s_.replicated_bucket.at(chunk).at(b)) {
    s_.held.at(chunk).push_back(b);
    return;
  }
  send_bucket(chunk, b);
}

void stage_logic::send_held(int chunk) {
  for (int b : s_.held.at(chunk)) send_bucket(chunk, b);
  s_.held.at(chunk).clear();
}

void stage_logic::send_bucket(int chunk, int b) {
  s_.record_sent({stage_state::sent_message::bucket, chunk, b});
  caf::anon_send(s_.wiring->shards[s_.stage][s_.replica],
                 grad_shard{s_.step, chunk, s_.replica, b, make_payload(s_.chunks[chunk]->flat_grads())});
}

void stage_logic::on_params(const param_shard& msg) {
  if (s_.faults.stage_throws(s_.replica, s_.stage, s_.step, s_.attempt, throw_point::after_update)) {
    spdlog::warn("fault injected: {} throws in step {} (index {}) as its updated parameters arrive", s_.name,
                 s_.step + 1, s_.step);
    throw std::runtime_error("injected fault: " + s_.name + " throws after the update in step " +
                             std::to_string(s_.step + 1));
  }
  auto& chunk = *s_.chunks.at(msg.chunk);
  // bf16 jobs: the shards gather their main parameters rounded to bf16. Parameters
  // sharded: the shard's own pieces, which this stage's ops gather from.
  const bool pieces = s_.ctx->shards_params();
  const std::int64_t numel = pieces ? s_.sharded.at(msg.chunk).size() : chunk.flat_params().numel();
  const auto problem = check_payload(msg.data, {numel}, s_.ctx->compute_dtype);
  if (!problem.empty()) throw std::runtime_error(s_.name + ": parameters from the shard: " + problem);
  if (pieces) {
    auto& sh = s_.sharded.at(msg.chunk);
    sh.new_pieces(tensor_of(msg.data));  // (no copy: the shard writes its next update elsewhere)
  } else {
    chunk.set_params(tensor_of(msg.data));
  }
  if (++s_.params_received == s_.ctx->v) {
    // On a GPU the compute ops' spans are when the stream ran them (their kernels were
    // done before the gradients they made were reduced), not when the host launched them.
    for (const auto& g : s_.gpu_spans) {
      s_.events[g.event].start_us = s_.gpu_clock->at_us(g.start);
      s_.events[g.event].end_us = s_.gpu_clock->at_us(g.end);
    }
    s_.record_sent({stage_state::sent_message::done});
    s_.done_reported = true;
    double aux = 0;  // (experts)
    expert_counts routed;
    for (auto& chunk : s_.chunks) {
      aux += chunk->take_aux_loss();
      add_expert_counts(routed, chunk->take_expert_tokens());
    }
    // (A tensor- or context-parallel group's ranks computed the same load-balancing loss,
    // rank 0 reports it; each routed its own part of the sequences.)
    if (s_.ctx->tp_of(s_.replica) != 0 || s_.ctx->cp_of(s_.replica) != 0) aux = 0;
    std::vector<std::int64_t> flat;
    for (const auto& [layer, counts] : routed) {
      flat.push_back(layer);
      flat.insert(flat.end(), counts.begin(), counts.end());
    }
    self_->send(s_.wiring->supervisor, stage_done{s_.step, s_.replica, s_.stage, s_.peak_in_flight,
                                                   std::move(s_.events), aux, std::move(flat)});
  }
}

}  // namespace troupe::stage_detail
