#include "compute/trainer/local_trainer.hpp"

#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <thread>

#include <nlohmann/json.hpp>

#include "compute/checkpoint/checkpoint.hpp"
#include "compute/checkpoint/checkpoint_dir.hpp"
#include "compute/checkpoint/hf_folder.hpp"
#include "compute/runtime/device.hpp"
#include "compute/runtime/splitmix.hpp"
#include "compute/parallel/tensor_parallel.hpp"
#include "compute/models/tensor_parallel_layout.hpp"

namespace troupe {

// --- local_trainer ---------------------------------------------------------------------

local_trainer::local_trainer(const job_config& cfg, std::optional<state_dict> init, const group_factory& groups)
    : cfg_(cfg),
      spec_(cfg.model()),
      sched_(make_schedule(parse_schedule_kind(cfg.schedule), cfg.pipeline, cfg.microbatches, cfg.chunks)),
      lrs_{cfg.lr, cfg.min_lr, cfg.warmup},
      data_(cfg) {
  cfg_.runtime = "local";  // this is the plain loop, whatever the job asked for
  cfg_.validate();
  if (!init)
    init = cfg.initial_weights().empty() ? initial_state(spec_, cfg.seed) : read_initial_weights(cfg.initial_weights(), spec_);
  check_state(spec_, *init);
  const int d = cfg.data_parallel;
  tp_ = cfg.tensor_parallel;
  ep_ = cfg.expert_parallel;
  if ((tp_ > 1 || ep_ > 1) && !groups)
    throw config_error("tensor_parallel " + std::to_string(tp_) + ", expert_parallel " + std::to_string(ep_) +
                       ": this loop was given no groups to compute in");
  // Expert-parallel groups fold onto the dense layout (Megatron's): EP consecutive ranks
  // q = r T + t (tensor-parallel rank fastest), so a group spans ep_block_ whole replicas.
  ep_block_ = ep_ / std::gcd(ep_, tp_);
  // Each rank holds its group's share of the experts; the ranks holding the same share
  // (the expert-data-parallel group) shard its optimizer state.
  const int edp = d * tp_ / ep_;
  for (int r = 0; r < d; ++r) {
    if (tp_ > 1) groups_.push_back(groups(tp_));
    for (int t = 0; t < tp_; ++t) {
      const int q = r * tp_ + t;
      if (ep_ > 1 && q % ep_ == 0) ep_groups_.push_back(groups(ep_));  // ranks q .. q + ep_ - 1
      const tensor_parallel tp{t, tp_, cfg.sequence_parallel, tp_ > 1 ? groups_.back().at(std::size_t(t)) : nullptr};
      const expert_share share = ep_ > 1 ? expert_share{q % ep_, ep_, edp} : expert_share{};
      replicas_.push_back(std::make_unique<local_pipeline>(spec_, *init, cfg.pipeline, cfg.chunks, cfg.split, d,
                                                           torch::kCPU, tp, share));
      for (int x = 0; x < replicas_.back()->virtual_stages(); ++x) {
        auto& slice = replicas_.back()->slice(x);
        slice.set_recompute(parse_recompute(cfg.recompute));
        if (ep_ > 1) slice.set_expert_parallel({q % ep_, ep_, ep_groups_.back().at(std::size_t(q % ep_))});
      }
    }
  }
  // One distributed optimizer per (virtual stage, tensor-parallel rank) for the dense
  // parameters, sharded over the replicas; one per (virtual stage, expert share) for the
  // experts, sharded over the ranks holding that share.
  const adamw_options opts{cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay};
  auto add_shards = [&](int x, std::vector<int> members, std::int64_t begin, std::int64_t end, bool experts) {
    auto& s = replicas_.at(std::size_t(members.front()))->slice(x);
    const int n = int(members.size());
    for (auto range : shard_ranges(end - begin, n)) {
      range = {begin + range.begin, begin + range.end};
      shards_.push_back({x, members, range, experts,
                         adamw_shard(s.flat_params().narrow(0, range.begin, range.size()),
                                     decay_mask(s.entries(), {range}), opts),
                         norm_mask(s.entries(), {range})});
    }
  };
  for (int x = 0; x < replicas_.front()->virtual_stages(); ++x) {
    for (int t = 0; t < tp_; ++t) {
      std::vector<int> members;
      for (int r = 0; r < d; ++r) members.push_back(r * tp_ + t);
      add_shards(x, members, 0, replica(0, t).slice(x).expert_offset(), false);
    }
    for (int c = 0; ep_ > 1 && c < ep_; ++c) {
      std::vector<int> members;
      for (int q = c; q < d * tp_; q += ep_) members.push_back(q);
      const auto& s = replicas_.at(std::size_t(c))->slice(x);
      if (s.flat_params().numel() > s.expert_offset())
        add_shards(x, members, s.expert_offset(), s.flat_params().numel(), true);
    }
  }
  if (!cfg.load.empty()) load_checkpoint(cfg.load);
}

step_stats local_trainer::step() {
  const auto t0 = std::chrono::steady_clock::now();
  step_stats st;
  st.step = next_step_;
  st.lr = lrs_.at(next_step_, cfg_.steps);
  const int d = cfg_.data_parallel, m = cfg_.microbatches, mbs = cfg_.microbatch_size();
  const double weight = double(mbs) / cfg_.global_batch;  // each micro-batch's share
  // Forward and backward of every replica, in schedule order (each tensor-parallel rank's
  // pipeline, and each rank of an expert-parallel group, on a thread of its own: they
  // meet in the collectives).
  const auto block = std::size_t(ep_block_);
  for (int first = 0; first < d; first += ep_block_) {
    std::vector<std::vector<batch>> mb(block);
    for (int r = first; r < first + ep_block_; ++r)
      for (int k = 0; k < m; ++k) mb[std::size_t(r - first)].push_back(data_.samples(next_step_, r * m * mbs + k * mbs, mbs));
    std::vector<std::vector<double>> losses(block);
    std::vector<double> aux(block, 0.0);
    std::vector<expert_counts> routed(block * std::size_t(tp_));
    together(first, ep_block_, [&](int r, int t) {
      const auto i = std::size_t(r - first);
      auto l = replica(r, t).run_step(sched_, mb[i], weight);
      replica(r, t).sum_tied_grads();
      const double a = replica(r, t).take_aux_loss();
      // (Each rank's tokens' routing: under sequence parallelism its part of the sequences.)
      routed[i * std::size_t(tp_) + std::size_t(t)] = replica(r, t).take_expert_tokens();
      if (t == 0) losses[i] = l, aux[i] = a;  // (every rank computed the same)
    });
    for (const auto& counts : routed) add_expert_counts(st.expert_tokens, counts);
    for (std::size_t i = 0; i < losses.size(); ++i) {
      st.aux_loss += aux[i];
      for (double l : losses[i]) st.loss += l * weight;
      if (cfg_.sequence_parallel) sum_replicated_grads(first + int(i));
    }
  }
  torch::NoGradGuard no_grad;
  // Reduce-scatter: each shard receives the sum over its group of its range (rank order).
  auto range_of = [this](int q, const shard& sh, bool grads) {
    auto& slice = replicas_.at(std::size_t(q))->slice(sh.virtual_stage);
    return (grads ? slice.flat_grads() : slice.flat_params()).narrow(0, sh.range.begin, sh.range.size());
  };
  std::vector<torch::Tensor> reduced(shards_.size());
  double sq_norm = 0;
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    const auto& sh = shards_[i];
    auto sum = range_of(sh.members.front(), sh, true).clone();
    for (std::size_t j = 1; j < sh.members.size(); ++j) sum.add_(range_of(sh.members[j], sh, true));
    sq_norm += partial_sq_norm(sum, sh.norm_mask);
    reduced[i] = sum;
  }
  st.grad_norm = std::sqrt(sq_norm);
  const double scale = cfg_.clip > 0 ? clip_factor(sq_norm, cfg_.clip) : 1.0;
  // Update each shard, then all-gather: every member copies every updated range.
  for (std::size_t i = 0; i < shards_.size(); ++i) {
    auto& sh = shards_[i];
    sh.opt.step(reduced[i], st.lr, scale, torch::get_num_threads());
    for (int q : sh.members) range_of(q, sh, false).copy_(sh.opt.params());
  }
  for (auto& rep : replicas_) rep->zero_grads();
  ++next_step_;
  st.tokens = std::int64_t(cfg_.global_batch) * data_.tokens_per_sample();
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}


