// Helpers shared by the GoogleTest files.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace headscope::testing {

// The message of the c10::Error that f throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace headscope::testing
