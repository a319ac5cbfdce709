// Runs the CUDA runtime's convolutions and pools (targets/cuda/runtime/dg_cuda_conv.h)
// on cases that tests/test_cuda_conv_runtime.py writes, and writes their results
// back for the test to compare with torch.nn.functional.
//
// Built by that test with a C++ compiler and DG_CUDA_EMULATE (the kernels'
// bodies and the tile kernel's phases run on the CPU), and, on a machine with a
// GPU, with nvcc as a .cu file. Usage: cuda_conv_driver CASES RESULTS.
//
// CASES is a sequence of records, little-endian: int64 kind (0 conv2d, 1
// max_pool2d, 2 avg_pool2d), int64 has_bias, int64 path (conv2d: 0 the public
// functions, 1 the direct lambdas, 2 the tile kernel), int64 geometry[16] (the
// Conv2dGeom constructor's arguments in order), then float32 arrays:
//   conv2d: x, w, b (when has_bias), dy      pools: x, dy
// RESULTS gets, per record, float32 arrays: conv2d: y, dx, dw; pools: y, dx.
// Every output buffer starts as NaN (so a value not written shows), and each
// workspace is followed by guard values that must stay as they were. Prints
// one line per failed check and "ok <records>" at the end; exits 1 on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_conv.h"

