#include "compute/parallel/expert_parallel.hpp"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace troupe {

namespace ep {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct all_to_all_fn : torch::autograd::Function<all_to_all_fn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t g, std::int64_t back,
                               std::vector<std::int64_t> send_rows, std::vector<std::int64_t> recv_rows) {
    ctx->saved_data["group"] = back;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    return reinterpret_cast<collective_group*>(g)->all_to_all(x.contiguous(), send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& g = *reinterpret_cast<collective_group*>(ctx->saved_data["group"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {g.all_to_all(grads[0].contiguous(), recv, send), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all(const torch::Tensor& x, collective_group& g, collective_group& back,
                         const std::vector<std::int64_t>& send_rows, const std::vector<std::int64_t>& recv_rows) {
  return all_to_all_fn::apply(x, reinterpret_cast<std::int64_t>(&g), reinterpret_cast<std::int64_t>(&back), send_rows,
                              recv_rows);
}

dispatch_plan plan_dispatch(const torch::Tensor& chosen, int n_experts, collective_group& g) {
  const int EP = g.size();
  if (n_experts % EP != 0)
    throw std::invalid_argument(std::to_string(n_experts) + " experts do not split over " + std::to_string(EP) +
                      " expert-parallel ranks");
  const std::int64_t local = n_experts / EP;
  dispatch_plan plan;
  const auto flat = chosen.reshape({-1}).to(torch::kCPU);
  // (Pairs dropped past an expert's capacity have expert E: they sort last and stay here.)
  const auto counts =
      torch::bincount(flat, /*weights=*/{}, n_experts + 1).narrow(0, 0, n_experts).to(torch::kInt64).contiguous();  // (E)
  plan.order = std::get<1>(torch::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false))
                   .narrow(0, 0, counts.sum().item<std::int64_t>());
  // Every rank's counts for this rank's experts: (EP, local), by source rank.
  const auto theirs = g.all_to_all(counts, std::vector<std::int64_t>(EP, local), std::vector<std::int64_t>(EP, local))
                          .view({EP, local});
  const auto mine = counts.view({EP, local}).sum(1);
  const auto from = theirs.sum(1);
  plan.send_rows.assign(mine.data_ptr<std::int64_t>(), mine.data_ptr<std::int64_t>() + EP);
  plan.recv_rows.assign(from.data_ptr<std::int64_t>(), from.data_ptr<std::int64_t>() + EP);
  // Received rows: source 0's (its rows for expert 0 here, then expert 1, ...), source 1's, ...
  const auto* c = theirs.data_ptr<std::int64_t>();
  std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(local));
  std::int64_t at = 0;
  for (int s = 0; s < EP; ++s)
    for (std::int64_t j = 0; j < local; ++j)
      for (std::int64_t i = 0; i < c[s * local + j]; ++i) rows[std::size_t(j)].push_back(at++);
  plan.received = at;
  for (auto& r : rows) plan.rows_of_expert.push_back(torch::tensor(r, torch::kInt64));
  return plan;
}

}  // namespace ep

}  // namespace troupe
