#include "common/kernel.h"

#include <cstdlib>

namespace headscope {

void throw_out_of_memory(const char* op, const std::string& cause) {
  TORCH_CHECK_WITH(OutOfMemoryError, false, "headscope::", op,
                   ": out of memory: could not allocate the result or the scratch space for "
                   "these sizes (", cause, ")");
  std::abort();  // unreachable: TORCH_CHECK_WITH(..., false, ...) throws
}

bool is_allocation_failure(const c10::Error& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  // ATen's CPU allocator reports through a plain c10::Error with this wording.
  return e.msg().find("can't allocate memory") != std::string::npos;
}

}  // namespace headscope
