#include "compute/checkpoint/training_state.hpp"

#include "compute/checkpoint/checkpoint.hpp"

namespace troupe {

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

}  // namespace troupe
