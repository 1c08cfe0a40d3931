#include "compute/trainer.hpp"

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

#include "compute/checkpoint.hpp"
#include "compute/checkpoint_dir.hpp"
#include "compute/hf_folder.hpp"
#include "compute/device.hpp"
#include "compute/splitmix.hpp"
#include "compute/tensor_parallel.hpp"

namespace troupe {

// --- training_data ---------------------------------------------------------------------

namespace {
/// The gpt workloads' corpus: data.text (and data.val_text), else the fortunes corpus.
text_corpus read_corpus(const job_config& cfg) {
  if (cfg.text.empty()) return text_corpus(cfg.fortunes_dir);
  return cfg.val_text.empty() ? text_corpus::read_text(cfg.text) : text_corpus::read_text(cfg.text, cfg.val_text);
}

/// What names a corpus among a process's users: its paths.
std::string corpus_key(const job_config& cfg) {
  return cfg.text.empty() ? "fortunes:" + cfg.fortunes_dir : "text:" + cfg.text + "\nval:" + cfg.val_text;
}

/// read_corpus, once per process while it is in use: the data loaders of a node's
/// replicas and its evaluation share one copy of the bytes (a text of gigabytes is held
/// once, not once per replica).
std::shared_ptr<const text_corpus> shared_corpus(const job_config& cfg) {
  static std::mutex m;
  static std::map<std::string, std::weak_ptr<const text_corpus>> held;
  const std::string key = corpus_key(cfg);
  std::lock_guard<std::mutex> lock(m);
  if (auto corpus = held[key].lock()) return corpus;
  auto corpus = std::make_shared<const text_corpus>(read_corpus(cfg));
  held[key] = corpus;
  return corpus;
}
}  // namespace

/// data.tokenizer and the token streams of data.text (or fortunes) it encodes to.
struct tokenized_text {
  tokenized_text(const job_config& cfg, const text_corpus& text)
      : tok(cfg.tokenizer), tokens(text, training_data::fingerprint(cfg), tok, cfg.cache_dir) {}
  tokenizer tok;
  token_corpus tokens;
};

namespace {

/// tokenized_text, once per process while in use (keyed as shared_corpus is: the text is
/// hashed and the tokenizer loaded only for the first user); the cache file is written by
/// the first process that needs it.
std::shared_ptr<const tokenized_text> shared_tokens(const job_config& cfg, const text_corpus& text) {
  static std::mutex m;
  static std::map<std::string, std::weak_ptr<const tokenized_text>> held;
  const std::string key = corpus_key(cfg) + "\ntokenizer:" + cfg.tokenizer + "\ncache:" + cfg.cache_dir;
  std::lock_guard<std::mutex> lock(m);
  if (auto t = held[key].lock()) return t;
  const auto start = std::chrono::steady_clock::now();
  auto t = std::make_shared<const tokenized_text>(cfg, text);
  if (t->tokens.written_here())
    spdlog::info("encoded {} bytes into {} + {} tokens with {} in {:.1f} s: {}", text.size(), t->tokens.n_train(),
                 t->tokens.n_valid(), t->tok.path(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), t->tokens.cache_file());
  held[key] = t;
  return t;
}

}  // namespace

training_data::training_data(const job_config& cfg, use what) : cfg_(cfg) {
  if (cfg.workload == "fmnist-mlp") {
    images_ = std::make_unique<fashion_mnist>(cfg.fmnist_dir, what != use::evaluation, what != use::training);
    return;
  }
  text_ = shared_corpus(cfg);
  if (!cfg.tokenizer.empty()) tokenized_ = shared_tokens(cfg, *text_);
}

const token_corpus* training_data::tokens() const { return tokenized_ ? &tokenized_->tokens : nullptr; }

void training_data::check_available(const job_config& cfg) {
  if (cfg.workload == "fmnist-mlp") return fashion_mnist::require(cfg.fmnist_dir);
  const auto seq_len = cfg.model().decoder.seq_len;
  if (!cfg.val_text.empty())
    text_corpus::require_sizes(text_corpus::text_files(cfg.text), "text corpus " + cfg.text,
                               text_corpus::text_files(cfg.val_text), "validation text " + cfg.val_text, seq_len);
  else if (!cfg.text.empty())
    text_corpus::require_size(text_corpus::text_files(cfg.text), "text corpus " + cfg.text, seq_len);
  else
    text_corpus::require_size(text_corpus::fortunes_files(cfg.fortunes_dir), "fortunes corpus in " + cfg.fortunes_dir,
                              seq_len, " (install it: apt-get install fortunes)");
}

std::string training_data::fingerprint(const job_config& cfg) {
  check_available(cfg);  // an empty or too short text fails here, not in a data loader
  auto files = cfg.workload == "fmnist-mlp" ? fashion_mnist::files(cfg.fmnist_dir)
               : cfg.text.empty()           ? text_corpus::fortunes_files(cfg.fortunes_dir)
                                            : text_corpus::text_files(cfg.text);
  if (!cfg.val_text.empty()) {  // then the validation text's, in the order they are read
    const auto valid = text_corpus::text_files(cfg.val_text);
    files.insert(files.end(), valid.begin(), valid.end());
  }
  std::uint64_t hash = fnv1a_basis, bytes = 0;  // over the files streamed in order
  std::vector<char> chunk(1 << 20);
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw data_error("cannot read " + file);
    while (in) {
      in.read(chunk.data(), std::streamsize(chunk.size()));
      const auto n = std::size_t(in.gcount());
      hash = fnv1a(chunk.data(), n, hash);
      bytes += n;
    }
    if (in.bad()) throw data_error("cannot read " + file);
  }
  char text[64];
  std::snprintf(text, sizeof text, "%llu bytes, fnv1a %016llx", static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(hash));
  return text;
}

