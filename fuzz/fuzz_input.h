// Decoding of libFuzzer's bytes into op arguments, and the checks every harness makes.
//
// A harness draws sizes, dtypes, layouts and values from the bytes, then calls an op
// through headscope's C++ API. Valid arguments must give the double-precision reference's
// numbers; arguments the harness deliberately spoils must give a c10::Error naming the op.
// Anything else (a crash, a sanitizer report, an error that names no op, a wrong number)
// aborts, which libFuzzer records as a finding.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

namespace headscope::fuzz {

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "headscope fuzz finding: %s\n", what.c_str());
  std::abort();
}

// The unit roundoff of the arithmetic the ops do on inputs of `dtype`: float64 for float64,
// float32 otherwise (float16 and bfloat16 are converted to float32 as they are read).
inline double unit_roundoff(at::ScalarType dtype) {
  return dtype == at::kDouble ? 0x1p-53 : 0x1p-24;
}

// gamma_n = n u / (1 - n u): a value reached through at most n roundings of relative size u
// in a chain of sums and products (a sum of n terms in any order, a dot product of n - 1)
// is within gamma_n of the sum of its terms' magnitudes (Higham, "Accuracy and Stability of
// Numerical Algorithms", 3.1 and 4.2). The bound scales with sum |term|, not |result|: a
// sum that cancels keeps the absolute error of its terms.
inline double gamma_n(int64_t n, at::ScalarType dtype) {
  const double nu = static_cast<double>(n) * unit_roundoff(dtype);
  return nu / (1 - nu);
}

// The smallest normal number of that arithmetic: below it a rounding (or a flush to zero)
// errs by up to this much absolutely, whatever the relative bound says.
inline double smallest_normal(at::ScalarType dtype) {
  return dtype == at::kDouble ? 0x1p-1022 : 0x1p-126;
}

class Input {
 public:
  Input(const uint8_t* data, size_t size) : bytes_(data, size) {}

  int64_t size(int64_t lo, int64_t hi) { return bytes_.ConsumeIntegralInRange<int64_t>(lo, hi); }
  bool chance(uint8_t in_256) { return bytes_.ConsumeIntegral<uint8_t>() < in_256; }
  double real(double lo, double hi) { return bytes_.ConsumeFloatingPointInRange(lo, hi); }
  template <typename T, size_t N>
  T pick(const T (&choices)[N]) { return bytes_.PickValueInArray(choices); }

