// dg_matmul.h: the matrix products generated code calls (matmul, matmul_tn,
// matmul_nt, batched_matmul), all on dg::gemm (dg_gemm.h), and update_rows, a
// parameter's update run inside the product that makes its gradient.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "dg_gemm.h"
#include "dg_parallel.h"

namespace dg {

// c[M,N] = a[M,K] @ b[K,N]; c is overwritten.  All three matmuls run dg::gemm
// (dg_gemm.h: packed, cache-blocked, SIMD, threaded with OpenMP); `epi`, when
// given, is called on each finished piece of c (see dg_gemm.h), e.g. to add a
// bias and apply an activation while the piece is still in cache.
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
  gemm(false, false, M, N, K, a, K, b, N, c, N, epi);
}

// c[M,N] = a[M,K] @ b for a b packed once before a loop (dg_gemm.h: PackedB).
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const PackedB& b, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
  if (b.K() != K || b.N() != N) {
    throw std::invalid_argument("dg::matmul: the packed right operand is [" + std::to_string(b.K()) + ", " +
                                std::to_string(b.N()) + "], the product needs [" + std::to_string(K) + ", " +
                                std::to_string(N) + "]");
  }
  gemm(false, M, a, K, b, c, N, epi);
}

// c[M,N] = a[M,K] @ b^T for a b^T packed once before a loop (PackedB made with tb = true).
template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const PackedB& b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
  matmul(a, b, c, M, K, N, epi);
}

// c[M,N] = a^T @ b where a is stored [K,M] and b is [K,N] (a weight gradient:
// activations^T @ output gradient); c is overwritten.
template <class Epilogue = NoEpilogue>
void matmul_tn(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
  gemm(true, false, M, N, K, a, M, b, N, c, N, epi);
}

// c[M,N] = a @ b^T where a is [M,K] and b is stored [N,K] (an input gradient:
// output gradient @ weights^T); c is overwritten.
template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
  gemm(false, true, M, N, K, a, K, b, K, c, N, epi);
}

// A parameter's optimizer step run by the GEMM that makes its gradient, as its
// row-block epilogue (dg_gemm.h): once a block of the gradient's rows is
// complete, update(at, g, n) steps elements [at, at + n) of the parameter and
// of its optimizer state (laid out like it) from g[0..n), the gradient there,
// while that block is still in cache; and while the kernels compute a block,
// the next block's rows of each of `arrays` (the parameter, then its state)
// are prefetched, a share per kernel call, so the update finds them in L2
// rather than waiting on L3 (a separate pass after the product streams all of
// them from L3).  With `apply` false the GEMM only makes the gradient
// (compute_gradients()).  Each element is updated once from the same sum, so
// the result is the same as the update's own pass after the product.
template <class Update, size_t Arrays>
struct UpdateRows {
  static constexpr bool kRowBlocks = true;
  bool apply;
  int64_t ld;  // the parameter's row length: the gradient's N
  std::array<const float*, Arrays> arrays;
  Update update;

  void rows_done(int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* g, int64_t ldg) const {
    if (!apply) return;
    if (c0 == 0 && c1 == ld && ldg == ld) {  // whole rows: one stretch of the parameter
      update(r0 * ld, g, (r1 - r0) * ld);
      return;
    }
    for (int64_t r = r0; r < r1; ++r)
      update(r * ld + c0, g + (r - r0) * ldg, c1 - c0);
  }
  void prefetch(int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t part, int64_t parts) const {
    if (!apply) return;
    // The block's 64-byte lines, row after row, numbered 0 .. lines - 1: this part's share.
    const int64_t row_lines = ((c1 - c0) * int64_t(sizeof(float)) + 63) / 64;
    const int64_t lines = (r1 - r0) * row_lines;
    for (int64_t l = lines * part / parts, end = lines * (part + 1) / parts; l < end; ++l) {
      const int64_t at = (r0 + l / row_lines) * ld + c0 + (l % row_lines) * 16;
      for (const float* a : arrays) {
#if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch(a + at, 0, 2);  // to L2 (prefetcht1 on x86)
#else
        (void)a;
#endif
      }
    }
  }
};

// dg::matmul_tn(x, dy, dw, ..., dg::update_rows(apply, ld, update, w, w_state...)).
template <class Update, class... Arrays>
UpdateRows<Update, sizeof...(Arrays)> update_rows(bool apply, int64_t ld, Update update,
                                                  const Arrays*... arrays) {
  return {apply, ld, {arrays...}, update};
}

// c[i] = op(a[i]) @ op(b[i]) for i in [0, batch): a is [batch, M, K] (stored
// [batch, K, M] when ta), b [batch, K, N] (stored [batch, N, K] when tb), c
// [batch, M, N] (attention's scores q @ k^T and its weighted sum of v).  Many
// small products run one per thread (each gemm then stays serial, as gemm does
// inside a parallel region); a few large ones run in turn, each gemm threaded.
// Either way every product is the same serial-or-threaded gemm, whose results
// do not depend on the thread count.
inline void batched_matmul(const float* a, const float* b, float* c, int64_t batch, int64_t M, int64_t K,
                           int64_t N, bool ta, bool tb) {
  const int64_t a_step = M * K, b_step = K * N, c_step = M * N;
  const double flops = 2.0 * double(batch) * double(M) * double(N) * double(K);
  const int threads = threads_for(flops < 1e18 ? int64_t(flops) : int64_t(1e18));
  const bool per_thread = threads > 1 && batch >= threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (per_thread)
#else
  (void)per_thread;
#endif
  for (int64_t i = 0; i < batch; ++i) {
    gemm(ta, tb, M, N, K, a + i * a_step, ta ? M : K, b + i * b_step, tb ? K : N, c + i * c_step, N);
  }
}

}  // namespace dg