std::string training_data::identity(const job_config& cfg) {
  // The tokenizer too: every node must encode the text the same way.
  return fingerprint(cfg) + (cfg.tokenizer.empty() ? "" : "; tokenizer " + tokenizer_info_of(cfg.tokenizer).fingerprint);
}

batch training_data::samples(int step, int first, int count) {
  const std::int64_t B = cfg_.global_batch;
  if (tokenized_) return tokenized_->tokens.train_batch(cfg_.seed, std::uint64_t(step) * B + first, count, cfg_.model().decoder.seq_len);
  if (text_) return text_->train_batch(cfg_.seed, std::uint64_t(step) * B + first, count, cfg_.model().decoder.seq_len);
  // Fashion-MNIST: step t of epoch e takes positions [B t, B t + B) of e's order.
  const int per_epoch = images_->train_size() / int(B);
  const int epoch = step / per_epoch;
  if (epoch != order_epoch_) {
    order_ = images_->epoch_order(cfg_.seed, epoch);
    order_epoch_ = epoch;
  }
  return images_->train_batch(order_, std::int64_t(step % per_epoch) * B + first, count);
}

batch training_data::evaluation_set() const {
  if (tokenized_) return tokenized_->tokens.validation_batch(cfg_.model().decoder.seq_len, tokenized_->tok);
  return text_ ? text_->validation_batch(cfg_.model().decoder.seq_len) : images_->test_set();
}

std::int64_t training_data::tokens_per_sample() const { return text_ ? cfg_.model().decoder.seq_len : 1; }

// --- local_trainer ---------------------------------------------------------------------

