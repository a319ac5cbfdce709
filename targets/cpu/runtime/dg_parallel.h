// dg_parallel.h - thread count control for deepgen-generated C++ code.
//
// Kernels parallelize with OpenMP when the project is compiled with it
// (-fopenmp defines _OPENMP).  Without OpenMP everything runs on the calling
// thread and the thread count is always 1.
//
//   dg::set_num_threads(2);        // use two threads from now on
//   int n = dg::get_num_threads(); // threads a parallel kernel may use
//
// A kernel decides whether a loop is worth splitting with worth_threads() or
// threads_for(): a parallel region costs microseconds to start and to join, so
// small loops run faster on one thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dg {

// The count set by set_num_threads, 0 while unset.  One setting for the whole
// module, whichever thread calls: omp_set_num_threads would only change the
// calling thread's setting, and Python may call a model from several threads.
inline std::atomic<int>& thread_setting() {
  static std::atomic<int> n{0};
  return n;
}

// Sets the number of threads later parallel kernels use (n >= 1).  Without
// OpenMP any n >= 1 is accepted and ignored.
inline void set_num_threads(int n) {
  if (n < 1) {
    throw std::invalid_argument("dg::set_num_threads: the number of threads must be >= 1, got " +
                                std::to_string(n));
  }
  thread_setting().store(n);
}

// The number of threads parallel kernels use (set_num_threads, else OpenMP's
// default: OMP_NUM_THREADS or the number of cores); always 1 without OpenMP.
inline int get_num_threads() {
#ifdef _OPENMP
  const int n = thread_setting().load();
  return n > 0 ? n : omp_get_max_threads();
#else
  return 1;
#endif
}

// Work below which a kernel should stay on one thread, counted in simple float
// operations: a GEMM's 2*M*N*K, an elementwise loop's elements times the
// operations per element.  Starting and joining a parallel region costs about
// 1-5 microseconds; 2^20 operations take one core some 13 microseconds in a
// GEMM (80 GFLOP/s) and longer in memory-bound loops, so smaller loops gain
// little or nothing from a second thread.
constexpr int64_t kMinParallelWork = int64_t(1) << 20;

// How many threads a kernel doing `work` operations should use: 1 when the
// work is below kMinParallelWork or when called from inside a parallel region
// (kernels never nest parallel regions), else get_num_threads().
inline int threads_for(int64_t work) {
#ifdef _OPENMP
  if (work < kMinParallelWork || omp_in_parallel()) return 1;
  return get_num_threads();
#else
  (void)work;
  return 1;
#endif
}

// True when a loop doing `work` operations (see kMinParallelWork) is worth
// splitting over threads, e.g. for an elementwise loop over n floats:
//   #pragma omp parallel for if (dg::worth_threads(n * ops_per_element))
inline bool worth_threads(int64_t work) {
  return threads_for(work) > 1;
}

}  // namespace dg
