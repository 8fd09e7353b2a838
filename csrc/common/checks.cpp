#include "common/checks.h"

#include <c10/core/ScalarType.h>

#include <cmath>
#include <sstream>

namespace headscope {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << " tensor of shape " << t.sym_sizes() << " on "
     << t.device();
  return os.str();
}

void check_defined(const char* op, const char* arg, const at::Tensor& t) {
  HEADSCOPE_CHECK_ARG(t.defined(), op, arg, "must be a tensor, got None");
}

void check_dtype_in(const char* op, const char* arg, const at::Tensor& t,
                    std::initializer_list<at::ScalarType> allowed) {
  check_defined(op, arg, t);
  for (auto s : allowed)
    if (t.scalar_type() == s) return;
  std::ostringstream want;
  const char* sep = "";
  for (auto s : allowed) {
    want << sep << c10::toString(s);
    sep = " or ";
  }
  HEADSCOPE_CHECK_ARG(false, op, arg, "must have dtype ", want.str(), ", got ", describe(t));
}

void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim) {
  check_defined(op, arg, t);
  HEADSCOPE_CHECK_ARG(t.dim() == dim, op, arg, "must have ", dim, " dimensions, got ",
                      describe(t));
}

void check_min_dim(const char* op, const char* arg, const at::Tensor& t, int64_t min_dim) {
  check_defined(op, arg, t);
  HEADSCOPE_CHECK_ARG(t.dim() >= min_dim, op, arg, "must have at least ", min_dim,
                      " dimensions, got ", describe(t));
}

void check_same_device(const char* op, const char* arg_a, const at::Tensor& a,
                       const char* arg_b, const at::Tensor& b) {
  HEADSCOPE_CHECK_ARG(a.device() == b.device(), op, arg_b, "must be on the same device as '",
                      arg_a, "' (", a.device(), "), got ", describe(b));
}

void check_same_size(const char* op, const char* arg_a, const at::Tensor& a, int64_t dim_a,
                     const char* arg_b, const at::Tensor& b, int64_t dim_b) {
  const auto da = dim_a < 0 ? dim_a + a.dim() : dim_a;
  const auto db = dim_b < 0 ? dim_b + b.dim() : dim_b;
  HEADSCOPE_CHECK_ARG(a.sym_size(da) == b.sym_size(db), op, arg_b, "must have size ",
                      a.sym_size(da), " in dimension ", db, " (size ", da, " of '", arg_a,
                      "'), got ", describe(b));
}

void check_same_batch(const char* op, const char* arg_a, const at::Tensor& a, int64_t trailing_a,
                      const char* arg_b, const at::Tensor& b, int64_t trailing_b) {
  const auto batch_a = a.sym_sizes().slice(0, a.dim() - trailing_a);
  const auto batch_b = b.sym_sizes().slice(0, b.dim() - trailing_b);
  HEADSCOPE_CHECK_ARG(batch_a.equals(batch_b), op, arg_b, "must have the batch dimensions ",
                      batch_a, " of '", arg_a, "', got ", describe(b));
}

void check_scale(const char* op, const std::optional<double>& scale) {
  HEADSCOPE_CHECK_ARG(!scale.has_value() || std::isfinite(*scale), op, "scale",
                      "must be finite, got ", *scale);
}

double scale_or_default(const std::optional<double>& scale, int64_t head_dim) {
  if (scale.has_value()) return *scale;
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

void check_pattern_length(const char* op, const char* arg, int64_t value) {
  HEADSCOPE_CHECK_ARG(value >= 0, op, arg, "must be >= 0 (0 or None: none), got ", value);
}

void check_pattern(const char* op, const at::Tensor& ref, const char* ref_name,
                   const at::Tensor& keys, const char* keys_name, int64_t tk_dim,
                   const std::optional<int64_t>& window, const std::optional<int64_t>& chunk,
                   const std::optional<at::Tensor>& block_ids,
                   const std::optional<double>& softcap) {
  if (window.has_value()) check_pattern_length(op, "window", *window);
  if (chunk.has_value()) check_pattern_length(op, "chunk", *chunk);
  if (block_ids.has_value() && block_ids->defined()) {
    const auto& ids = *block_ids;
    check_dtype_in(op, "block_ids", ids, {at::kLong});
    check_dim(op, "block_ids", ids, 2);
    check_same_device(op, ref_name, ref, "block_ids", ids);
    check_same_size(op, ref_name, ref, 0, "block_ids", ids, 0);
    check_same_size(op, keys_name, keys, tk_dim, "block_ids", ids, 1);
  }
  HEADSCOPE_CHECK_ARG(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0), op,
                      "softcap", "must be finite and > 0, got ", *softcap);
}

void check_chunk_origin(const char* op, const at::Tensor& ref, const char* ref_name,
                        const std::optional<at::Tensor>& chunk_origin, bool chunked) {
  if (!chunk_origin.has_value() || !chunk_origin->defined()) return;
  const auto& origin = *chunk_origin;
  HEADSCOPE_CHECK_ARG(chunked, op, "chunk_origin",
                      "must come with a 'chunk' > 0 (it says where each row's chunks "
                      "start), got no chunk");
  check_dtype_in(op, "chunk_origin", origin, {at::kLong});
  check_dim(op, "chunk_origin", origin, 1);
  check_same_device(op, ref_name, ref, "chunk_origin", origin);
  check_same_size(op, ref_name, ref, 0, "chunk_origin", origin, 0);
}

}  // namespace headscope
