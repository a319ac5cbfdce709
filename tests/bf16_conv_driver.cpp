// Runs runtime/dg_bf16_conv.h for tests/test_bf16_kernels.py, built for this CPU.
//
// `bf16_conv_driver N C H W O KH KW OH OW stride pad dil bn` reads as float32
// from stdin x [N, C, H, W], w [O, C, KH, KW] and b [O], and when bn is 1 also
// batch norm's weight, bias, running mean and running variance [O] and a
// residual [N, O, OH, OW]; keeps w as a dg::KeptBf16Weight and writes, as
// float32 to stdout after a first line naming the product's path, y [N, O, OH,
// OW] = dg::conv2d_bf16(x, w, b) (bn 0), or dg::conv2d_batch_norm_bf16 in
// evaluation mode with the residual and relu (bn 1).
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dg_bf16_conv.h"

static void read_floats(std::vector<float>& v) {
  if (std::fread(v.data(), sizeof(float), v.size(), stdin) != v.size()) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
}

int main(int argc, char** argv) {
  if (argc != 14) {
    std::fprintf(stderr, "usage: bf16_conv_driver N C H W O KH KW OH OW stride pad dil bn\n");
    return 2;
  }
  int64_t v[13];
  for (int i = 0; i < 13; ++i)
    v[i] = std::atoll(argv[i + 1]);
  const dg::Conv2dGeom g(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[9], v[10], v[10],
                         v[11], v[11], 1);
  const bool bn = v[12] != 0;
  const int64_t out = g.N * g.O * g.OH * g.OW;
  std::vector<float> x(g.N * g.C * g.H * g.W), b(g.O), y(out, -7.0f);
  dg::Tensor<float> w{std::vector<int64_t>{g.O, g.C, g.KH, g.KW}};
  read_floats(x);
  read_floats(w.data);
  read_floats(b);
  std::vector<float> ws(static_cast<size_t>(dg::conv2d_workspace(g)) + 1);
  dg::ParameterVersion version;
  dg::KeptBf16Weight kept(version, w, /*tb=*/true, g.C * g.KH * g.KW, g.O);
  if (bn) {
    std::vector<float> bn_w(g.O), bn_b(g.O), mean(g.O), var(g.O), residual(out), m(g.O), invstd(g.O);
    read_floats(bn_w);
    read_floats(bn_b);
    read_floats(mean);
    read_floats(var);
    read_floats(residual);
    const dg::Mode eval{false, 0, 0};
    dg::conv2d_batch_norm_bf16(x.data(), kept, b.data(), bn_w.data(), bn_b.data(), mean.data(), var.data(),
                               residual.data(), y.data(), m.data(), invstd.data(), ws.data(), g, 1e-5f, 0.1f,
                               /*relu=*/true, eval, "test");
  } else {
    dg::conv2d_bf16(x.data(), kept, b.data(), y.data(), ws.data(), g);
  }
  std::printf("%s\n", dg::conv2d_bf16_kernel(g));
  std::fflush(stdout);
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
