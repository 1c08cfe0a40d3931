#include "compute/models/recompute.hpp"

#include <atomic>
#include <vector>

#include <torch/autograd.h>
#include <torch/torch.h>

#include "compute/runtime/device.hpp"

namespace troupe {

namespace {

std::atomic<std::int64_t> recomputed_blocks{0};
std::atomic<std::int64_t> recomputed_attentions{0};

struct recomputed_block_fn : torch::autograd::Function<recomputed_block_fn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, block_runner* runner,
                               std::int64_t i, const window_documents* docs) {
    ctx->save_for_backward({x});
    ctx->saved_data["runner"] = reinterpret_cast<std::int64_t>(runner);
    ctx->saved_data["block"] = i;
    ctx->saved_data["precision"] = std::int64_t(current_precision(x.device()));
    ctx->saved_data["defer"] = reinterpret_cast<std::int64_t>(runner->deferral());
    // (Documents: the rerun attends as this forward does.)
    if (docs->positions.defined()) {
      ctx->saved_data["positions"] = docs->positions;
      if (docs->mask.defined()) ctx->saved_data["mask"] = docs->mask;
      if (docs->numbers.defined()) ctx->saved_data["numbers"] = docs->numbers;  // (context parallelism)
    }
    // (No graph, but a training forward: its load-balancing loss counts.)
    return runner->run_block(x, int(i), block_pass::checkpointing, *docs);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    auto* runner = reinterpret_cast<block_runner*>(ctx->saved_data["runner"].toInt());
    const auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      torch::AutoGradMode grad(true);
      precision_scope amp(x.device(), torch::ScalarType(ctx->saved_data["precision"].toInt()));
      // The store the forward deferred into (the backward may run while another is set).
      auto* const before = runner->deferral();
      runner->deferral() = reinterpret_cast<weight_grad_store*>(ctx->saved_data["defer"].toInt());
      window_documents docs;
      auto saved = [&](const char* key) {
        return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
      };
      docs = {saved("positions"), saved("mask"), saved("numbers")};
      // (Its load-balancing loss was counted by the forward.)
      y = runner->run_block(x, int(ctx->saved_data["block"].toInt()), block_pass::recomputing, docs);
      runner->deferral() = before;
    }
    ++recomputed_blocks;
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct recomputed_attention_fn : torch::autograd::Function<recomputed_attention_fn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const causal_attention* core, const torch::Tensor* documents) {
    // (The documents' mask as saved data: an undefined tensor is no Function input.)
    const auto mask = documents ? *documents : torch::Tensor();
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["core"] = reinterpret_cast<std::int64_t>(core);
    ctx->saved_data["precision"] = std::int64_t(current_precision(q.device()));
    if (mask.defined()) ctx->saved_data["mask"] = mask;
    return (*core)(q, k, v, 0, mask);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto* core = reinterpret_cast<const causal_attention*>(ctx->saved_data["core"].toInt());
    const auto saved = ctx->get_saved_variables();
    std::vector<torch::Tensor> in;
    for (const auto& t : saved) in.push_back(t.detach().requires_grad_(true));
    torch::Tensor y;
    {
      torch::AutoGradMode grad(true);
      precision_scope amp(in[0].device(), torch::ScalarType(ctx->saved_data["precision"].toInt()));
      const auto mask = ctx->saved_data.count("mask") ? ctx->saved_data["mask"].toTensor() : torch::Tensor();
      y = (*core)(in[0], in[1], in[2], 0, mask);
    }
    ++recomputed_attentions;
    auto g = torch::autograd::grad({y}, in, {grads[0]});
    return {g[0], g[1], g[2], torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor recomputed_block(const torch::Tensor& x, block_runner& runner, int i, const window_documents& documents) {
  return recomputed_block_fn::apply(x, &runner, std::int64_t(i), &documents);
}

torch::Tensor recomputed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const causal_attention& core, const torch::Tensor& mask) {
  return recomputed_attention_fn::apply(q, k, v, &core, mask.defined() ? &mask : nullptr);
}

std::int64_t blocks_recomputed() { return recomputed_blocks.load(); }
std::int64_t attentions_recomputed() { return recomputed_attentions.load(); }

}  // namespace troupe
