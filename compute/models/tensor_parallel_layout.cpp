#include "compute/models/tensor_parallel_layout.hpp"

#include "compute/models/family.hpp"

namespace troupe {

bool replicates_kv_heads(const decoder_config& c, int size) { return size > 1 && c.kv_heads() < size; }

std::map<std::string, param_spec> rows_by_name(const model_spec& spec, int size) {
  auto rows = rows_by_name(spec);
  if (spec.type != model_spec::kind::decoder || !replicates_kv_heads(spec.decoder, size)) return rows;
  const auto& f = family_of(spec.decoder.arch);
  for (int i = 0; i < spec.decoder.n_layer; ++i)
    for (const auto& proj : {f.attention.k, f.attention.v})
      for (const char* kind : {".weight", ".bias"})
        if (const auto it = rows.find(f.block(i) + f.attention.prefix + proj + kind); it != rows.end())
          it->second.split = tp_split::replicated;
  return rows;
}

namespace {

/// Parameter `name`'s split in `rows` (replicated for a name not in the table, as
/// tp_split_of).
tp_split split_of(const std::map<std::string, param_spec>& rows, const std::string& name) {
  const auto it = rows.find(name);
  return it == rows.end() ? param_spec{}.split : it->second.split;
}

}  // namespace

torch::Tensor shard_parameter(const model_spec& spec, const std::string& name, const torch::Tensor& full, int size,
                              int rank) {
  return shard_parameter(split_of(rows_by_name(spec, size), name), full, size, rank);
}

torch::Tensor shard_parameter(tp_split split, const torch::Tensor& full, int size, int rank) {
  switch (split) {
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
  return unshard_parameter(split_of(rows_by_name(spec, int(parts.size())), name), parts);
}

torch::Tensor unshard_parameter(tp_split split, const std::vector<torch::Tensor>& parts) {
  switch (split) {
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
std::vector<std::int64_t> part_shape(tp_split split, std::vector<std::int64_t> whole, int size) {
  switch (split) {
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
  const auto rows = rows_by_name(spec, size);
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : tensors) {
    auto it = params.find(key);
    if (it == params.end() && key.find('.') != std::string::npos) it = params.find(key.substr(key.find('.') + 1));
    out[key] = it == params.end() ? t : shard_parameter(split_of(rows, it->first), t.view(it->second.sizes()), size, rank);
  }
  return out;
}

std::map<std::string, torch::Tensor> unshard_by_name(const model_spec& spec,
                                                     const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                                     const std::vector<std::map<std::string, torch::Tensor>>& parts) {
  const int size = int(parts.size());
  const auto rows = rows_by_name(spec, size);
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, first] : parts.at(0)) {
    const auto split = split_of(rows, name);
    if (split == tp_split::replicated) {
      out[name] = first;
      continue;
    }
    const auto whole = shapes.find(name);
    std::vector<torch::Tensor> each;
    for (const auto& part : parts)
      each.push_back(whole == shapes.end() ? part.at(name) : part.at(name).view(part_shape(split, whole->second, size)));
    auto joined = unshard_parameter(split, each);
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
  // (key/value heads: T a multiple of them replicates them, see above)
  std::vector<dim> dims{{"model.heads", c.n_head}, {"model.d_ff", c.d_ff}, {"model.vocab", c.vocab}};
  if (sequence) dims.push_back({"model.seq_len (with parallel.sequence_parallel)", c.seq_len});
  const int kv = c.kv_heads();
  auto kv_fits = [&](int t) { return kv % t == 0 || t % kv == 0; };
  std::string valid;
  for (int t = 1; t <= c.n_head; ++t) {
    bool ok = kv_fits(t);
    for (const auto& d : dims) ok = ok && d.value % t == 0;
    if (ok) valid += (valid.empty() ? "" : ", ") + std::to_string(t);
  }
  for (const auto& d : dims)
    if (d.value % size != 0)
      throw model_error(T + " does not divide " + d.key + " = " + std::to_string(d.value) +
                        " (each rank holds an equal part); tensor_parallel values that fit this model: " + valid);
  if (!kv_fits(size))
    throw model_error(T + " and model.kv_heads = " + std::to_string(kv) + ": neither divides the other (each rank " +
                      "holds its share of the key/value heads, or with fewer heads than ranks a copy of one); " +
                      "tensor_parallel values that fit this model: " + valid);
}

}  // namespace troupe
