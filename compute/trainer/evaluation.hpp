#pragma once
// Evaluation: a model's loss (and, for classifiers, accuracy) on an evaluation set, in
// forwards of a bounded number of tokens, scored and combined in the same order by the
// plain loop and by the actor runtime.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "compute/config/job_config.hpp"
#include "compute/data/data.hpp"
#include "compute/models/model.hpp"
#include "compute/trainer/local_pipeline.hpp"

namespace troupe {

/// Loss (and, for classifiers, accuracy) of a model on an evaluation set.
struct evaluation {
  bool text = true;     ///< gpt: validation windows; mlp: test set with accuracy
  double loss = 0;
  double accuracy = 0;  ///< fraction correct (mlp only)
  double bytes_per_target = 1.0;  ///< text: the bytes a target token stands for, on average (0: not known)
  /// Text: the validation targets' summed cross-entropy / ln 2 / their bytes (WORKLOADS.md
  /// section 5), so that runs with different tokenizers, and bytes, compare.
  double bits_per_byte() const;
  /// Metrics fields: val_loss and val_bpb, or test_loss and test_accuracy.
  std::vector<std::pair<std::string, double>> fields() const;
  /// For the log: "validation loss 4.9058, 7.0776 bits per byte", or "test loss 0.5312,
  /// test accuracy 81.20 %".
  std::string summary() const;
};

/// One forward of an evaluation: rows [begin, begin + rows) of the evaluation set.
struct eval_forward {
  std::int64_t begin = 0, rows = 0;
};

/// The forwards an evaluation of `set` takes, in order: `tokens_per_forward` tokens each
/// (text: whole windows, at least one; images: the whole set in one).
std::vector<eval_forward> plan_evaluation(const batch& set, bool text, std::int64_t tokens_per_forward);

/// One forward's share of an evaluation: its mean loss times its rows, and (classifiers)
/// how many of its rows the model classified correctly.
struct eval_score {
  double weighted = 0, correct = 0;
};

/// Scores one forward: `output` is the last slice's forward output of the forward's rows,
/// `target` their targets (call without autograd).
eval_score score_evaluation(model_slice& last, const torch::Tensor& output, const torch::Tensor& target, bool text);

/// The evaluation of `set`'s rows from its forwards' scores, summed in forward order (one
/// forward: its loss's bits as they are: a float times a row count below 2^29 is exact in
/// double, and so is dividing it back). Logs one line naming `step` (1-based; 0: none).
evaluation combine_evaluation(const std::vector<eval_score>& scores, const batch& set, bool text, int step);

/// Evaluates `model` (no autograd) on `set` as `plan_evaluation` splits it, scoring each
/// forward and combining them as above: the actor runtime's evaluation in the pipeline
/// gives the same numbers (fp32).
evaluation evaluate_model(local_pipeline& model, const batch& set, bool text, int step,
                          std::int64_t tokens_per_forward = eval_tokens_per_forward);

}  // namespace troupe
