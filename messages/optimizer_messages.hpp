#pragma once
// The sharded optimizer's exchange: reduce-scatter of gradient ranges, partial norms,
// the global clip factor and the all-gather of updated parameter ranges.
#include <cstdint>
#include <string>

#include <caf/meta/type_name.hpp>

#include "messages/tensor_payload.hpp"

namespace troupe {

/// Stage (replica r) -> its own optimizer shard (rank r of that stage, same process):
/// bucket `bucket` of chunk `chunk`'s grad buffer is final; the d shards of the stage
/// reduce-scatter it through their communicator (the stage leaves the buffer alone
/// until its parameters come back). One message per bucket, each with the whole buffer.
struct grad_shard {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t replica = 0;
  std::int32_t bucket = 0;  ///< the gradient bucket now final (see grad_buckets); data: the whole buffer
  tensor_payload data;
};

/// Shard -> coordinator: squared L2 norm of its reduced gradient range of one chunk.
struct grad_norm_partial {
  std::int64_t step = 0;
  std::int32_t virtual_stage = 0;
  std::int32_t rank = 0;
  double sq_norm = 0;
};

/// Coordinator -> shards: scale all gradients by `factor` (global-norm clipping), or
/// skip the update (`skip`: the gradients are not finite) and all-gather unchanged ranges.
struct clip_factor_msg {
  std::int64_t step = 0;
  double factor = 1;
  bool skip = false;
};

/// Shard -> its own stage: chunk `chunk`'s whole parameter buffer after the all-gather
/// of the updated ranges of all shards.
struct param_shard {
  std::int64_t step = 0;
  std::int32_t chunk = 0;
  std::int32_t rank = 0;
  tensor_payload data;
};

/// A collective of the shard's communicator completed (sent by the transport's completion
/// callback to the shard itself). `error` is empty on success.
struct collective_done {
  std::int64_t step = 0;
  std::int32_t kind = 0;  ///< transport::collective
  std::int32_t chunk = 0;
  std::int32_t bucket = 0;
  std::string error;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, collective_done& x) {
  return f(caf::meta::type_name("collective_done"), x.step, x.kind, x.chunk, x.bucket, x.error);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, grad_shard& x) {
  return f(caf::meta::type_name("grad_shard"), x.step, x.chunk, x.replica, x.bucket, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, grad_norm_partial& x) {
  return f(caf::meta::type_name("grad_norm_partial"), x.step, x.virtual_stage, x.rank, x.sq_norm);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, clip_factor_msg& x) {
  return f(caf::meta::type_name("clip_factor_msg"), x.step, x.factor, x.skip);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, param_shard& x) {
  return f(caf::meta::type_name("param_shard"), x.step, x.chunk, x.rank, x.data);
}

}  // namespace troupe
