// HEADSCOPE_HD marks functions that nvcc compiles for both host and device; other
// compilers see plain inline C++.
#pragma once

#if defined(__CUDACC__)
#define HEADSCOPE_HD __host__ __device__
#else
#define HEADSCOPE_HD
#endif