void local_trainer::together(int first, int count, const std::function<void(int replica, int tp)>& fn) {
  const int n = count * tp_;
  if (n == 1) return fn(first, 0);
  std::vector<std::exception_ptr> failed(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  // The ranks share this process's intra-op threads (each rank's OpenMP team would
  // otherwise be as large as the whole, and the teams spin against each other).
  const int threads_before = torch::get_num_threads(), each = std::max(1, threads_before / n);
  auto abort_all = [&](const std::string& why) {
    for (int r = first; r < first + count; ++r)
      if (tp_ > 1)
        for (auto& member : groups_.at(std::size_t(r))) member->abort(why);
    if (ep_ > 1)
      for (int q = first * tp_; q < (first + count) * tp_; q += ep_)
        for (auto& member : ep_groups_.at(std::size_t(q / ep_))) member->abort(why);
  };
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      const int r = first + i / tp_, t = i % tp_;
      torch::set_num_threads(each);
      try {
        fn(r, t);
      } catch (const std::exception& e) {
        failed[std::size_t(i)] = std::current_exception();
        abort_all("replica " + std::to_string(r) + (tp_ > 1 ? " tensor-parallel rank " + std::to_string(t) : "") +
                  " failed: " + e.what());
      }
    });
  for (auto& th : threads) th.join();
  torch::set_num_threads(threads_before);
  for (auto& f : failed)  // (the failed rank's own error, or the abort that names it)
    if (f) std::rethrow_exception(f);
}

