// Argument validation shared by every op: messages name the op, the argument,
// what was expected and what was given.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <string>

namespace headscope {

// "float32 tensor of shape [2, 3] on cpu" (works on fake/meta tensors too).
std::string describe(const at::Tensor& t);

// TORCH_CHECK with the "<op>: argument '<arg>' " prefix every message starts with.
#define HEADSCOPE_CHECK_ARG(cond, op, arg, ...) \
  TORCH_CHECK((cond), op, ": argument '", arg, "' ", __VA_ARGS__)

void check_defined(const char* op, const char* arg, const at::Tensor& t);
void check_dtype_in(const char* op, const char* arg, const at::Tensor& t,
                    std::initializer_list<at::ScalarType> allowed);
void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim);
void check_min_dim(const char* op, const char* arg, const at::Tensor& t, int64_t min_dim);
void check_same_device(const char* op, const char* arg_a, const at::Tensor& a,
                       const char* arg_b, const at::Tensor& b);
// Compares sizes[dim_a] of a with sizes[dim_b] of b (negative dims count from the end).
void check_same_size(const char* op, const char* arg_a, const at::Tensor& a, int64_t dim_a,
                     const char* arg_b, const at::Tensor& b, int64_t dim_b);
// The batch dims of a (all but its last trailing_a dims) and of b (all but its last
// trailing_b) must be equal.
void check_same_batch(const char* op, const char* arg_a, const at::Tensor& a, int64_t trailing_a,
                      const char* arg_b, const at::Tensor& b, int64_t trailing_b);
inline void check_same_batch(const char* op, const char* arg_a, const at::Tensor& a,
                             const char* arg_b, const at::Tensor& b, int64_t trailing) {
  check_same_batch(op, arg_a, a, trailing, arg_b, b, trailing);
}
// The q/k ops' softmax scale: finite when given. None stands for head_dim ** -0.5
// (1 for head_dim 0, where q k^T is 0 whatever the scale).
void check_scale(const char* op, const std::optional<double>& scale);
double scale_or_default(const std::optional<double>& scale, int64_t head_dim);

// The attention-pattern arguments of the q/k ops (common/attention_pattern.h): a window or
// chunk length `arg` >= 0 (0 or None: none), block_ids int64 (B, Tk) on ref's device (B
// from ref's dimension 0, Tk from keys' dimension tk_dim), softcap finite and > 0.
void check_pattern_length(const char* op, const char* arg, int64_t value);
void check_pattern(const char* op, const at::Tensor& ref, const char* ref_name,
                   const at::Tensor& keys, const char* keys_name, int64_t tk_dim,
                   const std::optional<int64_t>& window, const std::optional<int64_t>& chunk,
                   const std::optional<at::Tensor>& block_ids,
                   const std::optional<double>& softcap);
// chunk_origin, when given: int64 (B,) on ref's device (B from ref's dimension 0), and only
// with chunks (chunked: some chunk length > 0), where it is read.
void check_chunk_origin(const char* op, const at::Tensor& ref, const char* ref_name,
                        const std::optional<at::Tensor>& chunk_origin, bool chunked);

}  // namespace headscope
