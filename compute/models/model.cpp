#include "compute/models/model.hpp"

#include "compute/models/decoder_slice.hpp"
#include "compute/models/mlp_slice.hpp"
#include "compute/models/tensor_parallel_layout.hpp"

namespace troupe {

std::unique_ptr<model_slice> make_slice(const model_spec& spec, const layer_range& range,
                                        const state_dict& state, std::int64_t pad_to, torch::Device device,
                                        torch::ScalarType param_dtype, const tensor_parallel& tp,
                                        const expert_share& experts) {
  if (range.first < 0 || range.last > spec.n_layers() || range.first >= range.last)
    throw model_error("layer range [" + std::to_string(range.first) + ", " +
                      std::to_string(range.last) + ") does not fit " + spec.name() + " with " +
                      std::to_string(spec.n_layers()) + " layers");
  if (spec.type == model_spec::kind::decoder)
    return std::make_unique<decoder_slice>(spec, range, state, pad_to, device, param_dtype, tp, experts);
  check_tensor_parallel(spec, tp.size, tp.sequence);  // (refuses a split of the MLP)
  if (experts.active()) throw model_error(spec.name() + " has no experts to share over expert-parallel ranks");
  return std::make_unique<mlp_slice>(spec, range, state, pad_to, device, param_dtype);
}

}  // namespace troupe
