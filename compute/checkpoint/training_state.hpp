#pragma once
// The two files of --save as the training loop reads them: FILE (the model's state_dict)
// and FILE.optim (AdamW's moments by parameter name and the next step), checked to be the
// two files of one save.
#include <cstdint>
#include <map>
#include <string>

#include "compute/models/model.hpp"
#include "compute/optim/grad_buffer.hpp"

namespace troupe {

/// A checkpoint as written by --save: FILE (model state_dict) and FILE.optim (AdamW
/// moments by parameter name and the next step).
struct checkpoint {
  state_dict model;
  std::map<std::string, torch::Tensor> params, optim;
  std::int64_t step = 0;
};
/// Reads both files and checks them against `spec` and the run's length.
checkpoint read_checkpoint(const std::string& path, const model_spec& spec, int total_steps);
/// FILE.optim's content from gathered moments (`model` gives names, order and shapes).
state_dict optimizer_state_dict(const named_moments& moments, const state_dict& model, std::int64_t next_step);

}  // namespace troupe
