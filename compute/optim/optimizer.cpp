#include "compute/optim/optimizer.hpp"

#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>

namespace troupe {

namespace {

bool cpu_float(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
}

/// Runs fn(begin, end) over [0, n) split into `threads` contiguous pieces, the first on
/// the calling thread.
template <class F>
void split_range(std::int64_t n, int threads, F fn) {
  threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(threads, n / 65536)));
  std::vector<std::thread> helpers;
  const std::int64_t piece = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t)
    helpers.emplace_back([=] { fn(std::min(n, t * piece), std::min(n, (t + 1) * piece)); });
  fn(0, std::min(n, piece));
  for (auto& h : helpers) h.join();
}

}  // namespace

shard_mask::shard_mask(const torch::Tensor& mask) : numel(mask.numel()) {
  const auto bools = mask.to(torch::kBool).contiguous();
  if (bools.device().is_cpu())
    runs = kernels::decay_runs(bools.data_ptr<bool>(), numel);
  else
    tensor = bools;
}

torch::Tensor shard_mask::expanded() const {
  if (tensor.defined()) return tensor;
  auto out = torch::zeros({numel}, torch::kBool);
  for (const auto& run : runs)
    if (run.decay) out.narrow(0, run.begin, run.end - run.begin).fill_(true);
  return out;
}

adamw_shard::adamw_shard(const torch::Tensor& main_params, const torch::Tensor& decay, adamw_options opts,
                         bool double_buffered)
    : opts_(opts), double_buffered_(double_buffered), decay_(decay) {
  auto& b = banks_[0];
  b.params = main_params.detach().to(torch::kFloat32).clone().contiguous();
  b.exp_avg = torch::zeros_like(b.params);
  b.exp_avg_sq = torch::zeros_like(b.params);
  if (double_buffered_)
    banks_[1] = {torch::empty_like(b.params), torch::empty_like(b.params), torch::empty_like(b.params), 0};
}

void adamw_shard::release_previous() {
  if (!double_buffered_ || prev_ == cur_) return;
  banks_[prev_] = state{};
  prev_ = cur_;
}

void adamw_shard::assign(const state& from) {
  torch::NoGradGuard no_grad;
  auto& c = banks_[cur_];
  c.params.copy_(from.params);
  c.exp_avg.copy_(from.exp_avg);
  c.exp_avg_sq.copy_(from.exp_avg_sq);
  c.steps = from.steps;
  prev_ = cur_;
}

void adamw_shard::step(const torch::Tensor& grad_in, double lr, double grad_scale, int threads) {
  torch::NoGradGuard no_grad;
  const int from = cur_, to = double_buffered_ ? 1 - cur_ : cur_;
  const state& in = banks_[from];
  state& out = banks_[to];
  if (!out.params.defined())  // (released: release_previous)
    out = {torch::empty_like(in.params), torch::empty_like(in.params), torch::empty_like(in.params), 0};
  out.steps = in.steps + 1;
  const double bias_correction1 = 1.0 - std::pow(opts_.beta1, double(out.steps));
  const double bias_correction2 = 1.0 - std::pow(opts_.beta2, double(out.steps));
  const double step_size = lr / bias_correction1;
  const double decay_factor = 1.0 - lr * opts_.weight_decay;
  if (cpu_float(in.params) && cpu_float(grad_in) && !decay_.tensor.defined()) {
    const kernels::adamw_constants k{float(grad_scale),
                                     float(decay_factor),
                                     float(opts_.beta1),
                                     float(1.0 - opts_.beta1),
                                     float(opts_.beta2),
                                     float(1.0 - opts_.beta2),
                                     float(std::sqrt(bias_correction2)),
                                     float(opts_.eps),
                                     float(-step_size)};
    const float *p = in.params.data_ptr<float>(), *m = in.exp_avg.data_ptr<float>(),
                *v = in.exp_avg_sq.data_ptr<float>(), *g = grad_in.data_ptr<float>();
    float *po = out.params.data_ptr<float>(), *mo = out.exp_avg.data_ptr<float>(),
          *vo = out.exp_avg_sq.data_ptr<float>();
    split_range(in.params.numel(), threads, [&](std::int64_t b, std::int64_t e) {
      kernels::adamw(p, m, v, g, decay_.runs, po, mo, vo, b, e, k);
    });
  } else {  // another device: the same update as LibTorch ops
    // Double-buffered, each first op writes the other bank from this one (no copy of the
    // three tensors before updating them in place: a third fewer passes over them).
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(out.params.device());
    auto scale = [&](torch::Tensor& o, const torch::Tensor& i, const torch::Tensor& factor) {
      if (to == from)
        o.mul_(factor);
      else
        torch::mul_out(o, i, factor);
    };
    const torch::Tensor grad = grad_scale == 1.0 ? grad_in : grad_in * grad_scale;
    if (opts_.weight_decay != 0.0)  // decoupled weight decay only where the mask says so
      scale(out.params, in.params,
            torch::where(decay_.expanded().to(out.params.device()), torch::scalar_tensor(decay_factor, f32),
                         torch::scalar_tensor(1.0, f32)));
    else if (to != from)
      out.params.copy_(in.params);
    scale(out.exp_avg, in.exp_avg, torch::scalar_tensor(opts_.beta1, f32));
    out.exp_avg.add_(grad, 1.0 - opts_.beta1);
    scale(out.exp_avg_sq, in.exp_avg_sq, torch::scalar_tensor(opts_.beta2, f32));
    out.exp_avg_sq.addcmul_(grad, grad, 1.0 - opts_.beta2);
    auto denom = (out.exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(opts_.eps);
    out.params.addcdiv_(out.exp_avg, denom, -step_size);
  }
  prev_ = from;
  cur_ = to;
}

double lr_schedule::at(int t, int total) const {
  if (t < warmup) return max_lr * double(t + 1) / double(warmup);
  const double span = std::max(1, total - 1 - warmup);
  return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(M_PI * double(t - warmup) / span));
}

double partial_sq_norm(const torch::Tensor& grad, const torch::Tensor& mask) {
  if (cpu_float(grad) && mask.device().is_cpu() && mask.scalar_type() == torch::kBool && mask.is_contiguous())
    return kernels::masked_sq_norm(grad.data_ptr<float>(), mask.data_ptr<bool>(), grad.numel());
  // Other devices: zeros where the mask is false, then the norm accumulated in fp64 (one
  // pass over the gradient each; masked_select would find the mask's elements with a
  // host round trip, and gather and widen them first).
  const auto kept = torch::where(mask, grad, torch::zeros({}, grad.options()));
  const double n = at::linalg_vector_norm(kept, 2, c10::nullopt, /*keepdim=*/false, torch::kFloat64).item<double>();
  return n * n;
}

double partial_sq_norm(const torch::Tensor& grad, const shard_mask& mask) {
  if (grad.numel() != mask.numel)
    throw std::invalid_argument("a gradient of " + std::to_string(grad.numel()) + " elements with a mask of " +
                                std::to_string(mask.numel));
  if (!mask.tensor.defined() && cpu_float(grad) && grad.is_contiguous())
    return kernels::runs_sq_norm(grad.data_ptr<float>(), mask.runs);
  return partial_sq_norm(grad, mask.expanded().to(grad.device()));
}

double clip_factor(double total_sq_norm, double max_norm) {
  return std::min(1.0, max_norm / (std::sqrt(total_sq_norm) + 1e-6));
}

}  // namespace troupe