  // Standard normal values times a scale drawn from the bytes, from a seed in the bytes
  // (a few bytes steer a whole tensor), in double; the caller converts.
  at::Tensor normal(at::IntArrayRef shape) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(bytes_.ConsumeIntegral<uint32_t>());
    return at::randn(shape, gen, at::kDouble) * pick({0.01, 0.3, 1.0, 3.0, 30.0});
  }

  // The same values in another memory layout: contiguous, a transposed copy viewed back,
  // every other element of a wider buffer, or (values changed) the first slice broadcast
  // with stride 0 along dimension 0.
  at::Tensor layout(const at::Tensor& x) {
    switch (x.dim() < 2 ? 0 : size(0, 3)) {
      case 1: return x.transpose(0, 1).contiguous().transpose(0, 1);
      case 2: {
        auto wide_shape = x.sizes().vec();
        wide_shape.back() *= 2;
        auto wide = at::empty(wide_shape, x.options());
        auto view = wide.slice(-1, 0, wide_shape.back(), 2);
        view.copy_(x);
        return view;
      }
      case 3: return x.narrow(0, 0, std::min<int64_t>(x.size(0), 1)).expand(x.sizes());
      default: return x;
    }
  }

  // Writes up to three NaN / +-Inf values at positions from the bytes (x contiguous).
  void sprinkle(at::Tensor& x) {
    if (x.numel() == 0) return;
    auto flat = x.view(-1);
    for (int64_t n = size(0, 3); n > 0; --n)
      flat[size(0, x.numel() - 1)] = pick({double(NAN), double(INFINITY), -double(INFINITY)});
  }

  // The arguments of the qk ops: q (B, H, Tq, D) (sometimes holding NaN/Inf) and k
  // (B, Hkv, Tk, D) in drawn layouts, causal, a key padding mask or none, and a scale;
  // nothing when the drawn Hkv does not divide H.
  struct QK {
    at::Tensor q, k;
    bool causal;
    std::optional<at::Tensor> key_padding_mask;
    double scale;
    // the attention pattern (none when unset)
    std::optional<int64_t> window, chunk;
    std::optional<at::Tensor> block_ids;
    std::optional<double> softcap;
    bool window_bounds_blocks = true;
    std::optional<at::Tensor> chunk_origin;  // (B,) int64, only with a chunk

    // (B, 1, Tq, Tk): the keys the pattern (not the padding) hides from each query, query i
    // at key position Tk - Tq + i, from the definition: keys up to p - window, keys of
    // another chunk (chunks counted from chunk_origin, else the leading padding), keys after
    // a causal query
    // outside its block; with window_bounds_blocks false, never a key of its block.
    at::Tensor hidden(int64_t Tq, int64_t Tk) const {
      const int64_t B = q.size(0);
      auto p = (at::arange(Tq, at::kLong) + (Tk - Tq)).view({1, Tq, 1});
      auto j = at::arange(Tk, at::kLong).view({1, 1, Tk});
      auto h = (causal ? j > p : at::zeros({1, Tq, Tk}, at::kBool)).expand({B, Tq, Tk});
      auto same_block = at::zeros({B, Tq, Tk}, at::kBool);
      if (causal && block_ids) {
        auto pos = p.view({1, Tq}).expand({B, Tq});
        auto qb = at::where(pos >= 0, block_ids->gather(1, pos.clamp(0, Tk - 1)),
                            at::full({}, -1, at::kLong)).unsqueeze(2);  // (B, Tq, 1)
        same_block = (qb >= 0) & (qb == block_ids->unsqueeze(1));
        h = h & ~same_block;
      }
      if (window && *window > 0) h = h | (j <= p - *window);
      if (chunk && *chunk > 0) {
        auto origin = chunk_origin ? chunk_origin->view({B, 1, 1})
                      : key_padding_mask
                          ? key_padding_mask->to(at::kLong).cumprod(1).sum(1).view({B, 1, 1})
                          : at::zeros({B, 1, 1}, at::kLong);
        h = h | (at::div(j - origin, *chunk, "floor") != at::div(p - origin, *chunk, "floor"));
      }
      // PaliGemma 2: the block is seen whatever the window and chunks
      if (!window_bounds_blocks) h = h & ~same_block;
      return h.unsqueeze(1);
    }
    // Logits soft-capped as documented: cap tanh(l / cap), a non-finite logit NaN.
    at::Tensor capped(const at::Tensor& logits) const {
      if (!softcap) return logits;
      return at::where(at::isfinite(logits), (logits / *softcap).tanh() * *softcap,
                       at::full({}, NAN, logits.options()));
    }
    // (B, H, Tq, 1): a bound on the relative error of each query row's probabilities as an
    // op computes them in `dtype`'s arithmetic. A logit is a dot product of D terms times
    // the scale, off by gamma_{D+1} scale sum_d |q_d k_d| (a bound that holds however the
    // logit cancels), and the soft cap and the shift by the row's largest logit add a few
    // roundings of that size; a softmax moves a probability by at most twice its row's
    // largest logit error, relatively, and exp and the normaliser (a sum of Tk terms,
    // divided) by gamma_{Tk+8}. Non-finite entries are left out: their rows are NaN or
    // their keys hidden.
    at::Tensor probability_error(at::ScalarType dtype) const {
      auto finite_abs = [](const at::Tensor& x) {
        auto a = x.to(at::kDouble).abs();
        return at::where(at::isfinite(a), a, at::zeros({}, a.options()));
      };
      auto ka = finite_abs(k).repeat_interleave(q.size(1) / k.size(1), 1);
      auto largest_logit = at::matmul(finite_abs(q), ka.mT()).mul(scale).amax(-1, true);
      return largest_logit * (2 * gamma_n(q.size(3) + 1, dtype) + 8 * unit_roundoff(dtype)) +
             gamma_n(k.size(2) + 8, dtype);
    }
  };
  std::optional<QK> qk(int64_t B, int64_t H, int64_t Tq, int64_t Tk, int64_t max_D,
                       at::ScalarType dtype) {
    const int64_t Hkv = pick({1, 2, 4}), D = size(1, max_D);
    if (H % Hkv) return std::nullopt;
    QK a;
    a.q = normal({B, H, Tq, D}).to(dtype);
    if (chance(40)) sprinkle(a.q);
    a.q = layout(a.q);
    a.k = layout(normal({B, Hkv, Tk, D}).to(dtype));
    a.causal = chance(128);
    if (chance(64)) a.key_padding_mask = at::rand({B, Tk}) < real(0, 1);
    a.scale = real(0.01, 1.0);
    if (chance(64)) a.window = size(0, Tk + 2);  // 0: none
    if (chance(64)) a.chunk = size(0, Tk + 2);
    // where each row's chunks start: before the keys (a cache past them), inside, or after
    if (a.chunk && *a.chunk > 0 && chance(128))
      a.chunk_origin = at::randint(-3 * Tk - 3, 3 * Tk + 4, {B}, at::kLong);
    if (chance(64)) {  // 1 to 3 blocks per row; ids reused, so a block may have gaps
      a.block_ids = at::full({B, Tk}, -1, at::kLong);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t n = size(1, 3); n > 0; --n) {
          const int64_t s = size(0, Tk - 1);
          a.block_ids->select(0, b).narrow(0, s, size(1, Tk - s)).fill_(size(0, 1));
        }
    }
    if (chance(48)) a.softcap = pick({0.5, 2.0, 30.0});
    a.window_bounds_blocks = !chance(64);
    return a;
  }

  // Sets torch's CPU thread count from the bytes (1 or 2), or to HEADSCOPE_FUZZ_THREADS when
  // set (CI: one thread, so that threads racing on the coverage counts do not steer the run),
  // and seeds torch's generator from the bytes, so that the input alone decides the call.
  void configure_torch() {
    const int64_t drawn = size(1, 2);
    const char* fixed = std::getenv("HEADSCOPE_FUZZ_THREADS");
    at::set_num_threads(fixed != nullptr ? std::atoi(fixed) : static_cast<int>(drawn));
    at::manual_seed(size(0, 1 << 20));
  }

 private:
  FuzzedDataProvider bytes_;
};

