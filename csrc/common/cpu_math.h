// Small CPU math helpers written so that the compiler vectorises the loops that
// call them (no branches, no library calls).
#pragma once

#include <cstdint>
#include <cstring>

namespace headscope {

// exp(x) for x in [-700, 0], within about 2 ulp of std::exp: x = k ln2 + f with
// |f| <= ln2 / 2, e^f by its Taylor series to degree 13 (truncation < 1e-17), and
// 2^k assembled in the exponent bits. Arguments outside the range give meaningless
// values (never undefined behaviour): callers check their ranges before using results.
inline double exp_nonpositive(double x) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer
  const double t = x * kLog2e + kShifter;
  const double k = t - kShifter;
  const double f = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * f + 1.0 / 479001600.0;
  p = p * f + 1.0 / 39916800.0;
  p = p * f + 1.0 / 3628800.0;
  p = p * f + 1.0 / 362880.0;
  p = p * f + 1.0 / 40320.0;
  p = p * f + 1.0 / 5040.0;
  p = p * f + 1.0 / 720.0;
  p = p * f + 1.0 / 120.0;
  p = p * f + 1.0 / 24.0;
  p = p * f + 1.0 / 6.0;
  p = p * f + 0.5;
  p = p * f + 1.0;
  p = p * f + 1.0;
  int64_t ti, si;
  std::memcpy(&ti, &t, sizeof ti);
  std::memcpy(&si, &kShifter, sizeof si);
  const uint64_t bits = static_cast<uint64_t>(ti - si + 1023) << 52;  // 2^k
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace headscope
