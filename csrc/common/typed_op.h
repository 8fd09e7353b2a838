// How the C++ API reaches its ops: the dispatcher's typed handle, with the call signature
// taken from the API function's own declaration, so that the two cannot drift apart (a
// mismatch with the schema fails at the first call, naming both signatures).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace headscope {

template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

}  // namespace headscope

// The handle of headscope::<name>, typed as the C++ API function headscope::<name>.
#define HEADSCOPE_TYPED_OP(name) ::headscope::typed_op<decltype(::headscope::name)>("headscope::" #name)
