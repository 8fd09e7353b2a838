// The mixer ops through the C++ API, against LibTorch alone (no Python).
#include "headscope.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <string>

namespace {

at::Tensor dense_mix(const at::Tensor& U, const at::Tensor& V, const at::Tensor& X) {
  return at::matmul(at::matmul(U / U.sum(-2, true), V.mT()), X);
}

double rel_err(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).norm() / want.norm()).item<double>();
}

TEST(ThinMix, EqualsDenseMixingInFloat64) {
  at::manual_seed(0);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto U = at::softmax(at::randn({3, 50, 4}, opts), -1);
  const auto V = at::softmax(at::randn({3, 40, 4}, opts), -1);
  const auto X = at::randn({3, 40, 8}, opts);
  const auto Y = headscope::thin_mix(U, V, X);
  ASSERT_EQ(Y.sizes(), (at::IntArrayRef{3, 50, 8}));
  EXPECT_LT(rel_err(Y, dense_mix(U, V, X)), 1e-12);
}

TEST(ThinMix, ErrorNamesTheArgument) {
  const auto U = at::rand({5, 3});
  const auto message = headscope::testing::error_of([&] { headscope::thin_mix(U, U, at::rand({6, 2})); });
  EXPECT_NE(message.find("headscope::thin_mix: argument 'X'"), std::string::npos) << message;
}

TEST(KLProject, ConvergesToTheProjection) {
  at::manual_seed(1);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto a = at::randn({4, 64, 8}, opts), b = at::randn({4, 64, 8}, opts);
  auto [U, V, z, iters, residual] = headscope::kl_project(a, b);
  EXPECT_LE(residual.max().item<double>(), 1e-11);
  EXPECT_LT(iters.max().item<int64_t>(), 80);
  EXPECT_LE((U.sum(-2) - V.sum(-2)).abs().max().item<double>(), 1e-11);
  EXPECT_LE((U - at::softmax(a + z.unsqueeze(-2), -1)).abs().max().item<double>(), 1e-14);
  EXPECT_LE((V - at::softmax(b - z.unsqueeze(-2), -1)).abs().max().item<double>(), 1e-14);
  EXPECT_EQ(z.select(-1, 7).abs().max().item<double>(), 0.0);
}

TEST(KLProject, RejectsDifferentRowCounts) {
  EXPECT_THROW(headscope::kl_project(at::rand({5, 3}), at::rand({6, 3})), c10::Error);
}

TEST(KLHvp, EqualsTheHessianProduct) {
  at::manual_seed(2);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  auto [U, V, z, iters, residual] =
      headscope::kl_project(at::randn({30, 5}, opts), at::randn({30, 5}, opts));
  const auto s = at::randn({5}, opts);
  const auto H = at::diag(U.sum(0) + V.sum(0)) - U.t().mm(U) - V.t().mm(V);
  EXPECT_LT(rel_err(headscope::kl_hvp(U, V, s), H.mv(s)), 1e-13);
}

// Training from C++: gradients of a loss through kl_project and thin_mix agree with
// central differences along a random direction.
TEST(Autograd, DirectionalDerivativeMatchesFiniteDifferences) {
  at::manual_seed(3);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto a0 = at::randn({2, 12, 3}, opts), b0 = at::randn({2, 12, 3}, opts);
  const auto X = at::randn({2, 12, 4}, opts), target = at::randn({2, 12, 4}, opts);
  auto loss = [&](const at::Tensor& a, const at::Tensor& b) {
    auto [U, V, z, iters, residual] = headscope::kl_project(a, b, 1e-13, 100);
    return (headscope::thin_mix(U, V, X) - target).pow(2).sum() + z.pow(2).sum();
  };
  auto a = a0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  loss(a, b).backward();
  ASSERT_TRUE(a.grad().defined() && b.grad().defined());
  const auto da = at::randn_like(a0), db = at::randn_like(b0);
  const double eps = 1e-6;
  c10::NoGradGuard no_grad;
  const double fd = (loss(a0 + eps * da, b0 + eps * db) - loss(a0 - eps * da, b0 - eps * db))
                        .item<double>() / (2 * eps);
  const double analytic = ((a.grad() * da).sum() + (b.grad() * db).sum()).item<double>();
  EXPECT_NEAR(analytic, fd, 1e-6 * std::max(1.0, std::abs(fd)));
}

}  // namespace
