// headscope's C++ API: one include for every op family. Each function calls the
// op through the dispatcher, so CPU, CUDA and autograd kernels all apply.
#pragma once

#include "mixer/mixer.h"
#include "vas/vas.h"
#include "attribution/attribution.h"