void local_trainer::sum_replicated_grads(int r) {
  if (tp_ == 1) return;
  torch::NoGradGuard no_grad;
  for (int x = 0; x < replica(r).virtual_stages(); ++x)
    for (const auto& e : replica(r).slice(x).entries()) {
      // (Sharded experts are summed over their expert-data-parallel group instead.)
      if (e.split != tp_split::replicated || (ep_ > 1 && expert_of(e.name) >= 0)) continue;
      auto sum = replica(r, 0).slice(x).param(e.name).grad().clone();
      for (int t = 1; t < tp_; ++t) sum.add_(replica(r, t).slice(x).param(e.name).grad());
      for (int t = 0; t < tp_; ++t) replica(r, t).slice(x).param(e.name).mutable_grad().copy_(sum);
    }
}

evaluation local_trainer::evaluate() {
  const auto set = data_.evaluation_set();
  // Every rank of replica 0's groups takes part (an expert-parallel group's replicas each
  // evaluate the same set: their experts serve each other's tokens); replica 0's rank 0
  // reports.
  std::vector<evaluation> by_rank(static_cast<std::size_t>(tp_ * ep_block_));
  together(0, ep_block_, [&](int r, int t) {
    by_rank[std::size_t(r * tp_ + t)] = evaluate_model(replica(r, t), set, spec_.type == model_spec::kind::decoder,
                                                       r == 0 && t == 0 ? next_step_ : 0, cfg_.eval_tokens);
  });
  return by_rank.front();
}