namespace {

int failures = 0;

constexpr int64_t kGuard = 64;
constexpr float kGuardValue = 12345.0f;

int64_t read_i64(std::ifstream& in) {
  int64_t v = 0;
  in.read(reinterpret_cast<char*>(&v), sizeof v);
  return v;
}

std::vector<float> read_floats(std::ifstream& in, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  if (!in) throw std::runtime_error("cases file ends early");
  return v;
}

// A device buffer of n values (plus the guard after them when guarded), set to `fill`.
struct Buffer {
  int64_t n;
  bool guarded;
  dg::DeviceVector<float> data;
  Buffer(int64_t count, float fill, bool guard = false)
      : n(count), guarded(guard), data(count + (guard ? kGuard : 0)) {
    std::vector<float> host(static_cast<size_t>(data.size()), fill);
    for (int64_t i = n; i < data.size(); ++i) host[static_cast<size_t>(i)] = kGuardValue;
    dg::copy_bytes(data.data(), host.data(), host.size() * sizeof(float));
  }
  explicit Buffer(const std::vector<float>& host) : n(static_cast<int64_t>(host.size())), guarded(false), data(n) {
    dg::copy_bytes(data.data(), host.data(), host.size() * sizeof(float));
  }
  float* ptr() { return n == 0 ? nullptr : data.data(); }
  std::vector<float> values() const {
    std::vector<float> host(static_cast<size_t>(data.size()));
    dg::copy_bytes(host.data(), data.data(), host.size() * sizeof(float));
    dg::synchronize();
    return host;
  }
  void check_guard(const std::string& what) const {
    if (!guarded) return;
    const std::vector<float> host = values();
    for (int64_t i = n; i < data.size(); ++i) {
      if (host[static_cast<size_t>(i)] != kGuardValue) {
        std::printf("FAIL %s: wrote past the workspace's %lld floats\n", what.c_str(), static_cast<long long>(n));
        ++failures;
        return;
      }
    }
  }
};

void write(std::ofstream& out, const Buffer& b) {
  const std::vector<float> host = b.values();
  out.write(reinterpret_cast<const char*>(host.data()), static_cast<std::streamsize>(b.n * sizeof(float)));
}

void run_conv(std::ifstream& in, std::ofstream& out, const dg::Conv2dGeom& g, bool has_bias, int64_t path,
              const std::string& what) {
  const int64_t Cg = g.C / g.groups;
  Buffer x(read_floats(in, g.N * g.C * g.H * g.W));
  Buffer w(read_floats(in, g.O * Cg * g.KH * g.KW));
  Buffer b(has_bias ? read_floats(in, g.O) : std::vector<float>{});
  Buffer dy(read_floats(in, g.N * g.O * g.OH * g.OW));
  const float nan = std::nanf("");
  Buffer y(g.N * g.O * g.OH * g.OW, nan), dx(g.N * g.C * g.H * g.W, nan), dw(g.O * Cg * g.KH * g.KW, nan);
  // Workspaces as the generated code has them: nullptr when 0 floats, else exactly the size.
  Buffer ws_fwd(dg::conv2d_workspace(g), 0.0f, true), ws_in(dg::conv2d_workspace(g), 0.0f, true);
  Buffer ws_w(dg::conv2d_grad_weight_workspace(g), 0.0f, true);
  const float* bias = has_bias ? b.ptr() : nullptr;
  namespace cd = dg::conv_detail;
  if (path == 0) {
    dg::conv2d(x.ptr(), w.ptr(), bias, y.ptr(), ws_fwd.ptr(), g);
    dg::conv2d_grad_input(dy.ptr(), w.ptr(), dx.ptr(), ws_in.ptr(), g);
    dg::conv2d_grad_weight(x.ptr(), dy.ptr(), dw.ptr(), ws_w.ptr(), g);
  } else if (path == 1) {
    cd::conv2d_direct(x.ptr(), w.ptr(), bias, y.ptr(), g);
    cd::conv2d_grad_input_direct(dy.ptr(), w.ptr(), dx.ptr(), g);
    cd::conv2d_grad_weight_direct(x.ptr(), dy.ptr(), dw.ptr(), ws_w.ptr(), g);
  } else {
    cd::conv2d_tiled(x.ptr(), w.ptr(), bias, y.ptr(), g);
    cd::conv2d_grad_input_tiled(dy.ptr(), w.ptr(), dx.ptr(), g);
    cd::conv2d_grad_weight_tiled(x.ptr(), dy.ptr(), dw.ptr(), ws_w.ptr(), g);
  }
  dg::synchronize();
  ws_fwd.check_guard(what + " conv2d");
  ws_in.check_guard(what + " conv2d_grad_input");
  ws_w.check_guard(what + " conv2d_grad_weight");
  write(out, y);
  write(out, dx);
  write(out, dw);
}

void run_pool(std::ifstream& in, std::ofstream& out, const dg::Conv2dGeom& g, bool max) {
  Buffer x(read_floats(in, g.N * g.C * g.H * g.W));
  Buffer dy(read_floats(in, g.N * g.C * g.OH * g.OW));
  const float nan = std::nanf("");
  Buffer y(g.N * g.C * g.OH * g.OW, nan), dx(g.N * g.C * g.H * g.W, nan);
  if (max) {
    dg::max_pool2d(x.ptr(), y.ptr(), g);
    dg::max_pool2d_grad(x.ptr(), y.ptr(), dy.ptr(), dx.ptr(), g);
  } else {
    dg::avg_pool2d(x.ptr(), y.ptr(), g);
    dg::avg_pool2d_grad(dy.ptr(), dx.ptr(), g);
  }
  dg::synchronize();
  write(out, y);
  write(out, dx);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CASES RESULTS\n", argv[0]);
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    std::ofstream out(argv[2], std::ios::binary);
    if (!in || !out) throw std::runtime_error("cannot open the files");
    int records = 0;
    while (in.peek() != std::ifstream::traits_type::eof()) {
      const int64_t kind = read_i64(in), has_bias = read_i64(in), path = read_i64(in);
      int64_t a[16];
      for (auto& v : a) v = read_i64(in);
      if (!in) throw std::runtime_error("cases file ends early");
      const dg::Conv2dGeom g(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                             a[13], a[14], a[15]);
      const std::string what = "record " + std::to_string(records);
      if (kind == 0) {
        run_conv(in, out, g, has_bias != 0, path, what);
      } else {
        run_pool(in, out, g, kind == 1);
      }
      ++records;
    }
    if (failures == 0) std::printf("ok %d\n", records);
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
