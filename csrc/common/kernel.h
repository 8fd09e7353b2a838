// Registration of backend kernels: HEADSCOPE_KERNEL("op", kernel) wraps a kernel so that a
// failed allocation (ATen's allocators, operator new, a std::vector longer than max_size())
// surfaces as an out-of-memory error naming the op, instead of an anonymous bad_alloc or
// allocator message; every other error passes through unchanged.
//
//   TORCH_LIBRARY_IMPL(headscope, CPU, m) { m.impl("op", HEADSCOPE_KERNEL("op", op_cpu)); }
#pragma once

#include <c10/util/Exception.h>

#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace headscope {

// Throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python) "headscope::<op>: ...".
[[noreturn]] void throw_out_of_memory(const char* op, const std::string& cause);
// Whether a c10::Error is an allocator's report of a failed allocation.
bool is_allocation_failure(const c10::Error& e);

template <typename Op, auto Kernel>
struct GuardedKernel;

template <typename Op, typename R, typename... Args, R (*Kernel)(Args...)>
struct GuardedKernel<Op, Kernel> {
  static R call(Args... args) {
    try {
      return Kernel(std::forward<Args>(args)...);
    } catch (const c10::Error& e) {
      if (!is_allocation_failure(e)) throw;
      throw_out_of_memory(Op::name(), e.what_without_backtrace());
    } catch (const std::bad_alloc& e) {
      throw_out_of_memory(Op::name(), e.what());
    } catch (const std::length_error& e) {
      throw_out_of_memory(Op::name(), e.what());
    }
  }
};

}  // namespace headscope

#define HEADSCOPE_KERNEL(op, kernel)                                            \
  ([] {                                                                         \
    struct Op {                                                                 \
      static const char* name() { return op; }                                  \
    };                                                                          \
    return &::headscope::GuardedKernel<Op, &kernel>::call;                      \
  }())