state_dict local_trainer::state() const {
  if (tp_ == 1 && ep_ == 1) return replicas_[0]->state();
  // The dense parameters from replica 0's tensor-parallel ranks (q = t), each expert from
  // a rank holding it (ranks q < EP hold every share once).
  std::vector<std::map<std::string, torch::Tensor>> parts(static_cast<std::size_t>(std::max(tp_, ep_)));
  for (std::size_t q = 0; q < parts.size(); ++q) {
    const auto s = replicas_.at(q)->state();
    parts[q] = {s.begin(), s.end()};
  }
  state_dict out;
  const auto rows = rows_by_name(spec_, tp_);
  for (const auto& name : parameter_names(spec_)) {
    if (ep_ > 1 && expert_of(name) >= 0) {
      for (const auto& part : parts)
        if (part.count(name)) {
          out.emplace_back(name, part.at(name));
          break;
        }
      continue;
    }
    std::vector<torch::Tensor> each;
    for (int t = 0; t < tp_; ++t) each.push_back(parts[std::size_t(t)].at(name));
    const auto row = rows.find(name);
    out.emplace_back(name, unshard_parameter(row == rows.end() ? param_spec{}.split : row->second.split, each));
  }
  return out;
}

state_dict local_trainer::optimizer_state() const {
  // The dense moments by tensor-parallel rank, the experts' (whole on every rank) apart.
  std::vector<named_moments> by_rank(static_cast<std::size_t>(tp_));
  named_moments experts;
  for (const auto& sh : shards_)
    gather_moments(replicas_.at(std::size_t(sh.members.front()))->slice(sh.virtual_stage).entries(), {sh.range},
                   sh.opt, sh.experts ? experts : by_rank[std::size_t(sh.tp(tp_))]);
  const auto model = state();
  auto whole = tp_ == 1 ? by_rank.front() : unshard_moments(spec_, model, by_rank);
  whole.exp_avg.insert(experts.exp_avg.begin(), experts.exp_avg.end());
  whole.exp_avg_sq.insert(experts.exp_avg_sq.begin(), experts.exp_avg_sq.end());
  return optimizer_state_dict(whole, model, next_step_);
}

void local_trainer::save_checkpoint(const std::string& path) const {
  save_state_dict_pair(path, state(), optimizer_state(), next_step_, saved_model_toml(cfg_));
}

void local_trainer::load_checkpoint(const std::string& path) {
  const auto ckpt = read_checkpoint(path, spec_, cfg_.steps);
  // Each tensor-parallel rank's parts of the parameters and moments (whole in the files).
  std::vector<std::map<std::string, torch::Tensor>> params, optim;
  for (int t = 0; t < tp_; ++t) {
    params.push_back(shard_by_name(spec_, ckpt.params, ckpt.params, tp_, t));
    optim.push_back(shard_by_name(spec_, ckpt.params, ckpt.optim, tp_, t));
  }
  for (auto& sh : shards_) {
    const auto t = std::size_t(sh.tp(tp_));  // (experts are whole on every rank)
    try {
      restore_shard(replicas_.at(std::size_t(sh.members.front()))->slice(sh.virtual_stage).entries(), {sh.range},
                    sh.opt, params[t], optim[t], ckpt.step);
    } catch (const std::runtime_error& e) {
      throw checkpoint_error("optimizer checkpoint " + path + ".optim: " + e.what());
    }
    torch::NoGradGuard no_grad;
    for (int q : sh.members)
      replicas_.at(std::size_t(q))->slice(sh.virtual_stage).flat_params().narrow(0, sh.range.begin, sh.range.size())
          .copy_(sh.opt.params());
  }
  next_step_ = int(ckpt.step);
}

// --- the training loop -------------------------------------------------------------------

