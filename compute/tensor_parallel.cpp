#include "compute/tensor_parallel.hpp"

#include <torch/autograd.h>

namespace troupe {

torch::Tensor shard_parameter(const model_spec& spec, const std::string& name, const torch::Tensor& full, int size,
                              int rank) {
  switch (tp_split_of(spec, name)) {
    case tp_split::replicated: return full.clone();
    case tp_split::rows: return full.chunk(size, 0).at(std::size_t(rank)).contiguous();
    case tp_split::columns: return full.chunk(size, 1).at(std::size_t(rank)).contiguous();
    case tp_split::qkv_rows: {
      std::vector<torch::Tensor> mine;
      for (const auto& block : full.chunk(3, 0)) mine.push_back(block.chunk(size, 0).at(std::size_t(rank)));
      return torch::cat(mine, 0);
    }
  }
  return full;
}

torch::Tensor unshard_parameter(const model_spec& spec, const std::string& name,
                                const std::vector<torch::Tensor>& parts) {
  switch (tp_split_of(spec, name)) {
    case tp_split::replicated: return parts.at(0);
    case tp_split::rows: return torch::cat(parts, 0);
    case tp_split::columns: return torch::cat(parts, 1);
    case tp_split::qkv_rows: {
      std::vector<torch::Tensor> q, k, v;
      for (const auto& part : parts) {
        auto blocks = part.chunk(3, 0);
        q.push_back(blocks[0]);
        k.push_back(blocks[1]);
        v.push_back(blocks[2]);
      }
      return torch::cat({torch::cat(q, 0), torch::cat(k, 0), torch::cat(v, 0)}, 0);
    }
  }
  return parts.at(0);
}

namespace {

/// The shape of rank parts of a `whole`-shaped parameter `name` split over `size` ranks.
std::vector<std::int64_t> part_shape(const model_spec& spec, const std::string& name, std::vector<std::int64_t> whole,
                                     int size) {
  switch (tp_split_of(spec, name)) {
    case tp_split::replicated: break;
    case tp_split::rows:
    case tp_split::qkv_rows: whole.at(0) /= size; break;
    case tp_split::columns: whole.at(1) /= size; break;
  }
  return whole;
}

}  // namespace

std::map<std::string, torch::Tensor> shard_by_name(const model_spec& spec,
                                                   const std::map<std::string, torch::Tensor>& params,
                                                   const std::map<std::string, torch::Tensor>& tensors, int size,
                                                   int rank) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : tensors) {
    auto it = params.find(key);
    if (it == params.end() && key.find('.') != std::string::npos) it = params.find(key.substr(key.find('.') + 1));
    out[key] = it == params.end() ? t : shard_parameter(spec, it->first, t.view(it->second.sizes()), size, rank);
  }
  return out;
}

std::map<std::string, torch::Tensor> unshard_by_name(const model_spec& spec,
                                                     const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                                     const std::vector<std::map<std::string, torch::Tensor>>& parts) {
  std::map<std::string, torch::Tensor> out;
  const int size = int(parts.size());
  for (const auto& [name, first] : parts.at(0)) {
    if (tp_split_of(spec, name) == tp_split::replicated) {
      out[name] = first;
      continue;
    }
    const auto whole = shapes.find(name);
    std::vector<torch::Tensor> each;
    for (const auto& part : parts)
      each.push_back(whole == shapes.end() ? part.at(name) : part.at(name).view(part_shape(spec, name, whole->second, size)));
    auto joined = unshard_parameter(spec, name, each);
    out[name] = first.dim() == 1 && whole != shapes.end() && whole->second.size() != 1 ? joined.reshape({-1}) : joined;
  }
  return out;
}

