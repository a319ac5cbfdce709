// Runs runtime/dg_bf16.h for tests/test_bf16_kernels.py, built for this CPU.
//
// `bf16_driver M K N stored_NK` reads x[M*K] and w ([K, N], or [N, K] when
// stored_NK is 1) as float32 from stdin, keeps w as a dg::KeptBf16Weight and
// writes, as float32 to stdout, y[M*N] = x @ op(w) through dg::matmul_bf16 with an
// epilogue that adds 1 to every element (so each element must be reached once),
// after a first line naming the path the product took (dg::bf16_kernel(M)) and a
// second saying whether the same product handed over (dg::Bf16Rows) wrote the
// bytes pack_rows makes of y ("same"; "none" without bf16 products).
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "dg_bf16.h"

static void read_floats(std::vector<float>& v) {
  if (std::fread(v.data(), sizeof(float), v.size(), stdin) != v.size()) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
}

struct AddOne {
  void operator()(int64_t, int64_t, float* c, int64_t n) const {
    for (int64_t j = 0; j < n; ++j)
      c[j] += 1.0f;
  }
};

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: bf16_driver M K N stored_NK\n");
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const bool tb = std::atoi(argv[4]) != 0;
  std::vector<float> x(M * K), y(M * N, -7.0f);
  dg::Tensor<float> w{std::vector<int64_t>{tb ? N : K, tb ? K : N}};
  read_floats(x);
  read_floats(w.data);
  dg::ParameterVersion version;
  dg::KeptBf16Weight kept(version, w, tb, K, N);
  dg::matmul_bf16(x.data(), kept, y.data(), M, K, N, AddOne());
  std::printf("%s\n", dg::bf16_kernel(M));
  // The same product handed over (dg::Bf16Rows): its rows must be the bytes
  // pack_rows makes of y for a product that reads y (padding included).
#if DG_BF16_PRODUCTS
  {
    const int64_t width = dg::bf16_handed_width(N), rows = dg::bf16_padded_rows(M);
    std::vector<uint16_t> handed(static_cast<size_t>(rows * width), 0x7fc1);  // (a NaN: every value must be written)
    std::vector<float> untouched(M * N, -7.0f);
    dg::matmul_bf16(x.data(), kept, untouched.data(), M, K, N, AddOne(), dg::Bf16Rows{handed.data()});
    const dg::Scratch<uint16_t> packed = dg::bf16_detail::pack_rows(y.data(), N, M, dg::Bf16PackedB(N, 1));
    bool same = std::equal(handed.begin(), handed.end(), packed.data());
    for (float v : untouched) same = same && v == -7.0f;  // the float32 output is not written
    std::printf("handed_over %s\n", same ? "same" : "differs");
  }
#else
  std::printf("handed_over none\n");
#endif
  std::fflush(stdout);
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