int run_training(const job_config& cfg, const std::function<int()>& stop_requested, const group_factory& groups) {
  // LibTorch's own default counts physical cores (1 on a 2-vCPU machine): use them all.
  torch::set_num_threads(cfg.threads > 0 ? cfg.threads : int(std::max(1u, std::thread::hardware_concurrency())));
  try {
    use_deterministic_algorithms(cfg.deterministic);
  } catch (const std::invalid_argument& e) {
    throw config_error(std::string("invalid configuration: ") + e.what());
  }
  spdlog::info("training {}{} for {} steps: {}pipeline {} x data-parallel {}, {} micro-batches of {} ({}), "
               "{} threads on the CPU{}", cfg.model_label(), cfg.data_label(), cfg.steps, cfg.model_parallel_label(),
               cfg.pipeline, cfg.data_parallel, cfg.microbatches, cfg.microbatch_size(), cfg.schedule,
               torch::get_num_threads(), cfg.compute_note());
  check_output_paths(cfg);  // not at the end, after the training
  local_trainer trainer(cfg, std::nullopt, groups);
  if (trainer.next_step() > 0) spdlog::info("resumed from {} at step {}", cfg.load, trainer.next_step());
  std::ofstream metrics;
  if (!cfg.metrics.empty()) {
    // A resumed run (--load) continues the log; a fresh one starts it anew.
    metrics.open(cfg.metrics, trainer.next_step() > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) throw std::runtime_error("cannot open metrics file " + cfg.metrics);
  }
  const bool is_text = cfg.workload != "fmnist-mlp";
  const auto spec = cfg.model();
  double elapsed = 0;
  int timed = 0;
  while (trainer.next_step() < cfg.steps) {
    const auto st = trainer.step();
    if (!std::isfinite(st.loss)) {
      spdlog::error("loss is {} at step {}: stopping (parameters of step {} are not saved)", st.loss, st.step, st.step);
      return 1;
    }
    elapsed += st.seconds;
    ++timed;
    const double tps = st.tokens / st.seconds;
    const double eta = elapsed / timed * (cfg.steps - trainer.next_step());
    std::printf("%s\n", progress_line(st, cfg.steps, eta, is_text).c_str());
    std::fflush(stdout);
    nlohmann::json line{{"step", st.step}, {"loss", st.loss}, {"lr", st.lr}, {"grad_norm", st.grad_norm},
                        {"tokens_per_s", tps}, {"step_seconds", st.seconds}};
    add_expert_metrics(line, st, spec);
    const bool last = trainer.next_step() == cfg.steps;
    const int stop = last || !stop_requested ? 0 : stop_requested();
    if (last || (cfg.eval_interval > 0 && trainer.next_step() % cfg.eval_interval == 0))
      for (const auto& [key, value] : trainer.evaluate().fields()) line[key] = value;
    if (metrics.is_open()) metrics << line.dump() << '\n' << std::flush;
    if (!cfg.save.empty() &&
        (last || stop || (cfg.checkpoint_interval > 0 && trainer.next_step() % cfg.checkpoint_interval == 0))) {
      try {
        trainer.save_checkpoint(cfg.save);
        spdlog::info("step {}: checkpoint written to {} (and {}.optim)", trainer.next_step(), cfg.save, cfg.save);
      } catch (const std::exception& e) {
        if (last || stop)  // the run's result: exit 1 with the reason (no bad input: a failure)
          throw std::runtime_error(std::string(e.what()) +
                                   (dynamic_cast<const mixed_pair_error*>(&e)
                                        ? std::string()
                                        : "; " + cfg.save + " and " + cfg.save + ".optim are as they were") +
                                   ": the run's final weights are not saved");
        log_checkpoint_not_written(trainer.next_step(), e.what(), cfg.checkpoint_interval);
      }
    }
    if (stop) {
      spdlog::warn("{}", stopped_text(stop, trainer.next_step(), cfg));
      return exit_stopped;
    }
  }
  spdlog::info("done: {} steps in {}", timed, duration_text(elapsed));
  return 0;
}

}  // namespace troupe
