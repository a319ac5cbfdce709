// dg_cuda_gemm.h: matrix products on the GPU for deepgen's CUDA target.
//
//   matmul(a, b, c, M, K, N[, epilogue])     c[M,N] = a[M,K] @ b[K,N]
//   matmul_tn(a, b, c, M, K, N[, epilogue])  c = a^T @ b, a stored [K,M]
//   matmul_nt(a, b, c, M, K, N[, epilogue])  c = a @ b^T, b stored [N,K]
//   batched_matmul(a, b, c, batch, M, K, N, ta, tb)  one product per batch index
//
// (the CPU runtime's names and arguments; the pointers are device pointers).
// An epilogue is a functor generated from the graph (a bias, an activation):
// called as ep(row, col, &value, 1) on each output once its full K sum is
// done, before the store, so bias + activation cost no extra pass.
//
// The kernel is a classic shared-memory tiled SGEMM: a block of 256 threads
// computes a 64x64 tile of C, each thread a 4x4 piece held in registers; per
// step of 16 along K the block copies a 64x16 tile of A and a 16x64 tile of B
// into shared memory. It is written as three phases of one thread (load,
// accumulate, store) separated by barriers, so the CPU emulation runs the very
// same tile code thread by thread and the tests check its index arithmetic.
//
// With DG_USE_CUBLAS (CMake option <NAME>_CUBLAS) products go to cublasSgemm
// instead, and an epilogue runs as a separate elementwise pass.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17.
#pragma once

#include <cstdint>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

#if defined(DG_USE_CUBLAS) && !defined(DG_CUDA_EMULATE)
#include <cublas_v2.h>
#endif

namespace dg {
namespace gemm_detail {

constexpr int BM = 64, BN = 64, BK = 16;  // the block's tile of C, and its step along K
constexpr int TM = 4, TN = 4;             // each thread's piece of the tile
constexpr int PAD = 4;                    // shared-memory row padding against bank conflicts
constexpr int kGemmThreads = (BM / TM) * (BN / TN);

// The epilogue of a product without one.
struct NoEpilogue {
  DG_HD void operator()(int64_t, int64_t, float*, int64_t) const {}
};

// One product c = op(a) @ op(b), then the epilogue; TA / TB: a / b stored transposed.
template <bool TA, bool TB, typename Epilogue>
struct Gemm {
  const float* a;
  const float* b;
  float* c;
  int64_t M, K, N;
  Epilogue ep;

  // Element (m, k) of the logical a[M, K] and (k, n) of the logical b[K, N].
  DG_HD float A(int64_t m, int64_t k) const { return TA ? a[k * M + m] : a[m * K + k]; }
  DG_HD float B(int64_t k, int64_t n) const { return TB ? b[n * K + k] : b[k * N + n]; }

  // Phase 1, once per step k0: thread t copies its share of the A and B tiles
  // into shared memory (zeros outside the matrices). Consecutive threads read
  // consecutive addresses of whichever layout the operand has.
  DG_HD void load(int t, int64_t row0, int64_t col0, int64_t k0, float (*As)[BM + PAD],
                  float (*Bs)[BN + PAD]) const {
    for (int e = t; e < BK * BM; e += kGemmThreads) {
      const int kk = TA ? e / BM : e % BK;
      const int mm = TA ? e % BM : e / BK;
      const int64_t m = row0 + mm, k = k0 + kk;
      As[kk][mm] = (m < M && k < K) ? A(m, k) : 0.0f;
    }
    for (int e = t; e < BK * BN; e += kGemmThreads) {
      const int kk = TB ? e % BK : e / BN;
      const int nn = TB ? e / BK : e % BN;
      const int64_t k = k0 + kk, n = col0 + nn;
      Bs[kk][nn] = (k < K && n < N) ? B(k, n) : 0.0f;
    }
  }

  // Phase 2: thread t adds this step's products to its TM x TN outputs.
  DG_HD void accumulate(int t, const float (*As)[BM + PAD], const float (*Bs)[BN + PAD],
                        float (&acc)[TM][TN]) const {
    const int ty = t / (BN / TN), tx = t % (BN / TN);
    for (int kk = 0; kk < BK; ++kk) {
      float av[TM], bv[TN];
      for (int i = 0; i < TM; ++i)
        av[i] = As[kk][ty * TM + i];
      for (int j = 0; j < TN; ++j)
        bv[j] = Bs[kk][tx * TN + j];
      for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j)
          acc[i][j] += av[i] * bv[j];
    }
  }

