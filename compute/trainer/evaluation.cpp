#include "compute/trainer/evaluation.hpp"

#include <algorithm>
#include <cmath>

#include <spdlog/spdlog.h>

namespace troupe {

double evaluation::bits_per_byte() const {
  return bytes_per_target > 0 ? loss / std::log(2.0) / bytes_per_target : std::nan("");
}

std::vector<std::pair<std::string, double>> evaluation::fields() const {
  if (text && bytes_per_target <= 0) return {{"val_loss", loss}};  // (ids without a tokenizer)
  if (text) return {{"val_loss", loss}, {"val_bpb", bits_per_byte()}};
  return {{"test_loss", loss}, {"test_accuracy", accuracy}};
}

std::vector<eval_forward> plan_evaluation(const batch& set, bool text, std::int64_t tokens_per_forward) {
  const std::int64_t rows = set.input.size(0);
  const std::int64_t per =
      text ? std::max<std::int64_t>(1, tokens_per_forward / std::max<std::int64_t>(1, set.input.size(1))) : rows;
  std::vector<eval_forward> plan;
  for (std::int64_t b = 0; b < rows; b += per) plan.push_back({b, std::min(per, rows - b)});
  return plan;
}

eval_score score_evaluation(model_slice& last, const torch::Tensor& output, const torch::Tensor& target, bool text) {
  // The loss is a mean over the rows' tokens (text windows are of one length).
  eval_score s;
  s.weighted = last.loss(output, target).item<double>() * double(target.size(0));
  if (!text) s.correct = last.logits(output).argmax(-1).eq(target).sum().item<double>();
  return s;
}

evaluation combine_evaluation(const std::vector<eval_score>& scores, const batch& set, bool text, int step) {
  const std::int64_t rows = set.input.size(0);
  evaluation e;
  e.text = text;
  e.bytes_per_target = set.bytes_per_target;
  double weighted = 0, correct = 0;
  for (const auto& s : scores) {
    weighted += s.weighted;
    correct += s.correct;
  }
  e.loss = weighted / double(rows);
  e.accuracy = text ? 0 : correct / double(rows);
  if (step > 0) spdlog::info("step {}: {}", step, e.summary());
  return e;
}

std::string evaluation::summary() const {
  if (text && bytes_per_target <= 0)
    return fmt::format("validation loss {:.4f} (bits per byte unknown: the ids have no tokenizer)", loss);
  if (text) return fmt::format("validation loss {:.4f}, {:.4f} bits per byte", loss, bits_per_byte());
  return fmt::format("test loss {:.4f}, test accuracy {:.2f} %", loss, 100 * accuracy);
}

evaluation evaluate_model(local_pipeline& model, const batch& set, bool text, int step,
                          std::int64_t tokens_per_forward) {
  torch::NoGradGuard no_grad;
  auto& last = model.slice(model.virtual_stages() - 1);
  const auto device = last.flat_params().device();  // fp32, on the model's device
  std::vector<eval_score> scores;
  for (const auto& f : plan_evaluation(set, text, tokens_per_forward)) {
    const auto target = set.target.narrow(0, f.begin, f.rows).to(device);
    const auto positions = set.positions.defined() ? set.positions.narrow(0, f.begin, f.rows) : torch::Tensor();
    scores.push_back(score_evaluation(
        last, model.forward(set.input.narrow(0, f.begin, f.rows).to(device), positions), target, text));
  }
  return combine_evaluation(scores, set, text, step);
}

}  // namespace troupe
