// Runs runtime/dg_int8_conv.h's fused convolution for tests/test_int8.py, which
// compiles it once per int8 kernel this CPU can run (as int8_driver.cpp):
//
// `int8_conv_driver N C H W O KH KW OH OW stride pad dil bias training residual relu`
// reads x, w [O, C, KH, KW], b [O] (when bias), batch norm's weight, bias, running
// mean and variance [O], the residual (y's size, when residual), x_scale [1] and
// w_scale [O] as float32 from stdin, and writes as float32 to stdout:
// dg::conv2d_batch_norm_int8's y, then dg::conv2d_int8 followed by dg::batch_norm and
// the residual add and relu as the elementwise kernels compute them (the same bits
// expected), then each one's running mean and variance after the call. The fused
// call runs in a workspace of dg::conv2d_int8_workspace floats (printed to stderr as
// `workspace N`; exit 3 if it wrote past it), the other in the thread's own buffers.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dg_int8_conv.h"

static std::vector<float> take(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  if (std::fread(v.data(), sizeof(float), v.size(), stdin) != v.size()) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 17) {
    std::fprintf(
        stderr, "usage: int8_conv_driver N C H W O KH KW OH OW stride pad dil bias training residual relu\n");
    return 2;
  }
  int64_t v[16];
  for (int i = 0; i < 16; ++i)
    v[i] = std::atoll(argv[i + 1]);
  const dg::Conv2dGeom g(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[9], v[10], v[10],
                         v[11], v[11], 1);
  const bool bias = v[12] != 0, training = v[13] != 0, residual = v[14] != 0, relu = v[15] != 0;
  const int64_t out = g.N * g.O * g.OH * g.OW;
  const std::vector<float> x = take(g.N * g.C * g.H * g.W);
  dg::Tensor<float> w{std::vector<int64_t>{g.O, g.C, g.KH, g.KW}};
  w.data = take(g.O * g.C * g.KH * g.KW);
  const std::vector<float> b = bias ? take(g.O) : std::vector<float>();
  const std::vector<float> bn_w = take(g.O), bn_b = take(g.O), rm = take(g.O), rv = take(g.O);
  const std::vector<float> r = residual ? take(out) : std::vector<float>();
  const std::vector<float> x_scale = take(1);
  dg::Tensor<float> w_scale{std::vector<int64_t>{g.O}};
  w_scale.data = take(g.O);
  dg::ParameterVersion version;
  const dg::KeptInt8Weight kept(version, w, w_scale, "w_scale", /*tb=*/true, g.C * g.KH * g.KW, g.O,
                                g.KH * g.KW);
  const dg::Mode mode{training, 0, 0};
  std::vector<float> fused(out, -7.0f), conv(out, -7.0f), plain(out, -7.0f), mean(g.O), invstd(g.O);
  std::vector<float> rm1 = rm, rv1 = rv, rm2 = rm, rv2 = rv;
  // the fused call in the workspace the generator reserves (then a guard that must stay
  // as it is), the separate one in the calling thread's buffers (ws null)
  const int64_t ws_floats = dg::conv2d_int8_workspace(g, g.C * g.KH * g.KW), guard = 64;
  std::vector<float> ws(static_cast<size_t>(ws_floats + guard), -3.0f);
  dg::conv2d_batch_norm_int8(x.data(), x_scale.data(), kept, bias ? b.data() : nullptr, bn_w.data(),
                             bn_b.data(), rm1.data(), rv1.data(), residual ? r.data() : nullptr, fused.data(),
                             mean.data(), invstd.data(), ws.data(), g, "x_scale", 1e-5f, 0.1f, relu, mode,
                             "bn");
  for (int64_t i = ws_floats; i < ws_floats + guard; ++i)
    if (ws[static_cast<size_t>(i)] != -3.0f) {
      std::fprintf(stderr, "conv2d_batch_norm_int8 wrote past its workspace of %lld floats\n",
                   static_cast<long long>(ws_floats));
      return 3;
    }
  std::fprintf(stderr, "workspace %lld\n", static_cast<long long>(ws_floats));
  dg::conv2d_int8(x.data(), x_scale.data(), kept, bias ? b.data() : nullptr, conv.data(), nullptr, g,
                  "x_scale");
  dg::batch_norm(conv.data(), bn_w.data(), bn_b.data(), rm2.data(), rv2.data(), plain.data(), mean.data(),
                 invstd.data(), g.N, g.O, g.OH * g.OW, 1e-5f, 0.1f, mode, "bn");
  for (int64_t i = 0; i < out; ++i) {
    const float s = residual ? plain[i] + r[i] : plain[i];
    plain[i] = relu ? (0.0f > s ? 0.0f : s) : s;
  }
  for (const auto* a : {&fused, &plain, &rm1, &rv1, &rm2, &rv2})
    std::fwrite(a->data(), sizeof(float), a->size(), stdout);
  return 0;
}
