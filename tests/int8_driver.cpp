// Runs runtime/dg_int8.h's quantize_int8, quantize_weight_int8 and matmul_int8 for
// tests/test_int8.py: `int8_driver M K N stored_PK` reads x[M*K], w ([K, N], or
// [N, K] when stored_PK is 1), x_scale[1] and w_scale[N] as float32 from stdin and
// writes y[M*N] as float32 to stdout. Compiled once for this CPU and once for
// baseline x86-64 (the portable loops).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dg_int8.h"

static void read_floats(std::vector<float>& v) {
  if (std::fread(v.data(), sizeof(float), v.size(), stdin) != v.size()) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
}

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const bool stored_PK = std::atoi(argv[4]) != 0;
  std::vector<float> x(M * K), w(K * N), xs(1), ws(N), y(M * N);
  read_floats(x);
  read_floats(w);
  read_floats(xs);
  read_floats(ws);
  std::vector<int8_t> qx(M * K), qw(N * K);
  dg::quantize_int8(x.data(), qx.data(), xs.data(), M, K, "x_scale");
  dg::quantize_weight_int8(w.data(), qw.data(), ws.data(), N, K, stored_PK, "w_scale");
  dg::matmul_int8(qx.data(), qw.data(), xs.data(), ws.data(), y.data(), M, K, N, !stored_PK);
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