local_trainer::local_trainer(const job_config& cfg, std::optional<state_dict> init, const group_factory& groups)
    : cfg_(cfg),
      spec_(cfg.model()),
      sched_(make_schedule(parse_schedule_kind(cfg.schedule), cfg.pipeline, cfg.microbatches, cfg.chunks)),
      lrs_{cfg.lr, cfg.min_lr, cfg.warmup},
      data_(cfg) {
  cfg_.runtime = "local";  // this is the plain loop, whatever the job asked for
  cfg_.validate();
  if (!init) init = cfg.init.empty() ? initial_state(spec_, cfg.seed) : read_initial_weights(cfg.init, spec_);
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

std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> expert_token_range(const expert_counts& counts) {
  std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> out;
  for (const auto& [layer, c] : counts) {
    if (c.size() < 2) continue;  // (E counts, then the pairs dropped)
    out.first.push_back(*std::min_element(c.begin(), c.end() - 1));
    out.second.push_back(*std::max_element(c.begin(), c.end() - 1));
  }
  return out;
}

std::int64_t expert_pairs_dropped(const expert_counts& counts) {
  std::int64_t dropped = 0;
  for (const auto& [layer, c] : counts)
    if (!c.empty()) dropped += c.back();
  return dropped;
}

void add_expert_metrics(nlohmann::json& line, const step_stats& st, const model_spec& spec) {
  if (spec.type != model_spec::kind::decoder || spec.decoder.n_experts == 0) return;
  line["aux_loss"] = st.aux_loss;
  std::tie(line["expert_tokens_min"], line["expert_tokens_max"]) = expert_token_range(st.expert_tokens);
  if (spec.decoder.moe_capacity_factor > 0) line["expert_dropped"] = expert_pairs_dropped(st.expert_tokens);
}

double evaluation::bits_per_byte() const { return loss / std::log(2.0) / bytes_per_target; }

std::vector<std::pair<std::string, double>> evaluation::fields() const {
  if (text) return {{"val_loss", loss}, {"val_bpb", bits_per_byte()}};
  return {{"test_loss", loss}, {"test_accuracy", accuracy}};
}

std::vector<eval_forward> plan_evaluation(const batch& set, bool text, std::int64_t tokens_per_forward) {
  const std::int64_t rows = set.input.size(0);
  const std::int64_t per =
      text ? std::max<std::int64_t>(1, tokens_per_forward / std::max<std::int64_t>(1, set.input.size(1))) : rows;
  std::vector<eval_forward> plan;
  for (std::int64_t b = 0; b < rows; b += per) plan.push_back({b, std::min(per, rows - b)});
  return plan;
}

eval_score score_evaluation(model_slice& last, const torch::Tensor& output, const torch::Tensor& target, bool text) {
  // The loss is a mean over the rows' tokens (text windows are of one length).
  eval_score s;
  s.weighted = last.loss(output, target).item<double>() * double(target.size(0));
  if (!text) s.correct = last.logits(output).argmax(-1).eq(target).sum().item<double>();
  return s;
}

evaluation combine_evaluation(const std::vector<eval_score>& scores, const batch& set, bool text, int step) {
  const std::int64_t rows = set.input.size(0);
  evaluation e;
  e.text = text;
  e.bytes_per_target = set.bytes_per_target;
  double weighted = 0, correct = 0;
  for (const auto& s : scores) {
    weighted += s.weighted;
    correct += s.correct;
  }
  e.loss = weighted / double(rows);
  e.accuracy = text ? 0 : correct / double(rows);
  if (step > 0) spdlog::info("step {}: {}", step, e.summary());
  return e;
}

std::string evaluation::summary() const {
  if (text) return fmt::format("validation loss {:.4f}, {:.4f} bits per byte", loss, bits_per_byte());
  return fmt::format("test loss {:.4f}, test accuracy {:.2f} %", loss, 100 * accuracy);
}

evaluation evaluate_model(local_pipeline& model, const batch& set, bool text, int step,
                          std::int64_t tokens_per_forward) {
  torch::NoGradGuard no_grad;
  auto& last = model.slice(model.virtual_stages() - 1);
  const auto device = last.flat_params().device();  // fp32, on the model's device
  std::vector<eval_score> scores;
  for (const auto& f : plan_evaluation(set, text, tokens_per_forward)) {
    const auto target = set.target.narrow(0, f.begin, f.rows).to(device);
    scores.push_back(score_evaluation(last, model.forward(set.input.narrow(0, f.begin, f.rows).to(device)), target, text));
  }
  return combine_evaluation(scores, set, text, step);
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
    out.emplace_back(name, unshard_parameter(spec_, name, each));
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
  save_state_dict_pair(path, state(), optimizer_state(), next_step_);
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

state_dict optimizer_state_dict(const named_moments& moments, const state_dict& model, std::int64_t next_step) {
  state_dict out;
  out.emplace_back("step", torch::tensor({next_step}, torch::kInt64));
  for (const auto& [name, p] : model) {
    out.emplace_back("exp_avg." + name, moments.exp_avg.at(name).view(p.sizes()));
    out.emplace_back("exp_avg_sq." + name, moments.exp_avg_sq.at(name).view(p.sizes()));
  }
  return out;
}

checkpoint read_checkpoint(const std::string& path, const model_spec& spec, int total_steps) {
  checkpoint c;
  const auto model_bytes = read_file_bytes(path);
  auto model = load_state_dict(model_bytes, path);
  check_state(spec, model);
  c.model = model;
  c.params = {model.begin(), model.end()};
  const auto optim_bytes = read_file_bytes(path + ".optim");
  const auto optim = load_state_dict(optim_bytes, path + ".optim");
  c.optim = {optim.begin(), optim.end()};
  c.step = c.optim.count("step") ? c.optim.at("step").item<std::int64_t>() : -1;
  if (c.step < 0 || c.step > total_steps)
    throw checkpoint_error("optimizer checkpoint " + path + ".optim has no valid step for a run of " +
                           std::to_string(total_steps) + " steps");
  // The two files of one --save, not a model beside another save's optimizer state (a
  // crash between the two renames; a file copied over one of them).
  const auto model_mark = read_pair_mark(model_bytes), optim_mark = read_pair_mark(optim_bytes);
  auto step_text = [](const pair_mark& m) {
    return m.step < 0 ? std::string("of no --save (no pair mark)") : "of step " + std::to_string(m.step);
  };
  if (!(model_mark == optim_mark))
    throw checkpoint_error("checkpoint " + path + " (" + step_text(model_mark) + ") and " + path + ".optim (" +
                           step_text(optim_mark) +
                           ") are not the two files of one --save: resuming from them would continue another "
                           "run's optimizer state (use the pair one save wrote, a checkpoint folder, or --init " +
                           path + " for its weights alone)");
  if (optim_mark.step >= 0 && optim_mark.step != c.step)
    throw checkpoint_error("optimizer checkpoint " + path + ".optim holds step " + std::to_string(c.step) +
                           " but is marked as step " + std::to_string(optim_mark.step));
  return c;
}

int exit_code_of(const std::exception& e) {
  const bool input = dynamic_cast<const config_error*>(&e) || dynamic_cast<const data_error*>(&e) ||
                     dynamic_cast<const checkpoint_error*>(&e) || dynamic_cast<const model_error*>(&e);
  return input ? exit_bad_input : 1;
}

// --- the training loop -------------------------------------------------------------------

std::string duration_text(double seconds) {
  const auto s = static_cast<long>(std::lround(seconds));
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

std::string progress_line(const step_stats& st, int total_steps, double eta_seconds, bool tokens) {
  // (Experts: the load-balancing loss beside the cross-entropy, and the share of (token,
  // choice) pairs dropped past the experts' capacity where any were.)
  std::string aux = st.aux_loss != 0 ? fmt::format(" | aux_loss {:.4f}", st.aux_loss) : "";
  if (const auto dropped = expert_pairs_dropped(st.expert_tokens); dropped > 0) {
    std::int64_t pairs = 0;
    for (const auto& [layer, c] : st.expert_tokens) pairs += std::accumulate(c.begin(), c.end(), std::int64_t(0));
    aux += fmt::format(" | moe dropped {:.1f} %", 100.0 * double(dropped) / double(pairs));
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "step %*d/%d | loss %.4f%s | lr %.3e | grad_norm %.3f | %.0f %s/s | ETA %s",
                int(std::to_string(total_steps).size()), st.step + 1, total_steps, st.loss, aux.c_str(), st.lr,
                st.grad_norm, st.tokens / st.seconds, tokens ? "tok" : "img", duration_text(eta_seconds).c_str());
  return buf;
}

std::string stopped_text(int signal, int done_steps, const job_config& cfg) {
  std::string saved = "nothing saved (the job has no checkpoint_dir or save)";
  if (!cfg.checkpoint_dir.empty())
    saved = "its checkpoint is in " + cfg.checkpoint_dir + " (continue with --resume " + cfg.checkpoint_dir + ")";
  else if (!cfg.save.empty())
    saved = "its checkpoint is " + cfg.save + " (continue with --load " + cfg.save + ")";
  const std::string by = signal == SIGTERM ? "SIGTERM" : signal == SIGUSR1 ? "SIGUSR1" : "a signal";
  return "stopped by " + by + " after step " + std::to_string(done_steps) + " of " + std::to_string(cfg.steps) + ": " + saved;
}

void log_checkpoint_not_written(std::int64_t step, const std::string& why, int interval) {
  spdlog::error("step {}: checkpoint not written: {}; training goes on (the next checkpoint is due at step {})", step,
                why, step + interval);
}

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
