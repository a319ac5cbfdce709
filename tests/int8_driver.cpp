// Runs runtime/dg_int8.h for tests/test_int8.py, which compiles it once per kernel
// this CPU can run (portable, AVX2, AVX-512 VNNI, AMX: dg_int8.h's int8_kernel()).
//
// `int8_driver kernel` prints the kernel matmul_int8 runs (int8_kernel()).
//
// `int8_driver M K N stored_PK` reads x[M*K], w ([K, N], or [N, K] when stored_PK
// is 1), x_scale[1] and w_scale[N] as float32 from stdin, runs quantize_int8,
// quantize_pack_int8 and matmul_int8, and writes y[M*N] as float32 to stdout.
// With a fifth argument `epi`, matmul_int8 takes an epilogue (dg_gemm.h's
// convention): y[i, j] = y[i, j] * 2 + float(i * N + j) on each finished piece, so
// a piece given it twice, or not at all, or at the wrong row or column shows.
//
// `int8_driver sums` checks matmul_int8's integer sums against a plain int32 loop
// on int8 values (activations in [-127, 127], weights in [-63, 63], random and at
// the extremes where vpmaddubsw's pairs are largest) for M 1..9 and 12..65 (the
// VNNI kernel's row blocks, the AMX one's 16-row tiles, whole and not), K odd, a
// multiple of 64 (whole AMX tiles) and not, and N odd; prints "ok <cases>" or the
// first difference (exit 1).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "dg_int8.h"

static void read_floats(std::vector<float>& v) {
  if (std::fread(v.data(), sizeof(float), v.size(), stdin) != v.size()) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
}

static int check_sums() {
  std::mt19937 rng(5);
  const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 31, 32, 33, 48, 64, 65};
  const int64_t Ks[] = {1, 2, 3, 4, 5, 7, 8, 31, 64, 129, 192, 1000};
  const int64_t Ns[] = {1, 3, 8, 15, 16, 17, 33, 40};
  int cases = 0;
  for (int64_t M : Ms)
    for (int64_t K : Ks)
      for (int64_t N : Ns)
        for (int fill = 0; fill < 4; ++fill) {  // random; a = 127, w = 63; a = -127, w = -63; a = 127, w = -63
          const int64_t lda = dg::int8_row_bytes(K);
          std::vector<int8_t> a(M * lda, 0), w(N * K);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t k = 0; k < K; ++k)
              a[i * lda + k] = int8_t(fill == 0 ? int(rng() % 255) - 127 : fill == 2 ? -127 : 127);
          for (auto& v : w)
            v = int8_t(fill == 0 ? int(rng() % 127) - 63 : fill == 1 ? 63 : -63);
          const std::vector<float> ones(N, 1.0f);
          const dg::Int8PackedB packed(w.data(), ones.data(), K, N);
          std::vector<float> c(M * N);
          const float one = 1.0f;
          dg::matmul_int8(a.data(), &one, packed, c.data(), M);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) {
              int32_t s = 0;
              for (int64_t k = 0; k < K; ++k)
                s += int32_t(a[i * lda + k]) * int32_t(w[j * K + k]);
              if (c[i * N + j] != float(s)) {  // |s| <= 1000 * 127 * 63 < 2^24: exact as a float
                std::printf("M=%lld K=%lld N=%lld fill %d: c[%lld][%lld] = %.1f, the int32 loop %d\n", (long long)M,
                            (long long)K, (long long)N, fill, (long long)i, (long long)j, c[i * N + j], s);
                return 1;
              }
            }
          ++cases;
        }
  std::printf("ok %d\n", cases);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "sums") == 0) return check_sums();
  if (argc == 2 && std::strcmp(argv[1], "kernel") == 0) {
    std::printf("%s\n", dg::int8_kernel());
    return 0;
  }
  if (argc != 5 && !(argc == 6 && std::strcmp(argv[5], "epi") == 0)) return 2;
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const bool stored_PK = std::atoi(argv[4]) != 0;
  std::vector<float> x(M * K), w(K * N), xs(1), ws(N), y(M * N);
  read_floats(x);
  read_floats(w);
  read_floats(xs);
  read_floats(ws);
  std::vector<int8_t> qx(M * dg::int8_row_bytes(K));
  dg::quantize_int8(x.data(), qx.data(), xs.data(), M, K, "x_scale");
  const dg::Int8PackedB packed = dg::quantize_pack_int8(w.data(), ws.data(), K, N, stored_PK, "w_scale");
  if (argc == 6)
    dg::matmul_int8(qx.data(), xs.data(), packed, y.data(), M, [N](int64_t row, int64_t col0, float* c, int64_t n) {
      for (int64_t j = 0; j < n; ++j)
        c[j] = c[j] * 2.0f + static_cast<float>(row * N + col0 + j);
    });
  else
    dg::matmul_int8(qx.data(), xs.data(), packed, y.data(), M);
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
