#include "compute/trainer/local_pipeline.hpp"

#include <map>

namespace troupe {

local_pipeline::local_pipeline(const model_spec& spec, const state_dict& init, int stages,
                               int chunks, const std::vector<int>& split, std::int64_t pad_to,
                               torch::Device device, const tensor_parallel& tp, const expert_share& experts)
    : spec_(spec), stages_(stages), chunks_(chunks), experts_(experts) {
  check_state(spec, init);
  for (const auto& range : partition_layers(spec.n_layers(), stages, chunks, split))
    slices_.push_back(make_slice(spec, range, init, pad_to, device, torch::kFloat32, tp, experts));
}

std::vector<double> local_pipeline::run_step(const schedule& sched,
                                             const std::vector<batch>& microbatches,
                                             double loss_weight) {
  const int p = stages_, m = sched.microbatches, n_virtual = virtual_stages();
  if (sched.stages != p || sched.chunks != chunks_)
    throw schedule_error("schedule is for " + std::to_string(sched.stages) + " stages x " +
                         std::to_string(sched.chunks) + " chunks, pipeline has " +
                         std::to_string(p) + " x " + std::to_string(chunks_));
  if (static_cast<int>(microbatches.size()) != m)
    throw schedule_error("schedule has " + std::to_string(m) + " micro-batches, got " +
                         std::to_string(microbatches.size()));
  // Per (virtual stage, micro-batch): the input it received, its output, and the
  // gradient of its output once the next virtual stage has run its backward. Ops run in
  // an order where every input already exists (execution_order checks the schedule).
  const auto at = [m](int x, int mb) { return std::size_t(x) * m + mb; };
  std::vector<torch::Tensor> inputs(std::size_t(n_virtual) * m), outputs(inputs.size()),
      grads(inputs.size());
  // Split backwards: the weight gradients each (virtual stage, micro-batch) left for its W.
  std::vector<weight_grad_store> deferred(sched.split_backward() ? inputs.size() : 0);
  std::vector<char> split(inputs.size(), 0);  // whose backward leaves its W (known at the forward)
  for (int r = 0; r < p; ++r)
    for (const auto& op : sched.ranks[r])
      if (op.split) split[at(sched.virtual_stage(r, op.chunk), op.mb)] = 1;
  std::vector<double> losses(m, 0.0);
  for (auto& s : slices_) s->set_aux_loss_scale(loss_weight);
  for (const auto& [r, index] : execution_order(sched)) {
    const auto& op = sched.ranks[r][index];
    const int x = sched.virtual_stage(r, op.chunk);
    auto& s = *slices_[x];
    const auto i = at(x, op.mb);
    if (op.kind == op_kind::forward) {
      // Receive: a fresh leaf, so this slice's backward stops here and yields the
      // gradient to hand back to the previous slice.
      auto in = x == 0 ? microbatches[op.mb].input : outputs[at(x - 1, op.mb)].detach().requires_grad_(true);
      inputs[i] = in;
      if (split[i]) s.defer_weight_grads(&deferred[i]);
      auto out = s.forward(in, microbatches[op.mb].positions);
      s.defer_weight_grads(nullptr);
      if (x == n_virtual - 1) {
        auto l = s.loss(out, microbatches[op.mb].target);
        losses[op.mb] = l.item<double>();
        out = l * loss_weight;
      }
      outputs[i] = out;
    } else if (op.kind == op_kind::weight) {
      deferred[i].apply();
    } else {
      if (x == n_virtual - 1)
        outputs[i].backward();
      else
        outputs[i].backward(grads[i]);
      if (x > 0) grads[at(x - 1, op.mb)] = inputs[i].grad();
      inputs[i] = outputs[i] = grads[i] = torch::Tensor();  // per-step state dropped
    }
  }
  return losses;
}

void local_pipeline::sum_tied_grads() {
  const auto tied = tied_parameter(spec_);
  if (tied.empty() || slices_.size() < 2) return;
  torch::NoGradGuard no_grad;
  auto& first = slices_.front()->param(tied).mutable_grad();
  auto& last = slices_.back()->param(tied).mutable_grad();
  first.add_(last);
  last.copy_(first);
}

expert_counts local_pipeline::take_expert_tokens() {
  expert_counts sum;
  for (auto& s : slices_) add_expert_counts(sum, s->take_expert_tokens());
  return sum;
}

double local_pipeline::take_aux_loss() {
  double sum = 0;
  for (auto& s : slices_) sum += s->take_aux_loss();
  return sum;
}

void local_pipeline::zero_grads() {
  for (auto& s : slices_) s->zero_grads();
}

torch::Tensor local_pipeline::forward(const torch::Tensor& input, const torch::Tensor& positions) {
  torch::NoGradGuard no_grad;
  torch::Tensor x = input;
  for (auto& s : slices_) x = s->forward(x, positions);
  return x;
}

state_dict local_pipeline::state() const {
  std::map<std::string, torch::Tensor> all;
  for (const auto& s : slices_)
    for (auto& [name, t] : s->state(/*include_shared_copies=*/true)) all.emplace(name, t);
  state_dict out;
  for (const auto& name : parameter_names(spec_))
    if (experts_.holds(name, spec_.decoder.n_experts)) out.emplace_back(name, all.at(name));
  return out;
}

}  // namespace troupe
