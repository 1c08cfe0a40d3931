#pragma once
// The CPU kernels of the optimizer on plain arrays (no LibTorch: compiled with their own
// flags, see CMakeLists.txt): a fused AdamW update and a masked squared norm.
#include <cstdint>
#include <vector>

namespace troupe::kernels {

/// The constants of one AdamW update, as the float values torch.optim.AdamW's
/// single-tensor path computes with.
struct adamw_constants {
  float grad_scale;    // the global clip factor
  float decay_factor;  // 1 - lr * weight_decay (applied where the mask is true)
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float sqrt_bias_correction2, eps, neg_step_size;  // -lr / bias_correction1
};

/// A run of elements [begin, end) that all have weight decay, or all have none (of any
/// bool mask: `decay` is the mask's value there).
struct decay_run {
  std::int64_t begin, end;
  bool decay;
};

/// The decay runs of a mask (what `adamw` takes instead of the mask itself: with no
/// per-element branch its loop vectorises).
std::vector<decay_run> decay_runs(const bool* mask, std::int64_t n);

/// Elements [begin, end) of one AdamW update: reads p, m, v and g, writes p_out, m_out,
/// v_out (either all of p, m, v: in place, or three arrays overlapping none of the
/// inputs). Per element, in float:
///   g' = g * scale; p' = p * (decay ? decay_factor : 1)
///   m' = m * beta1 + (1 - beta1) * g';  v' = v * beta2 + (1 - beta2) * g' * g'
///   p' = p' + neg_step * (m' / (sqrt(v') / sqrt_bc2 + eps))
/// (torch's mul_, add_, addcmul_, sqrt, div, add_, addcdiv_ in that order). The result
/// of an element depends only on that element: splitting the range changes nothing.
void adamw(const float* p, const float* m, const float* v, const float* g, const std::vector<decay_run>& runs,
           float* p_out, float* m_out, float* v_out, std::int64_t begin, std::int64_t end, const adamw_constants& k);

/// Sum of g[i]^2 (in double) over the i in [0, n) where mask[i] is true, in one fixed
/// order (eight interleaved partial sums, added in lane order).
double masked_sq_norm(const float* g, const bool* mask, std::int64_t n);
/// The same sum over the runs of a mask (decay_runs) that are true: the same lanes (element
/// i adds to lane i mod 8) in the same order, so the same bits as masked_sq_norm.
double runs_sq_norm(const float* g, const std::vector<decay_run>& runs);

}  // namespace troupe::kernels
