#pragma once
// Data and activations through the pipeline: micro-batches, forward activations,
// backward gradients, losses, credits and the tied-embedding gradient exchange.
#include <cstdint>

#include <caf/meta/type_name.hpp>

#include "messages/tensor_payload.hpp"

namespace troupe {

/// Data loader -> first stage: micro-batch `mb`'s inputs, and with --document-attention
/// their tokens' positions in their documents (batch::positions; empty otherwise).
struct microbatch_input {
  std::int64_t step = 0;
  std::int32_t mb = 0;
  tensor_payload data;
  tensor_payload positions;
};

/// Data loader -> last stage: micro-batch `mb`'s targets.
struct microbatch_target {
  std::int64_t step = 0;
  std::int32_t mb = 0;
  tensor_payload data;
};

/// First stage -> data loader: micro-batch `mb` consumed, one more may come.
struct credit {
  std::int64_t step = 0;
  std::int32_t mb = 0;
};

/// Stage -> stage owning virtual chunk `chunk` downstream: output of the forward, and the
/// micro-batch's positions (documents: every slice of the forward attends by them; empty
/// otherwise).
struct forward_activation {
  std::int64_t step = 0;
  std::int32_t mb = 0;
  std::int32_t chunk = 0;  ///< the receiver's chunk index
  tensor_payload data;
  tensor_payload positions;
};

/// Stage -> stage owning virtual chunk `chunk` upstream: gradient of its output.
struct backward_grad {
  std::int64_t step = 0;
  std::int32_t mb = 0;
  std::int32_t chunk = 0;  ///< the receiver's chunk index
  tensor_payload data;
};

/// Last stage -> coordinator: micro-batch `mb`'s mean loss (unweighted).
struct loss_report {
  std::int64_t step = 0;
  std::int32_t replica = 0;
  std::int32_t mb = 0;
  double loss = 0;
};

/// First <-> last stage: the tied embedding's gradient, to be summed.
struct tied_grad {
  std::int64_t step = 0;
  tensor_payload data;
};

/// Evaluation, forward only (between steps, after step `step` committed): forward `index`
/// of the evaluation set's rows. Coordinator -> a replica's first stage (virtual stage 0:
/// the rows' inputs), stage -> the stage owning virtual chunk `chunk` downstream (the
/// activations).
struct eval_activation {
  std::int64_t step = 0;
  std::int32_t index = 0;
  std::int32_t chunk = 0;  ///< the receiver's chunk index
  tensor_payload data;
  tensor_payload positions;  ///< documents: the rows' positions (as forward_activation's)
};

/// Coordinator -> a replica's last stage: evaluation forward `index`'s targets.
struct eval_target {
  std::int64_t step = 0;
  std::int32_t index = 0;
  tensor_payload data;
};

/// Last stage -> coordinator: evaluation forward `index`'s score (compute/trainer/local_trainer.hpp's
/// eval_score: its mean loss times its rows; classifiers: its rows classified correctly).
struct eval_result {
  std::int64_t step = 0;
  std::int32_t replica = 0;
  std::int32_t index = 0;
  double weighted = 0;
  double correct = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, microbatch_input& x) {
  return f(caf::meta::type_name("microbatch_input"), x.step, x.mb, x.data, x.positions);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, microbatch_target& x) {
  return f(caf::meta::type_name("microbatch_target"), x.step, x.mb, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, credit& x) {
  return f(caf::meta::type_name("credit"), x.step, x.mb);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, forward_activation& x) {
  return f(caf::meta::type_name("forward_activation"), x.step, x.mb, x.chunk, x.data, x.positions);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, backward_grad& x) {
  return f(caf::meta::type_name("backward_grad"), x.step, x.mb, x.chunk, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, loss_report& x) {
  return f(caf::meta::type_name("loss_report"), x.step, x.replica, x.mb, x.loss);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tied_grad& x) {
  return f(caf::meta::type_name("tied_grad"), x.step, x.data);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, eval_activation& x) {
  return f(caf::meta::type_name("eval_activation"), x.step, x.index, x.chunk, x.data, x.positions);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, eval_target& x) {
  return f(caf::meta::type_name("eval_target"), x.step, x.index, x.data);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, eval_result& x) {
  return f(caf::meta::type_name("eval_result"), x.step, x.replica, x.index, x.weighted, x.correct);
}

}  // namespace troupe