named_moments unshard_moments(const model_spec& spec, const state_dict& model, const std::vector<named_moments>& parts) {
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, p] : model) shapes[name] = p.sizes().vec();
  std::vector<std::map<std::string, torch::Tensor>> avg, avg_sq, main;
  for (const auto& part : parts) {
    avg.push_back(part.exp_avg);
    avg_sq.push_back(part.exp_avg_sq);
    main.push_back(part.main_params);
  }
  named_moments whole;
  whole.exp_avg = unshard_by_name(spec, shapes, avg);
  whole.exp_avg_sq = unshard_by_name(spec, shapes, avg_sq);
  if (!main.front().empty()) whole.main_params = unshard_by_name(spec, shapes, main);
  return whole;
}

void check_tensor_parallel(const model_spec& spec, int size, bool sequence) {
  const std::string T = "parallel.tensor_parallel = " + std::to_string(size);
  if (size < 1) throw model_error(T + ": expected 1 or more");
  if (size == 1) return;
  if (spec.type != model_spec::kind::decoder)
    throw model_error(T + ": tensor parallelism splits the decoders' heads, MLPs and vocabulary; " + spec.name() +
                      " has none (use parallel.tensor_parallel = 1)");
  const auto& c = spec.decoder;
  struct dim {
    const char* key;
    int value;
  };
  std::vector<dim> dims{{"model.heads", c.n_head}, {"model.kv_heads", c.kv_heads()}, {"model.d_ff", c.d_ff},
                        {"model.vocab", c.vocab}};
  if (sequence) dims.push_back({"model.seq_len (with parallel.sequence_parallel)", c.seq_len});
  std::string valid;
  for (int t = 1; t <= c.n_head; ++t) {
    bool ok = true;
    for (const auto& d : dims) ok = ok && d.value % t == 0;
    if (ok) valid += (valid.empty() ? "" : ", ") + std::to_string(t);
  }
  for (const auto& d : dims)
    if (d.value % size != 0)
      throw model_error(T + " does not divide " + d.key + " = " + std::to_string(d.value) +
                        " (each rank holds an equal part); tensor_parallel values that fit this model: " + valid);
}

namespace tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

collective_group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<collective_group*>(ctx->saved_data["group"].toInt());
}
std::int64_t handle(collective_group& g) { return reinterpret_cast<std::int64_t>(&g); }

/// Reduced precisions are summed in fp32 (the transports sum fp32 and fp64).
bool summed_in_fp32(const torch::Tensor& x) {
  return x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
}

/// The sum over the group of `x` (a new tensor).
torch::Tensor summed(const torch::Tensor& x, collective_group& g) {
  const bool low = summed_in_fp32(x);
  auto y = low ? x.to(torch::kFloat32).contiguous() : x.contiguous().clone();
  g.all_reduce(y);
  return low ? y.to(x.scalar_type()) : y;
}

/// Every rank's `x` concatenated along `dim`.
torch::Tensor gathered(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto front = x.movedim(dim, 0).contiguous();
  auto sizes = front.sizes().vec();
  sizes[0] *= g.size();
  auto out = torch::empty(sizes, front.options());
  g.all_gather(front, out);
  return out.movedim(0, dim);
}

/// This rank's part along `dim` of the sum over the group.
torch::Tensor reduce_scattered(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto front = x.movedim(dim, 0).to(summed_in_fp32(x) ? torch::kFloat32 : x.scalar_type()).contiguous();
  auto sizes = front.sizes().vec();
  if (sizes[0] % g.size() != 0)
    throw model_error("a reduce-scatter of " + std::to_string(sizes[0]) + " positions over " +
                      std::to_string(g.size()) + " ranks");
  sizes[0] /= g.size();
  auto out = torch::empty(sizes, front.options());
  g.reduce_scatter(front, out);
  return out.to(x.scalar_type()).movedim(0, dim);
}

torch::Tensor own_part(const torch::Tensor& x, std::int64_t dim, collective_group& g) {
  const auto n = x.size(dim) / g.size();
  return x.narrow(dim, n * g.rank(), n);
}

struct copy_to_fn : torch::autograd::Function<copy_to_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {summed(grads[0], group_of(ctx)), torch::Tensor()};
  }
};

