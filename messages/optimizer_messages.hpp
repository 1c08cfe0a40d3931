#pragma once
// The sharded optimizer's exchange: reduce-scatter of gradient ranges, partial norms,
// the global clip factor and the all-gather of updated parameter ranges.
#include <cstdint>

#include <caf/meta/type_name.hpp>

#include "messages/tensor_payload.hpp"

namespace troupe {

/// Stage (replica r) -> optimizer shard `rank` of that stage: its range of chunk `chunk`'s
/// grad buffer (the shard sums the d replicas' ranges: reduce-scatter).
struct grad_shard {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t replica = 0;
  tensor_payload data;
};

/// Shard -> coordinator: squared L2 norm of its reduced gradient range of one chunk.
struct grad_norm_partial {
  std::int64_t step = 0;
  std::int32_t virtual_stage = 0;
  std::int32_t rank = 0;
  double sq_norm = 0;
};

/// Coordinator -> shards: scale all gradients by `factor` (global-norm clipping).
struct clip_factor_msg {
  std::int64_t step = 0;
  double factor = 1;
};

/// Shard -> every replica's stage: updated parameters of its range of chunk `chunk`.
struct param_shard {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t rank = 0;
  tensor_payload data;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, grad_shard& x) {
  return f(caf::meta::type_name("grad_shard"), x.step, x.chunk, x.replica, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, grad_norm_partial& x) {
  return f(caf::meta::type_name("grad_norm_partial"), x.step, x.virtual_stage, x.rank, x.sq_norm);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, clip_factor_msg& x) {
  return f(caf::meta::type_name("clip_factor_msg"), x.step, x.factor);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, param_shard& x) {
  return f(caf::meta::type_name("param_shard"), x.step, x.chunk, x.rank, x.data);
}

}  // namespace troupe
