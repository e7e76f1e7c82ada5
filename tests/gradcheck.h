#pragma once
// Finite-difference gradient checks for the fp32 CPU ops.
//
// Objective: L = sum(out * R) for a fixed random R, accumulated in double; dL/dout = R is fed to the
// backward op. Numerical gradient: central difference with step eps = 1e-2 (the step actually taken
// in fp32 is used as the denominator). Tolerance, stated once for every op:
//   |num - ana| <= 1e-3 + 1e-2 * |num|   for every element checked.
// Why eps = 1e-2: the forward runs in fp32, so L carries roundoff of about 1e-6 and the difference
// quotient about 1e-4 of noise at this step, while the O(eps^2) truncation error stays below 1e-4 for
// the smooth ops tested on O(1) inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace ndt::gradcheck {

struct GradTol {
  double eps = 1e-2;
  double atol = 1e-3;
  double rtol = 1e-2;
};

inline std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<float> randu(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<int32_t> randint(size_t n, std::mt19937& rng, int32_t lo, int32_t hi_excl) {
  std::uniform_int_distribution<int32_t> dist(lo, hi_excl - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// sum(out * r) in double.
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * r[i];
  return s;
}

// Backward ops accumulate: callers pre-fill the gradient buffer with `prior` and pass the buffer after
// backward; the analytic gradient is the difference.
inline std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Checks `ana` = dL/dx against central differences of `loss` (which reads x). x is perturbed in place
// and restored.
inline void check_grad(const std::string& name, std::vector<float>& x, const std::vector<float>& ana,
                       const std::function<double()>& loss, GradTol tol = {}) {
  ASSERT_EQ(x.size(), ana.size()) << name;
  int bad = 0;
  double worst = 0.0;
  std::string first;
  for (size_t i = 0; i < x.size(); ++i) {
    const float orig = x[i];
    const float xp = orig + static_cast<float>(tol.eps), xm = orig - static_cast<float>(tol.eps);
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = orig;
    const double num = (lp - lm) / (static_cast<double>(xp) - static_cast<double>(xm));
    const double err = std::fabs(num - ana[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(num);
    worst = std::max(worst, err / allowed);
    if (err > allowed) {
      if (bad == 0)
        first = "element " + std::to_string(i) + ": numerical " + std::to_string(num) + " analytic " +
                std::to_string(ana[i]);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << x.size() << " elements out of tolerance, first "
                    << first;
  // A sanity check that the test exercised something: the gradient must not be identically zero.
  double norm = 0.0;
  for (float a : ana) norm += std::fabs(a);
  EXPECT_GT(norm, 0.0) << name << ": analytic gradient is all zeros";
  ::testing::Test::RecordProperty(name + "_worst_err_over_allowed", std::to_string(worst));
}

}  // namespace ndt::gradcheck
