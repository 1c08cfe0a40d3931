#include "compute/optim/adamw_kernel.hpp"

#include <algorithm>
#include <cmath>

namespace troupe::kernels {

// Built with -O3 -fno-math-errno (vectorised sqrt) and, on x86-64, cloned for AVX2 with
// a run-time choice. Neither contracts a * b + c into an FMA (no "fma" target), so both
// clones give the same bits as the scalar code: IEEE +, *, / and sqrt are exact-rounded.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TROUPE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TROUPE_CLONES
#endif

namespace {

inline void adamw_element(float p, float m, float v, float g, float decay_factor, const adamw_constants& c,
                          float& p_out, float& m_out, float& v_out) {
  const float gi = g * c.grad_scale;
  const float pi = p * decay_factor;  // x 1.0f where there is no decay: exact
  const float mi = m * c.beta1 + c.one_minus_beta1 * gi;
  const float vi = v * c.beta2 + c.one_minus_beta2 * gi * gi;
  const float denom = std::sqrt(vi) / c.sqrt_bias_correction2 + c.eps;
  p_out = pi + c.neg_step_size * (mi / denom);
  m_out = mi;
  v_out = vi;
}

// Two loops with restrict pointers (the vectoriser gives up on run-time alias checks
// between seven arrays): separate outputs, or outputs = inputs.
TROUPE_CLONES
void adamw_separate(const float* __restrict p, const float* __restrict m, const float* __restrict v,
                    const float* __restrict g, float* __restrict p_out, float* __restrict m_out,
                    float* __restrict v_out, std::int64_t begin, std::int64_t end, float decay_factor,
                    const adamw_constants c) {
  for (std::int64_t i = begin; i < end; ++i)
    adamw_element(p[i], m[i], v[i], g[i], decay_factor, c, p_out[i], m_out[i], v_out[i]);
}

TROUPE_CLONES
void adamw_in_place(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
                    std::int64_t begin, std::int64_t end, float decay_factor, const adamw_constants c) {
  for (std::int64_t i = begin; i < end; ++i)
    adamw_element(p[i], m[i], v[i], g[i], decay_factor, c, p[i], m[i], v[i]);
}

}  // namespace

std::vector<decay_run> decay_runs(const bool* mask, std::int64_t n) {
  std::vector<decay_run> runs;
  for (std::int64_t i = 0; i < n; ++i)
    if (runs.empty() || runs.back().decay != mask[i])
      runs.push_back({i, i + 1, mask[i]});
    else
      runs.back().end = i + 1;
  return runs;
}

void adamw(const float* p, const float* m, const float* v, const float* g, const std::vector<decay_run>& runs,
           float* p_out, float* m_out, float* v_out, std::int64_t begin, std::int64_t end, const adamw_constants& k) {
  const bool in_place = p == p_out && m == m_out && v == v_out;
  for (const auto& run : runs) {
    const auto b = std::max(begin, run.begin), e = std::min(end, run.end);
    if (b >= e) continue;
    const float factor = run.decay ? k.decay_factor : 1.0f;
    if (in_place)
      adamw_in_place(p_out, m_out, v_out, g, b, e, factor, k);
    else
      adamw_separate(p, m, v, g, p_out, m_out, v_out, b, e, factor, k);
  }
}

TROUPE_CLONES
double masked_sq_norm(const float* g, const bool* mask, std::int64_t n) {
  constexpr int lanes = 8;
  double acc[lanes] = {};
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int j = 0; j < lanes; ++j) {
      const double x = g[i + j];
      acc[j] += mask[i + j] ? x * x : 0.0;
    }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = g[i];
    acc[j] += mask[i] ? x * x : 0.0;
  }
  double sum = 0;
  for (double a : acc) sum += a;
  return sum;
}

TROUPE_CLONES
double runs_sq_norm(const float* g, const std::vector<decay_run>& runs) {
  constexpr int lanes = 8;
  double acc[lanes] = {};
  for (const auto& run : runs) {
    if (!run.decay) continue;
    std::int64_t i = run.begin;
    for (; i < run.end && i % lanes != 0; ++i) {
      const double x = g[i];
      acc[i % lanes] += x * x;
    }
    for (; i + lanes <= run.end; i += lanes)
      for (int j = 0; j < lanes; ++j) {
        const double x = g[i + j];
        acc[j] += x * x;
      }
    for (; i < run.end; ++i) {
      const double x = g[i];
      acc[i % lanes] += x * x;
    }
  }
  double sum = 0;
  for (double a : acc) sum += a;
  return sum;
}

}  // namespace troupe::kernels
