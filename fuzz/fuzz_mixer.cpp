// libFuzzer harness for the mixer family: kl_project, kl_hvp and thin_mix.
//
// kl_project's outputs are checked against their definitions (U, V the row softmaxes of
// the references shifted by z, the gauge z[-1] = 0, the residual recomputed, W doubly
// stochastic where it converged, NaN confined to its problem); kl_hvp and thin_mix against
// float64 evaluations of their formulas; layouts against each other bitwise.
#include "fuzz_input.h"
#include "mixer/mixer.h"

namespace {

using headscope::fuzz::Input;
using headscope::fuzz::expect_close;
using headscope::fuzz::expect_same;
using headscope::fuzz::expect_within;
using headscope::fuzz::fail;
using headscope::fuzz::gamma_n;
using headscope::fuzz::runs;
using headscope::fuzz::smallest_normal;

// The largest finite magnitude in x (0 when there is none).
double largest(const at::Tensor& x) {
  auto finite = x.to(at::kDouble).abs().masked_select(at::isfinite(x));
  return finite.numel() ? finite.max().item<double>() : 0.0;
}

void fuzz_project(Input& in) {
  const int64_t batch = in.size(0, 3), n = in.size(1, 24), r = in.size(1, 8);
  const auto dtype = in.pick({at::kFloat, at::kDouble});
  auto lu = in.normal({batch, n, r}), lv = in.normal({batch, n, r});
  if (in.chance(40)) lu.select(-1, 0).add_(in.pick({-400.0, 400.0}));  // exp over/underflow
  lu = lu.to(dtype), lv = lv.to(dtype);
  if (in.chance(40)) in.sprinkle(lu);
  lu = in.layout(lu);
  lv = in.layout(lv);
  const double tol = in.pick({1e-11, 1e-8, 1e-4});
  const int64_t max_iter = in.size(1, 80);
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> out;
  if (!runs("kl_project", [&] { out = headscope::kl_project(lu, lv, tol, max_iter); }))
    fail("kl_project rejected valid input");
  auto [U, V, z, iters, residual] = out;
  auto again = headscope::kl_project(lu.contiguous(), lv.contiguous(), tol, max_iter);
  expect_same("kl_project U", U, std::get<0>(again));
  expect_same("kl_project residual", residual, std::get<4>(again));

  // (batch,): NaN in a problem makes its residual NaN, finite references give a number;
  // infinities are outside the op's contract (the Python wrapper rejects them): the op
  // returns their limit or a NaN residual, both checked no further
  auto finite = at::isfinite(lu).flatten(1).all(1) & at::isfinite(lv).flatten(1).all(1);
  auto has_nan = at::isnan(lu).flatten(1).any(1) | at::isnan(lv).flatten(1).any(1);
  auto nan_residual = at::isnan(residual);
  if (!(nan_residual.masked_select(has_nan).all().item<bool>() &&
        (~nan_residual).masked_select(finite).all().item<bool>()))
    fail("kl_project: NaN residuals do not match the problems holding NaN");
  if (!(iters.ge(1) & iters.le(max_iter)).all().item<bool>()) fail("kl_project: iters out of range");
  if (!z.select(-1, r - 1).masked_select(finite).eq(0).all().item<bool>())
    fail("kl_project: gauge z[..., -1] != 0");
  // z is returned rounded to the dtype, and exp(lu + z) moves by |z| times that rounding:
  // U and V are judged against z where this stays below 1e-6 (a problem that has not
  // converged may leave z near 1e15, where float32 z cannot say which column wins)
  const double eps = dtype == at::kDouble ? 0x1p-53 : 0x1p-24;
  auto z_rounding = z.to(at::kDouble).abs().amax(-1).mul(2 * eps);  // (batch,)
  auto judged = finite & z_rounding.le(1e-6);
  auto ok = judged.view({batch, 1, 1});
  auto keep = [&](const at::Tensor& x) { return at::where(ok, x.to(at::kDouble), 0.0); };
  auto zd = z.to(at::kDouble).unsqueeze(-2);
  const double rtol = (dtype == at::kDouble ? 1e-12 : 2e-6) + 1e-6;
  const double tiny = dtype == at::kDouble ? 1e-300 : 1e-37;  // below: subnormal, few digits
  expect_close("kl_project U", keep(U), keep(at::softmax(lu.to(at::kDouble) + zd, -1)), rtol, tiny);
  expect_close("kl_project V", keep(V), keep(at::softmax(lv.to(at::kDouble) - zd, -1)), rtol, tiny);
  if (dtype == at::kDouble) {
    // column sums of n entries differ with the order of summation by about n ulps of a sum
    auto recomputed = (U.sum(-2) - V.sum(-2)).abs().amax(-1);
    const double sums_rounding = 4 * n * 0x1p-53 * largest(U.sum(-2));
    expect_close("kl_project residual", at::where(finite, residual, 0.0),
                 at::where(finite, recomputed, 0.0), 1e-6, sums_rounding);
  }
  // where converged, W = U diag(1/g) V^T has rows and columns summing to 1, unless a
  // column of the factors falls below the dtype's normal range (float32: e^-87)
  auto Ud = U.to(at::kDouble), Vd = V.to(at::kDouble);
  auto W = at::matmul(Ud / Ud.sum(-2, true), Vd.mT());
  const double normal = dtype == at::kDouble ? 1e-300 : 1e-37;
  auto representable = at::minimum(Ud.sum(-2), Vd.sum(-2)).amin(-1).gt(normal);
  auto converged = (finite & residual.le(tol) & representable).view({batch, 1});
  const double sum_tol = (dtype == at::kDouble ? 1e-9 : 1e-5) * n / r + tol * n;
  for (auto sums : {W.sum(-1), W.sum(-2)})
    expect_close("kl_project W sums", at::where(converged, sums, 1.0), at::ones_like(sums), 0, sum_tol);
}

void fuzz_hvp_and_mix(Input& in) {
  const int64_t batch = in.size(0, 3), n = in.size(1, 40), m = in.size(1, 40);
  const int64_t r = in.size(1, 8), d = in.size(1, 24);
  const auto dtype = in.pick({at::kFloat, at::kDouble});
  auto U = at::softmax(in.normal({batch, n, r}), -1).to(dtype);
  auto V = at::softmax(in.normal({batch, m, r}), -1).to(dtype);

  auto s = in.layout(in.normal({batch, r}).to(dtype));
  if (n == m) {
    at::Tensor hs;
    auto Ul = in.layout(U);
    if (!runs("kl_hvp", [&] { hs = headscope::kl_hvp(Ul, V, s); })) fail("kl_hvp rejected valid input");
    auto Ud = Ul.to(at::kDouble), Vd = V.to(at::kDouble), sd = s.to(at::kDouble);
    auto Hs = (Ud.sum(-2) + Vd.sum(-2)) * sd -
              at::matmul(Ud.mT(), at::matmul(Ud, sd.unsqueeze(-1))).squeeze(-1) -
              at::matmul(Vd.mT(), at::matmul(Vd, sd.unsqueeze(-1))).squeeze(-1);
    // U and V are positive: the same products with |s| are the terms' magnitudes; column sums,
    // dot products over r, sums over n and the two differences take at most n + r + 4
    // roundings, and Hs cancels (exactly 0 for s along the gauge)
    auto sa = sd.abs();
    auto magnitude = (Ud.sum(-2) + Vd.sum(-2)) * sa +
                     at::matmul(Ud.mT(), at::matmul(Ud, sa.unsqueeze(-1))).squeeze(-1) +
                     at::matmul(Vd.mT(), at::matmul(Vd, sa.unsqueeze(-1))).squeeze(-1);
    expect_within("kl_hvp", hs, Hs,
                  magnitude * gamma_n(n + r + 4, dtype) +
                      (n + r + 4) * smallest_normal(dtype) * (1 + largest(sd)));
  }

  const auto x_dtype = dtype == at::kDouble ? at::kDouble : in.pick({at::kFloat, at::kHalf, at::kBFloat16});
  auto X = in.normal({batch, m, d}).to(x_dtype);
  if (in.chance(30)) in.sprinkle(X);
  X = in.layout(X);
  auto Ul = in.layout(U), Vl = in.layout(V);
  at::Tensor Y;
  if (!runs("thin_mix", [&] { Y = headscope::thin_mix(Ul, Vl, X); })) fail("thin_mix rejected valid input");
  if (Y.scalar_type() != x_dtype) fail("thin_mix: result dtype differs from X's");
  // two BLAS products: another layout may take another GEMM kernel, so equal to rounding
  auto Yc = headscope::thin_mix(Ul.contiguous(), Vl.contiguous(), X.contiguous());
  auto Ud = Ul.to(at::kDouble), Xd = X.to(at::kDouble);
  auto mixing = at::matmul(Ud / Ud.sum(-2, true), Vl.to(at::kDouble).mT());  // W >= 0, (n, m)
  auto want = at::matmul(mixing, Xd);
  // W's entries are positive, so W |X| is the terms' magnitude: U's column sums (n terms),
  // the division, the products over r and the sums over m take at most n + m + r + 4
  // roundings in the accumulation dtype, whatever the order; X of either sign lets Y
  // cancel. A float16 or bfloat16 Y is then rounded once more, relative to itself (and by
  // half a step of float16's subnormals).
  const double stored = x_dtype == at::kHalf ? 0x1p-11 : x_dtype == at::kBFloat16 ? 0x1p-8 : 0.0;
  const double stored_floor = x_dtype == at::kHalf ? 0x1p-25 : 0.0;
  auto bound = at::matmul(mixing, Xd.abs()) * gamma_n(n + m + r + 4, x_dtype) +
               want.abs() * stored + stored_floor +
               (n + m + r + 4) * smallest_normal(x_dtype) * (1 + largest(X));
  // with infinities in X, which entries come out inf and which NaN (0 * inf) depends on the
  // order of the products; that they are not finite does not
  auto non_finite_as_nan = [](const at::Tensor& t) {
    auto d = t.to(at::kDouble);
    return at::where(at::isfinite(d), d, at::full({}, NAN, d.options()));
  };
  want = non_finite_as_nan(want);
  expect_within("thin_mix", non_finite_as_nan(Y), want, bound);
  expect_within("thin_mix (contiguous)", non_finite_as_nan(Yc), want, bound);
}

// Spoilt shapes and dtypes: an error naming the op, never a crash or a result.
void fuzz_errors(Input& in) {
  const int64_t n = in.size(0, 4), r = in.size(0, 3);
  auto dtype = in.pick({at::kFloat, at::kInt, at::kHalf, at::kComplexDouble});
  auto a = at::rand({2, n, r}).to(dtype);
  auto b = at::rand({2, n + in.size(0, 1), r + in.size(0, 1)}).to(in.chance(200) ? dtype : at::kDouble);
  const int64_t max_iter = in.size(-2, 5);
  const bool valid = (dtype == at::kFloat) && b.scalar_type() == dtype && b.sizes().equals(a.sizes()) &&
                     r >= 1 && max_iter >= 0;
  const bool ok = runs("kl_project", [&] { headscope::kl_project(a, b, 1e-8, max_iter); });
  if (ok && !valid) fail("kl_project accepted spoilt input");
  runs("thin_mix", [&] { headscope::thin_mix(a, b, at::rand({2, b.size(1), 3})); });
  runs("kl_hvp", [&] { headscope::kl_hvp(a, b, at::rand({2, r})); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  headscope::fuzz::tally(data, size);
  Input in(data, size);
  in.configure_torch();
  switch (in.size(0, 3)) {
    case 0: fuzz_errors(in); break;
    case 1: fuzz_hvp_and_mix(in); break;
    default: fuzz_project(in); break;
  }
  return 0;
}