// Counts the inputs this process runs and digests them, order aside (the sum of each
// input's FNV-1a hash), and with HEADSCOPE_FUZZ_TALLY set prints both at exit: the proof
// that two runs of scripts/fuzz.sh's repeatable mode ran the same inputs. Each harness
// calls it first.
inline void tally(const uint8_t* data, size_t size) {
  static struct Tally {
    uint64_t inputs = 0, digest = 0;
    ~Tally() {
      if (std::getenv("HEADSCOPE_FUZZ_TALLY") != nullptr)
        std::fprintf(stderr, "headscope fuzz tally: %llu inputs, digest %016llx\n",
                     static_cast<unsigned long long>(inputs), static_cast<unsigned long long>(digest));
    }
  } t;
  uint64_t h = 0xcbf29ce484222325ULL ^ size;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 0x100000001b3ULL;
  ++t.inputs;
  t.digest += h;
}

// Runs the call; a c10::Error is fine when it names the op (headscope::<op>), anything else
// is a finding. Returns whether the call succeeded.
template <typename F>
bool runs(const char* op, F&& call) {
  try {
    call();
    return true;
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    if (msg.find(std::string("headscope::") + op) == std::string::npos)
      fail(std::string(op) + " raised an error that does not name it: " + msg);
    return false;
  }
}

// A tolerance no tighter than the rounding of a result stored in `dtype`.
inline double at_least_rounding(double tol, at::ScalarType dtype) {
  const double eps = dtype == at::kHalf ? 0x1p-11 : dtype == at::kBFloat16 ? 0x1p-8
                   : dtype == at::kFloat ? 0x1p-24 : 0x1p-53;
  return std::max(tol, 2 * eps);
}

// |got - want| <= bound everywhere (bound broadcast to want's shape), NaN where want is NaN.
inline void expect_within(const char* what, const at::Tensor& got, const at::Tensor& want,
                          const at::Tensor& bound) {
  auto g = got.to(at::kDouble), w = want.to(at::kDouble);
  if (!g.sizes().equals(w.sizes()))
    fail(std::string(what) + ": shape " + c10::str(g.sizes()) + ", expected " + c10::str(w.sizes()));
  auto nan_ok = at::isnan(w).eq(at::isnan(g)).all().item<bool>();
  // excess over the bound; 0 where equal (infinities included) or NaN in both
  auto excess = at::where(g.eq(w) | at::isnan(w), at::zeros_like(g),
                          (g - w).abs().sub(bound.to(at::kDouble)));
  auto close = excess.le(0).all().item<bool>();
  if (!nan_ok || !close) {
    fail(std::string(what) + ": result differs from the reference; largest excess " +
         std::to_string(excess.nan_to_num(INFINITY).max().item<double>()) + "\n got   " +
         c10::str(g) + "\n want  " + c10::str(w) + "\n bound " + c10::str(bound));
  }
}

// |got - want| <= atol + rtol |want| everywhere, NaN where want is NaN: for results whose
// error scales with their own size (no sum of terms of either sign).
inline void expect_close(const char* what, const at::Tensor& got, const at::Tensor& want,
                         double rtol, double atol) {
  expect_within(what, got, want, want.to(at::kDouble).abs().mul(rtol).add(atol));
}

// Bitwise equality of two results (NaN equal to NaN).
inline void expect_same(const char* what, const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes()) ||
      !(a.eq(b) | (at::isnan(a) & at::isnan(b))).all().item<bool>())
    fail(std::string(what) + ": results differ between memory layouts");
}

}  // namespace headscope::fuzz