  // Phase 3: each finished sum goes through the epilogue into c.
  DG_HD void store(int t, int64_t row0, int64_t col0, float (&acc)[TM][TN]) const {
    const int ty = t / (BN / TN), tx = t % (BN / TN);
    for (int i = 0; i < TM; ++i) {
      const int64_t m = row0 + ty * TM + i;
      if (m >= M) continue;
      for (int j = 0; j < TN; ++j) {
        const int64_t n = col0 + tx * TN + j;
        if (n >= N) continue;
        float value = acc[i][j];
        ep(m, n, &value, 1);
        c[m * N + n] = value;
      }
    }
  }
};

#ifdef __CUDACC__

// Block (x, y, z) computes tile (x, y) of product z of a batch (z = 0 alone for
// one product): operands `step` floats apart.
template <typename G>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_kernel(G g, int64_t a_step = 0, int64_t b_step = 0, int64_t c_step = 0) {
  g.a += static_cast<int64_t>(blockIdx.z) * a_step;
  g.b += static_cast<int64_t>(blockIdx.z) * b_step;
  g.c += static_cast<int64_t>(blockIdx.z) * c_step;
  __shared__ float As[BK][BM + PAD];
  __shared__ float Bs[BK][BN + PAD];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * BM;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * BN;
  float acc[TM][TN] = {};
  for (int64_t k0 = 0; k0 < g.K; k0 += BK) {
    g.load(t, row0, col0, k0, As, Bs);
    __syncthreads();
    g.accumulate(t, As, Bs, acc);
    __syncthreads();
  }
  g.store(t, row0, col0, acc);
}

#endif

// The same phases on the host, one block at a time and, within a block, one
// thread at a time between the barriers.
template <typename G>
void run_on_host(const G& g) {
  struct Acc {
    float v[TM][TN];
  };
  std::vector<Acc> acc(kGemmThreads);
  float As[BK][BM + PAD], Bs[BK][BN + PAD];
  for (int64_t row0 = 0; row0 < g.M; row0 += BM) {
    for (int64_t col0 = 0; col0 < g.N; col0 += BN) {
      for (auto& a : acc)
        a = Acc{};
      for (int64_t k0 = 0; k0 < g.K; k0 += BK) {
        for (int t = 0; t < kGemmThreads; ++t)
          g.load(t, row0, col0, k0, As, Bs);
        for (int t = 0; t < kGemmThreads; ++t)
          g.accumulate(t, As, Bs, acc[t].v);
      }
      for (int t = 0; t < kGemmThreads; ++t)
        g.store(t, row0, col0, acc[t].v);
    }
  }
}

#if defined(DG_USE_CUBLAS) && !defined(DG_CUDA_EMULATE)

inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS error in ") + call + " at " + file + ":" +
                             std::to_string(line) + ": status " + std::to_string(static_cast<int>(status)));
}
#define DG_CUBLAS_CHECK(call) ::dg::gemm_detail::cublas_check((call), #call, __FILE__, __LINE__)

// This thread's cuBLAS handle, on this thread's stream.
inline cublasHandle_t cublas_handle() {
  struct Handle {
    cublasHandle_t h = nullptr;
    Handle() { DG_CUBLAS_CHECK(cublasCreate(&h)); }
    ~Handle() { (void)cublasDestroy(h); }
  };
  thread_local Handle handle;
  DG_CUBLAS_CHECK(cublasSetStream(handle.h, stream()));
  return handle.h;
}

// Row-major c = op(a) @ op(b) is column-major c^T = op(b)^T @ op(a)^T.
template <bool TA, bool TB>
void cublas_gemm(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N) {
  const float one = 1.0f, zero = 0.0f;
  DG_CUBLAS_CHECK(cublasSgemm(cublas_handle(), TB ? CUBLAS_OP_T : CUBLAS_OP_N, TA ? CUBLAS_OP_T : CUBLAS_OP_N,
                              static_cast<int>(N), static_cast<int>(M), static_cast<int>(K), &one, b,
                              static_cast<int>(TB ? K : N), a, static_cast<int>(TA ? M : K), &zero, c,
                              static_cast<int>(N)));
}

#endif

template <bool TA, bool TB, typename Epilogue>
void gemm(const char* what, const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
          Epilogue ep) {
  if (M <= 0 || N <= 0) return;
#if defined(DG_USE_CUBLAS) && !defined(DG_CUDA_EMULATE)
  if (K > 0) {
    cublas_gemm<TA, TB>(a, b, c, M, K, N);
  } else {
    zero_bytes(c, static_cast<size_t>(M * N) * sizeof(float));
  }
  for_each(what, M * N, [=] DG_HD(int64_t i) {
    float value = c[i];
    ep(i / N, i % N, &value, 1);
    c[i] = value;
  });
#else
  const Gemm<TA, TB, Epilogue> g{a, b, c, M, K, N, ep};
#ifdef __CUDACC__
  const dim3 grid(static_cast<unsigned>((M + BM - 1) / BM), static_cast<unsigned>((N + BN - 1) / BN));
  // (clang-format would split the launch's >>>)
  // clang-format off
  gemm_kernel<<<grid, kGemmThreads, 0, stream()>>>(g);
  // clang-format on
  check_launch(what);
#else
  (void)what;
  run_on_host(g);
#endif
#endif
}