struct reduce_from_fn : torch::autograd::Function<reduce_from_fn> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, std::int64_t g) {
    return summed(x, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

struct gather_sequence_fn : torch::autograd::Function<gather_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g, bool reduce_grad) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["reduce"] = reduce_grad;
    return gathered(x, 1, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& g = group_of(ctx);
    auto dx = ctx->saved_data["reduce"].toBool() ? reduce_scattered(grads[0], 1, g) : own_part(grads[0], 1, g);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

struct reduce_scatter_sequence_fn : torch::autograd::Function<reduce_scatter_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return reduce_scattered(x, 1, *reinterpret_cast<collective_group*>(g));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered(grads[0], 1, group_of(ctx)), torch::Tensor()};
  }
};

struct scatter_sequence_fn : torch::autograd::Function<scatter_sequence_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g) {
    ctx->saved_data["group"] = g;
    return own_part(x, 1, *reinterpret_cast<collective_group*>(g)).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gathered(grads[0], 1, group_of(ctx)), torch::Tensor()};
  }
};

struct cross_entropy_fn : torch::autograd::Function<cross_entropy_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target,
                               std::int64_t first, std::int64_t handle) {
    auto& g = *reinterpret_cast<collective_group*>(handle);
    const auto n = logits.size(0), width = logits.size(1);
    // The row maxima of the whole vocabulary: every rank's, gathered (the transports sum only).
    auto local_max = std::get<0>(logits.max(1)).contiguous();
    auto maxima = torch::empty({g.size() * n}, local_max.options());
    g.all_gather(local_max, maxima);
    const auto row_max = std::get<0>(maxima.view({g.size(), n}).max(0));
    const auto shifted = logits - row_max.unsqueeze(1);
    const auto outside = (target < first).logical_or(target >= first + width);
    const auto local = (target - first).masked_fill(outside, 0);
    auto exp = shifted.exp();
    // The target's logit (from the rank holding it) and the sum of exponentials, in one sum.
    auto sums = torch::stack({shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0),
                              exp.sum(1)})
                    .contiguous();
    g.all_reduce(sums);
    const auto sum_exp = sums[1];
    exp.div_(sum_exp.unsqueeze(1));  // the softmax, kept for the backward
    ctx->save_for_backward({exp, local, outside});
    return (sum_exp.log() - sums[0]).mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto d = saved[0].clone();
    const auto inside = saved[2].logical_not().to(d.scalar_type());
    d.scatter_add_(1, saved[1].unsqueeze(1), -inside.unsqueeze(1));
    d.mul_(grads[0] / double(d.size(0)));
    return {d, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to(const torch::Tensor& x, collective_group& g) { return copy_to_fn::apply(x, handle(g)); }
torch::Tensor reduce_from(const torch::Tensor& x, collective_group& g) { return reduce_from_fn::apply(x, handle(g)); }
torch::Tensor gather_sequence(const torch::Tensor& x, collective_group& g, bool reduce_grad) {
  return gather_sequence_fn::apply(x, handle(g), reduce_grad);
}
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, collective_group& g) {
  return reduce_scatter_sequence_fn::apply(x, handle(g));
}
torch::Tensor scatter_sequence(const torch::Tensor& x, collective_group& g) {
  return scatter_sequence_fn::apply(x, handle(g));
}

torch::Tensor vocab_embedding(const torch::Tensor& ids, const torch::Tensor& weight, std::int64_t first) {
  const auto outside = (ids < first).logical_or(ids >= first + weight.size(0));
  const auto e = torch::embedding(weight, (ids - first).masked_fill(outside, 0));
  return e.masked_fill(outside.unsqueeze(-1), 0.0);
}

torch::Tensor vocab_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, std::int64_t first,
                                  collective_group& g) {
  return cross_entropy_fn::apply(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}), first, handle(g));
}

torch::Tensor gather_dim(const torch::Tensor& x, int64_t dim, collective_group& g) {
  torch::NoGradGuard no_grad;
  return gathered(x, dim < 0 ? dim + x.dim() : dim, g);
}

}  // namespace tp

}  // namespace troupe
