#include "actors/runtime.hpp"

#include "actors/compute_gate.hpp"

#include "actors/checkpoint_writer.hpp"
#include "actors/simulated/simulated.hpp"

#include <cstdlib>
#include <set>
#include <thread>

#include <caf/all.hpp>
#include <torch/torch.h>

#include "actors/coordinator/coordinator.hpp"
#include "actors/intra_op_threads.hpp"
#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/runtime/kernel_profile.hpp"
#include "compute/runtime/device.hpp"
#include "compute/trainer/local_trainer.hpp"
#include "messages/type_ids.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace troupe {

namespace {

/// Gives the C library's free heap pages back to the system: glibc keeps them, and the
/// tensors of a checkpoint read and let go (parameter-sized blocks among the kept ones)
/// would otherwise stay resident for the whole run.
void release_freed_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

runtime_context::runtime_context(const job_config& c, std::shared_ptr<const job_clock> clock_,
                                 const std::optional<std::vector<std::pair<int, int>>>& slots,
                                 const launch_info& launch_)
    : cfg(c),
      spec(c.model()),
      tied_name(tied_parameter(spec)),
      p(c.pipeline),
      d(c.data_parallel * c.context_parallel),
      m(c.microbatches),
      v(c.chunks),
      mbs(c.microbatch_size()),
      ahead(c.credit_window > 0 ? std::min(c.credit_window, c.microbatches) : c.microbatches),
      t(c.tensor_parallel),
      pipes(c.data_parallel * c.context_parallel * c.tensor_parallel),
      sequence_parallel(c.tensor_parallel > 1 && c.sequence_parallel),
      ep(c.expert_parallel),
      edp(c.expert_parallel > 1 ? c.data_parallel * c.context_parallel * c.tensor_parallel / c.expert_parallel : 1),
      n_virtual(c.pipeline * c.chunks),
      dataflow(c.schedule == "dataflow"),
      sched(make_schedule(dataflow ? schedule_kind::one_f_one_b : parse_schedule_kind(c.schedule), p, m, v)),
      split_backward(dataflow ? c.split_backward : sched.split_backward()),
      ranges(partition_layers(spec.n_layers(), p, v, c.split)),
      clock(clock_ ? std::move(clock_) : std::make_shared<const job_clock>(steady_clock_ns())) {
  launch = launch_;
  this->c = cfg.context_parallel;
  try {
    cp_kind = parse_cp_comm(c.context_parallel_comm);
    device = resolve_device(c.device);
    if (this->c > 1 && device.is_cuda())  // (device auto found a GPU: job_config refuses an explicit one)
      throw std::invalid_argument("context_parallel " + std::to_string(this->c) + " on " + device.str() +
                                  ": not yet on GPUs (--device cpu)");
    shard = parse_shard_level(c.shard);
    g = c.shard_group > 0 ? c.shard_group : d;
    eg = ep > 1 ? g * t / ep : 1;
    if (g < d && device.is_cuda())  // (device auto found a GPU: job_config refuses an explicit one)
      throw std::invalid_argument("shard_group " + std::to_string(g) + " (hybrid sharding) on " + device.str() +
                                  ": not yet on GPUs (--device cpu)");
    if (shards_grads() && device.is_cuda())  // (device auto found a GPU: job_config refuses an explicit one)
      throw std::invalid_argument(std::string("shard ") + c.shard + " on " + device.str() +
                                  ": not yet on GPUs (--device cpu)");
    compute_dtype = parse_precision(c.precision);
    residual_dtype = c.fp32_residual || spec.type != model_spec::kind::decoder ? torch::kFloat32 : compute_dtype;
    use_deterministic_algorithms(c.deterministic);  // before this process's first matrix product
  } catch (const std::invalid_argument& e) {
    throw config_error(std::string("invalid configuration: ") + e.what());
  }
  // A root or "auto" becomes its step folder; a restart's choice (launch.resume_auto) is
  // the caller's, made once (run_actor_training, node 0 for every node).
  resolve_resume(cfg, false);
  if (launch.attempt == cfg.fault_attempt) faults = fault_plan::parse(cfg.faults());
  if (cfg.compute == "simulated") {  // no parameters anywhere: the stages and shards model their ops
    simulated = make_simulated_costs(cfg, spec);
    return;
  }
  if (!cfg.resume.empty()) {
    std::function<bool(const std::string&)> keep;
    if (slots) keep = [mine = parameters_of(*slots)](const std::string& name) { return mine.count(name) > 0; };
    auto ckpt = read_checkpoint_dir(cfg.resume, cfg, keep);  // checks the whole model
    init = std::move(ckpt.model);
    resume_optim = std::move(ckpt.optim);
    start_step = ckpt.step;
  } else if (!c.load.empty()) {
    auto ckpt = read_checkpoint(c.load, spec, c.steps);
    init = std::move(ckpt.model);
    resume_optim = std::move(ckpt.optim);
    start_step = ckpt.step;
  } else {
    init = c.initial_weights().empty() ? initial_state(spec, c.seed) : read_initial_weights(c.initial_weights(), spec);
  }
  if (cfg.resume.empty()) check_state(spec, init);
  if (slots) keep_only(*slots);
  resume_shards_left_ = slots ? int(slots->size()) : p * pipes;
  init_users_left_ = 2 * resume_shards_left_;  // a stage and a shard per slot
  release_freed_memory();  // of what was read and not kept
}

void runtime_context::with_resume_moments(
    const std::function<void(const std::map<std::string, torch::Tensor>&)>& restore) const {
  std::lock_guard<std::mutex> lock(resume_mutex_);
  restore(resume_optim);
  if (--resume_shards_left_ <= 0 && !resume_optim.empty()) {
    resume_optim.clear();
    release_freed_memory();
  }
}

state_dict runtime_context::take_init() const {
  std::lock_guard<std::mutex> lock(init_mutex_);
  auto out = init;
  if (!init_released_ && --init_users_left_ <= 0 && !init.empty()) {
    // Shapes only: the values live on in `out` (and the other takers' copies) until
    // their actors have laid them out, then nowhere but in the actors.
    for (auto& entry : init) entry.second = torch::empty(entry.second.sizes(), entry.second.options().device(torch::kMeta));
    init_released_ = true;
  }
  return out;
}

std::set<std::string> runtime_context::parameters_of(const std::vector<std::pair<int, int>>& slots) const {
  std::set<std::string> names;
  for (const auto& slot : slots)
    for (int c = 0; c < v; ++c)
      for (auto& name : slice_parameter_names(spec, ranges.at(virtual_stage(slot.second, c))))
        if (experts_of(slot.first).holds(name, spec.decoder.n_experts)) names.insert(std::move(name));
  return names;
}

void runtime_context::keep_only(const std::vector<std::pair<int, int>>& slots) {
  const auto names = parameters_of(slots);
  state_dict kept;
  for (auto& entry : init)
    if (names.count(entry.first)) kept.push_back(std::move(entry));
  init = std::move(kept);
  for (auto it = resume_optim.begin(); it != resume_optim.end();) {
    const auto dot = it->first.find('.');  // "exp_avg.NAME", "exp_avg_sq.NAME"
    if (dot != std::string::npos && !names.count(it->first.substr(dot + 1)))
      it = resume_optim.erase(it);
    else
      ++it;
  }
}

std::vector<flat_range> runtime_context::buckets_of(const model_slice& slice) const {
  return slice_buckets(slice, groups_of(0, slice), d > 1 || edp > 1 ? cfg.bucket_size : 0, fsdp_blocks());
}

std::vector<std::int64_t> runtime_context::activation_shape(int x, std::int64_t rows) const {
  if (rows < 0) rows = mbs;
  if (spec.type == model_spec::kind::decoder) return {rows, spec.decoder.seq_len / c, spec.decoder.d_model};
  return {rows, spec.mlp_widths.at(ranges.at(x).first)};
}

std::vector<std::int64_t> runtime_context::input_shape(std::int64_t rows) const {
  if (rows < 0) rows = mbs;
  return {rows, spec.type == model_spec::kind::decoder ? spec.decoder.seq_len : spec.mlp_widths.at(0)};
}

torch::ScalarType runtime_context::input_dtype() const {
  return spec.type == model_spec::kind::decoder ? torch::kInt64 : torch::kFloat32;
}

namespace {
std::atomic<int> stop_signal{0};        // lock-free: set from a signal handler
std::atomic<bool> status_signal{false};  // likewise
}  // namespace

void request_stop(int signal) noexcept { stop_signal.store(signal); }
int stop_requested() noexcept { return stop_signal.load(); }
void request_status() noexcept { status_signal.store(true); }
bool take_status_request() noexcept { return status_signal.exchange(false); }

caf::error error_from_exception(std::exception_ptr& eptr) {
  try {
    std::rethrow_exception(eptr);
  } catch (const std::exception& e) {
    return caf::make_error(caf::sec::runtime_error, std::string(e.what()));
  } catch (...) {
    return caf::make_error(caf::sec::runtime_error, std::string("unknown exception"));
  }
}

tensor_payload ship_payload(const job_wiring& w, const tensor_payload& p, int dst_node, const std::string& who) {
  tensor_payload out = p;
  out.local = torch::Tensor();
  out.src_node = w.node;
  out.tag = w.next_tag->fetch_add(1) & 0x7fffffffu;  // below 2^31: the ipc transport's acks use the upper half
  // A tensor of its own for the transfer: the sender may drop or reuse its tensor's data
  // (deallocate_output_tensor) while the bytes are still on their way.
  auto work = w.world->send(p.local.detach().view(-1), dst_node, out.tag);
  work->on_complete([coordinator = w.coordinator, who, generation = w.generation](const std::string& err) {
    if (!err.empty()) caf::anon_send(coordinator, runtime_failure{-1, who, "tensor send: " + err, generation});
  });
  return out;
}

void fetch_payload(const job_wiring& w, const tensor_payload& p,
                   std::function<void(tensor_payload, const std::string& error)> done, torch::Device device,
                   bool pinned) {
  tensor_payload in = p;
  in.local = torch::empty(p.shape, torch::TensorOptions()
                                       .dtype(static_cast<torch::ScalarType>(p.dtype))
                                       .device(device)
                                       .pinned_memory(pinned && device.is_cpu()));
  in.src_node = -1;
  auto work = w.world->recv(in.local.view(-1), p.src_node, p.tag);
  work->on_complete([in, done = std::move(done)](const std::string& err) { done(in, err); });
}

namespace {
/// ", cp C" (context parallelism) and ", tp T" (tensor parallelism) of pipeline `pipe`.
std::string tp_suffix(const runtime_context& ctx, int pipe) {
  return (ctx.c > 1 ? ", cp " + std::to_string(ctx.cp_of(pipe)) : "") +
         (ctx.t > 1 ? ", tp " + std::to_string(ctx.tp_of(pipe)) : "");
}
}  // namespace

std::string runtime_context::stage_name(int replica, int stage) const {
  return "stage[replica " + std::to_string(data_of(replica)) + ", stage " + std::to_string(stage) +
         tp_suffix(*this, replica) + "]";
}

std::string runtime_context::shard_name(int stage, int rank) const {
  return "shard[stage " + std::to_string(stage) + ", rank " + std::to_string(data_of(rank)) + tp_suffix(*this, rank) +
         "]";
}

std::string runtime_context::loader_name(int replica) const {
  return "loader[replica " + std::to_string(data_of(replica)) + tp_suffix(*this, replica) + "]";
}

actor_run_result run_actor_training(const job_config& cfg_in, const actor_run_options& opts_in) {
  auto cfg = cfg_in;
  cfg.validate();
  set_compute_slots(
      compute_slots_for(cfg, cfg.pipeline * cfg.data_parallel * cfg.context_parallel * cfg.tensor_parallel, 1));
  if (cfg.threads == 0)  // share the cores between the stage actors
    cfg.threads = std::max(1, int(std::thread::hardware_concurrency()) /
                                  (cfg.pipeline * cfg.data_parallel * cfg.context_parallel * cfg.tensor_parallel));
  auto opts = opts_in;
  if (opts.trace_path.empty()) opts.trace_path = cfg.trace;
  // Only stage actors run LibTorch ops with several intra-op threads; every other thread
  // (this one, the scheduler's) runs them on one. libgomp gives every thread that starts
  // a parallel region a team of its own, and once there are more OpenMP threads than
  // cores it stops spin-waiting between regions, which made each of LibTorch's many small
  // parallel regions pay a futex wake-up (p=1 steps 58 % slower than the plain loop; the
  // scheduler's threads: one_intra_op_thread, intra_op_threads.hpp).
  const int caller_threads = torch::get_num_threads();
  torch::set_num_threads(1);
  struct restore_threads {
    int n;
    ~restore_threads() { torch::set_num_threads(n); }
  } restore{caller_threads};
  training_data::check_available(cfg);  // a clear error now rather than a dead loader later
  check_output_paths(cfg, opts.launch.attempt > 0 ? 30 : 0);  // and rather than losing the run at its end
  check_kernel_profile(opts.launch.kernel_profile);
  resolve_resume(cfg, opts.launch.resume_auto);  // (checkpoint_dir locked by check_output_paths)
  if (report_complete_run(cfg)) return {};
  auto ctx = std::make_shared<const runtime_context>(cfg, nullptr, std::nullopt, opts.launch);
  auto wiring = std::make_shared<job_wiring>();
  auto result = std::make_shared<actor_run_result>();
  {
    caf::actor_system_config acfg;
    acfg.add_message_types<caf::id_block::troupe>();
    // Stage actors compute on threads of their own (detached); the scheduler runs only the
    // light actors. The sharing policy sleeps on a condition variable instead of
    // work-stealing's polling, which would take cores from LibTorch's intra-op threads.
    acfg.set("scheduler.policy", caf::atom("sharing"));
    acfg.set("scheduler.max-threads", std::size_t{2});
    acfg.add_thread_hook<one_intra_op_thread>();
    caf::actor_system sys{acfg};
    if (!opts.quiet)
      spdlog::info("training {}{} for {} steps with actors: {}pipeline {} x data-parallel {}, {} micro-batches of {} ({}), "
                   "{} intra-op thread(s) per stage{}", cfg.model_label(), cfg.data_label(), cfg.steps,
                   cfg.model_parallel_label(), cfg.pipeline, cfg.data_parallel,
                   cfg.microbatches, cfg.microbatch_size(), cfg.schedule_label(), cfg.threads, cfg.compute_note());
    if (ctx->simulated && !opts.quiet) {
      const auto& sim = *ctx->simulated;
      spdlog::info("compute simulated on {} ({} ranks): a step is modelled as {:.4g} s ({:.4g} s of it the pipeline's "
                   "makespan, bubble {:.2f}); every modelled wait times {}; no evaluation",
                   sim.device, ctx->p * ctx->pipes, sim.model.predicted.step_seconds,
                   sim.model.predicted.parts.pipeline, sim.model.predicted.bubble, sim.scale);
    }
    {
      auto coordinator = spawn_coordinator_actor(sys, ctx, wiring, opts, result);
      caf::scoped_actor self{sys};
      // The run's own timeouts bound every step; this wait ends when the coordinator answers.
      self->request(coordinator, caf::infinite, run_atom_v)
          .receive([&](int code) { result->exit_code = code; },
                   [&](caf::error& err) {
                     result->exit_code = 1;
                     if (result->error.empty()) result->error = "coordinator failed: " + sys.render(err);
                   });
    }
    // Every actor has been told to exit; wait until all have terminated (detached stage
    // threads may still finish an op), then break the handle cycles of the wiring so the
    // actor objects (and the detached threads waiting for them) can go.
    sys.await_all_actors_done();
    wiring->clear();
  }
  await_checkpoint_writes(checkpoint_write_seconds);  // one the run abandoned: not left writing
  result->initial_bytes_held = 0;
  for (const auto& [name, t] : ctx->init)
    if (!t.is_meta()) result->initial_bytes_held += t.nbytes();
  return *result;
}

std::int64_t add_shard_moments(std::vector<named_moments>& by_tp, int tp, const shard_moments& state) {
  std::int64_t bytes = 0;
  for (std::size_t i = 0; i < state.names.size(); ++i) {
    // On the host, whatever device the shard computes on: checkpoints and the run's
    // result hold CPU tensors (a GPU run's files load anywhere).
    const auto data = tensor_of(state.tensors[i]).to(torch::kCPU);
    bytes += std::int64_t(data.nbytes());
    add_moment_piece(by_tp.at(expert_of(state.names[i]) >= 0 ? 0 : std::size_t(tp)),
                     {state.names[i], state.offsets[i], state.numels[i], data});
  }
  return bytes;
}

void add_stage_state(std::vector<std::map<std::string, torch::Tensor>>& by_tp, int tp, const state_reply& state) {
  for (std::size_t j = 0; j < state.names.size(); ++j)
    by_tp.at(expert_of(state.names[j]) >= 0 ? 0 : std::size_t(tp))
        .emplace(state.names[j], tensor_of(state.tensors[j]).to(torch::kCPU));
}

}  // namespace troupe