// Products c[i] = op(a[i]) @ op(b[i]), i in [0, batch), of dense [batch, ...] arrays:
// one launch whose grid's z axis is the batch (cuBLAS: one strided batched call).
template <bool TA, bool TB>
void batched(const float* a, const float* b, float* c, int64_t batch, int64_t M, int64_t K, int64_t N) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  const int64_t a_step = M * K, b_step = K * N, c_step = M * N;
#if defined(DG_USE_CUBLAS) && !defined(DG_CUDA_EMULATE)
  if (K == 0) {
    zero_bytes(c, static_cast<size_t>(batch * c_step) * sizeof(float));
    return;
  }
  const float one = 1.0f, zero = 0.0f;  // row-major c = op(a) op(b) as column-major c^T = op(b)^T op(a)^T
  DG_CUBLAS_CHECK(cublasSgemmStridedBatched(
      cublas_handle(), TB ? CUBLAS_OP_T : CUBLAS_OP_N, TA ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
      static_cast<int>(M), static_cast<int>(K), &one, b, static_cast<int>(TB ? K : N), b_step, a,
      static_cast<int>(TA ? M : K), a_step, &zero, c, static_cast<int>(N), c_step, static_cast<int>(batch)));
#elif defined(__CUDACC__)
  const Gemm<TA, TB, NoEpilogue> g{a, b, c, M, K, N, NoEpilogue{}};
  constexpr int64_t kMaxGridZ = 65535;
  for (int64_t first = 0; first < batch; first += kMaxGridZ) {
    const int64_t count = batch - first < kMaxGridZ ? batch - first : kMaxGridZ;
    Gemm<TA, TB, NoEpilogue> part = g;
    part.a += first * a_step;
    part.b += first * b_step;
    part.c += first * c_step;
    const dim3 grid(static_cast<unsigned>((M + BM - 1) / BM), static_cast<unsigned>((N + BN - 1) / BN),
                    static_cast<unsigned>(count));
    // (clang-format would split the launch's >>>)
    // clang-format off
    gemm_kernel<<<grid, kGemmThreads, 0, stream()>>>(part, a_step, b_step, c_step);
    // clang-format on
    check_launch("batched_matmul");
  }
#else
  for (int64_t i = 0; i < batch; ++i) {
    run_on_host(
        Gemm<TA, TB, NoEpilogue>{a + i * a_step, b + i * b_step, c + i * c_step, M, K, N, NoEpilogue{}});
  }
#endif
}

}  // namespace gemm_detail

// c[M,N] = a[M,K] @ b[K,N], then the epilogue on each element.
template <typename Epilogue = gemm_detail::NoEpilogue>
void matmul(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N, Epilogue ep = {}) {
  gemm_detail::gemm<false, false>("matmul", a, b, c, M, K, N, ep);
}

// c[M,N] = a^T @ b with a stored [K,M] (a weight gradient).
template <typename Epilogue = gemm_detail::NoEpilogue>
void matmul_tn(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N, Epilogue ep = {}) {
  gemm_detail::gemm<true, false>("matmul_tn", a, b, c, M, K, N, ep);
}

// c[M,N] = a @ b^T with b stored [N,K] (an input gradient).
template <typename Epilogue = gemm_detail::NoEpilogue>
void matmul_nt(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N, Epilogue ep = {}) {
  gemm_detail::gemm<false, true>("matmul_nt", a, b, c, M, K, N, ep);
}

// c[i] = op(a[i]) @ op(b[i]) for i in [0, batch): a [batch, M, K] (stored [batch, K, M]
// when ta), b [batch, K, N] (stored [batch, N, K] when tb), c [batch, M, N].
inline void batched_matmul(const float* a, const float* b, float* c, int64_t batch, int64_t M, int64_t K,
                           int64_t N, bool ta, bool tb) {
  if (ta && tb) {
    gemm_detail::batched<true, true>(a, b, c, batch, M, K, N);
  } else if (ta) {
    gemm_detail::batched<true, false>(a, b, c, batch, M, K, N);
  } else if (tb) {
    gemm_detail::batched<false, true>(a, b, c, batch, M, K, N);
  } else {
    gemm_detail::batched<false, false>(a, b, c, batch, M, K, N);
  }
}

}  // namespace dg
