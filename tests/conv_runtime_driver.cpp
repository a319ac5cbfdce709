// Test driver for dg_conv.h (2-D convolution and pooling), used by
// tests/test_conv_runtime.py.
//
//   conv_runtime_driver <op> N C H W O KH KW OH OW sh sw ph pw dh dw groups [bias]  < inputs  > output
//
// The 16 numbers are a dg::Conv2dGeom in its constructor's order.  Inputs are
// raw float32 arrays on stdin, in the order below; the output is one raw
// float32 array on stdout:
//   conv2d             x, w [, b when bias is 1]   -> y
//   conv2d_kept        x, w [, b when bias is 1]   -> y read through a dg::KeptPackedB
//                      (the packing made by the first call, kept: the second call's y),
//                      then y read through it with a step running (the weight as stored)
//   conv2d_grad_input  dy, w                       -> dx
//   conv2d_grad_weight x, dy                       -> dw
//   max_pool2d         x                           -> y
//   max_pool2d_reference x                         -> y by a plain loop here (one
//                      output at a time, every window position in order), which
//                      dg::max_pool2d must match bit for bit
//   max_pool2d_grad    x, y, dy                    -> dx
//   avg_pool2d         x                           -> y
//   avg_pool2d_grad    dy                          -> dx
// Outputs and the workspace start as NaN (so anything not overwritten shows),
// and the workspace has exactly the size conv2d_workspace /
// conv2d_grad_weight_workspace give, followed by guard floats: a write past
// its end exits with status 4.
//
//   conv_runtime_driver bench <16 numbers> reps
// times conv2d on random data against dg::gemm with the same sizes (one
// [O/groups, K] @ [K, OH*OW] product per image and group, K = C/groups*KH*KW)
// and prints the GFLOP/s of both.
//   conv_runtime_driver bench_max_pool2d <16 numbers> reps
// times dg::max_pool2d and the reference loop above on random data.
//   conv_runtime_driver isa      prints dg::gemm_isa().
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_conv.h"
#include "dg_math.h"

namespace {

constexpr int kGuardExit = 4;
constexpr int64_t kGuard = 64;
constexpr float kSentinel = 12345.678f;

// Sequential reader over everything on stdin.
class Input {
 public:
    Input() : bytes_(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()) {}

    std::vector<float> take(int64_t n) {
        const size_t size = static_cast<size_t>(n) * sizeof(float);
        if (pos_ + size > bytes_.size()) throw std::runtime_error("driver: input too short");
        std::vector<float> values(static_cast<size_t>(n));
        if (size > 0) std::memcpy(values.data(), bytes_.data() + pos_, size);
        pos_ += size;
        return values;
    }

    void expect_end() const {
        if (pos_ != bytes_.size()) throw std::runtime_error("driver: input too long");
    }

 private:
    std::vector<char> bytes_;
    size_t pos_ = 0;
};

// A buffer of n floats set to NaN.
std::vector<float> nans(int64_t n) { return std::vector<float>(static_cast<size_t>(n), std::nanf("")); }

// A workspace of exactly n floats (NaN) followed by guard floats.
struct Workspace {
    explicit Workspace(int64_t n) : n_(n), data_(static_cast<size_t>(n + kGuard), std::nanf("")) {
        for (int64_t i = n; i < n + kGuard; ++i) data_[i] = kSentinel;
    }
    float* get() { return data_.data(); }
    bool intact() const {
        for (int64_t i = n_; i < n_ + kGuard; ++i) {
            if (data_[i] != kSentinel) return false;
        }
        return true;
    }

 private:
    int64_t n_;
    std::vector<float> data_;
};

void write(const std::vector<float>& values) {
    std::fwrite(values.data(), sizeof(float), values.size(), stdout);
}

dg::Conv2dGeom geom_args(char** argv) {
    int64_t v[16];
    for (int i = 0; i < 16; ++i) v[i] = std::stoll(argv[2 + i]);
    return dg::Conv2dGeom(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13],
                          v[14], v[15]);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int bench(const dg::Conv2dGeom& g, int reps) {
    const int64_t Cg = g.C / g.groups, Og = g.O / g.groups, K = Cg * g.KH * g.KW, OHW = g.OH * g.OW;
    std::vector<float> x(g.N * g.C * g.H * g.W), w(g.O * K), b(g.O), y(g.N * g.O * OHW);
    uint32_t state = 12345;
    auto next = [&state]() {
        state = state * 1664525u + 1013904223u;
        return static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
    };
    for (auto& v : x) v = next();
    for (auto& v : w) v = next();
    for (auto& v : b) v = next();
    std::vector<float> ws(std::max<int64_t>(dg::conv2d_workspace(g), 1));
    std::vector<float> cols(K * OHW);
    for (auto& v : cols) v = next();
    const double flops = 2.0 * double(g.N) * double(g.O) * double(OHW) * double(K);

    dg::conv2d(x.data(), w.data(), b.data(), y.data(), ws.data(), g);  // warm up
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) dg::conv2d(x.data(), w.data(), b.data(), y.data(), ws.data(), g);
    const double conv_s = seconds_since(t0) / reps;

    auto gemms = [&]() {
        for (int64_t n = 0; n < g.N; ++n) {
            for (int64_t grp = 0; grp < g.groups; ++grp) {
                dg::gemm(false, false, Og, OHW, K, w.data() + grp * Og * K, K, cols.data(), OHW,
                         y.data() + (n * g.O + grp * Og) * OHW, OHW);
            }
        }
    };
    gemms();
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) gemms();
    const double gemm_s = seconds_since(t0) / reps;

    std::vector<float> dw(g.O * K), dx(x.size());
    std::vector<float> wsw(std::max<int64_t>(dg::conv2d_grad_weight_workspace(g), 1));
    dg::conv2d_grad_input(y.data(), w.data(), dx.data(), ws.data(), g);
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) dg::conv2d_grad_input(y.data(), w.data(), dx.data(), ws.data(), g);
    const double gi_s = seconds_since(t0) / reps;
    dg::conv2d_grad_weight(x.data(), y.data(), dw.data(), wsw.data(), g);
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) dg::conv2d_grad_weight(x.data(), y.data(), dw.data(), wsw.data(), g);
    const double gw_s = seconds_since(t0) / reps;

    std::printf("isa %s threads %d\n", dg::gemm_isa(), dg::get_num_threads());
    std::printf("conv2d             %8.3f ms  %7.1f GFLOP/s\n", conv_s * 1e3, flops / conv_s * 1e-9);
    std::printf("gemm (same sizes)  %8.3f ms  %7.1f GFLOP/s\n", gemm_s * 1e3, flops / gemm_s * 1e-9);
    std::printf("conv2d_grad_input  %8.3f ms  %7.1f GFLOP/s\n", gi_s * 1e3, flops / gi_s * 1e-9);
    std::printf("conv2d_grad_weight %8.3f ms  %7.1f GFLOP/s\n", gw_s * 1e3, flops / gw_s * 1e-9);
    return 0;
}

// y = max_pool2d of x, written plainly: every window position in order (kh
// outer, kw inner), padding skipped; a NaN, once seen, is kept (the last one).
void max_pool2d_reference(const float* x, float* y, const dg::Conv2dGeom& g) {
    for (int64_t p = 0; p < g.N * g.C; ++p) {
        for (int64_t oh = 0; oh < g.OH; ++oh) {
            for (int64_t ow = 0; ow < g.OW; ++ow) {
                float m = -std::numeric_limits<float>::infinity();
                for (int64_t kh = 0; kh < g.KH; ++kh) {
                    for (int64_t kw = 0; kw < g.KW; ++kw) {
                        const int64_t ih = oh * g.stride_h - g.pad_h + kh * g.dil_h;
                        const int64_t iw = ow * g.stride_w - g.pad_w + kw * g.dil_w;
                        if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) continue;
                        const float v = x[(p * g.H + ih) * g.W + iw];
                        if (v > m || std::isnan(v)) m = v;
                    }
                }
                y[(p * g.OH + oh) * g.OW + ow] = m;
            }
        }
    }
}

int bench_max_pool2d(const dg::Conv2dGeom& g, int reps) {
    std::vector<float> x(g.N * g.C * g.H * g.W), y(g.N * g.C * g.OH * g.OW);
    uint32_t state = 12345;
    for (auto& v : x) {
        state = state * 1664525u + 1013904223u;
        v = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
    }
    dg::max_pool2d(x.data(), y.data(), g);  // warm up
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) dg::max_pool2d(x.data(), y.data(), g);
    const double pool_s = seconds_since(t0) / reps;
    max_pool2d_reference(x.data(), y.data(), g);
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) max_pool2d_reference(x.data(), y.data(), g);
    const double ref_s = seconds_since(t0) / reps;
    std::printf("threads %d\n", dg::get_num_threads());
    std::printf("max_pool2d            %9.2f us\n", pool_s * 1e6);
    std::printf("max_pool2d_reference  %9.2f us\n", ref_s * 1e6);
    return 0;
}

int run(int argc, char** argv) {
    if (argc < 2) throw std::runtime_error("usage: conv_runtime_driver <op> <16 geometry numbers> [extra]");
    const std::string op = argv[1];
    if (op == "isa") {
        std::printf("%s\n", dg::gemm_isa());
        return 0;
    }
    if (argc < 18) throw std::runtime_error("driver: expected 16 geometry numbers");
    const dg::Conv2dGeom g = geom_args(argv);
    if (op == "bench") return bench(g, argc > 18 ? std::stoi(argv[18]) : 10);
    if (op == "bench_max_pool2d") return bench_max_pool2d(g, argc > 18 ? std::stoi(argv[18]) : 100);

    const int64_t x_n = g.N * g.C * g.H * g.W, y_n = g.N * g.O * g.OH * g.OW;
    const int64_t w_n = g.O * (g.C / g.groups) * g.KH * g.KW;
    Input in;
    std::vector<float> out;
    bool intact = true;
    if (op == "conv2d") {
        const bool bias = argc > 18 && std::stoi(argv[18]) != 0;
        const auto x = in.take(x_n), w = in.take(w_n);
        const auto b = bias ? in.take(g.O) : std::vector<float>();
        in.expect_end();
        out = nans(y_n);
        Workspace ws(dg::conv2d_workspace(g));
        dg::conv2d(x.data(), w.data(), bias ? b.data() : nullptr, out.data(), ws.get(), g);
        intact = ws.intact();
    } else if (op == "conv2d_kept") {
        const bool bias = argc > 18 && std::stoi(argv[18]) != 0;
        const auto x = in.take(x_n);
        dg::Tensor<float> w({g.O, g.C / g.groups, g.KH, g.KW}, in.take(w_n));
        const auto b = bias ? in.take(g.O) : std::vector<float>();
        in.expect_end();
        dg::ParameterVersion version;
        const dg::KeptPackedB kept(version, w, true, w_n / g.O, g.O, false);
        auto packed = nans(y_n), stored = nans(y_n);
        Workspace ws(dg::conv2d_workspace(g));
        for (int call = 0; call < 2; ++call)
            dg::conv2d(x.data(), kept, bias ? b.data() : nullptr, packed.data(), ws.get(), g);
        if (kept.bytes() == 0) throw std::runtime_error("driver: the kept packing was not made");
        {
            const auto step = version.step_scope();  // a training step: the weight read as stored
            dg::conv2d(x.data(), kept, bias ? b.data() : nullptr, stored.data(), ws.get(), g);
        }
        intact = ws.intact();
        out = packed;
        out.insert(out.end(), stored.begin(), stored.end());
    } else if (op == "conv2d_batch_norm") {
        // Output: the fused call's y, then conv2d followed by batch_norm's y (the same
        // bits expected), then each one's running mean and variance after the call.
        // Optional (argv[20], argv[21]): a residual (one more input of y's size) added
        // and relu, after batch_norm in the plain calls as the elementwise kernels do.
        const bool bias = std::stoi(argv[18]) != 0, training = std::stoi(argv[19]) != 0;
        const bool residual = argc > 20 && std::stoi(argv[20]) != 0, relu = argc > 21 && std::stoi(argv[21]) != 0;
        const auto x = in.take(x_n), w = in.take(w_n);
        const auto b = bias ? in.take(g.O) : std::vector<float>();
        const auto bn_w = in.take(g.O), bn_b = in.take(g.O), rm = in.take(g.O), rv = in.take(g.O);
        const auto r = residual ? in.take(y_n) : std::vector<float>();
        in.expect_end();
        const dg::Mode mode{training, 0, 0};
        auto fused = nans(y_n), plain = nans(y_n), conv = nans(y_n);
        auto rm1 = rm, rv1 = rv, rm2 = rm, rv2 = rv;
        std::vector<float> mean(g.O), invstd(g.O);
        Workspace ws(dg::conv2d_workspace(g));
        dg::conv2d_batch_norm(x.data(), w.data(), bias ? b.data() : nullptr, bn_w.data(), bn_b.data(), rm1.data(),
                              rv1.data(), residual ? r.data() : nullptr, fused.data(), mean.data(), invstd.data(),
                              ws.get(), g, 1e-5f, 0.1f, relu, mode, "bn");
        intact = ws.intact();
        dg::conv2d(x.data(), w.data(), bias ? b.data() : nullptr, conv.data(), ws.get(), g);
        dg::batch_norm(conv.data(), bn_w.data(), bn_b.data(), rm2.data(), rv2.data(), plain.data(), mean.data(),
                       invstd.data(), g.N, g.O, g.OH * g.OW, 1e-5f, 0.1f, mode, "bn");
        for (int64_t i = 0; i < y_n; ++i) {
            const float v = residual ? plain[i] + r[i] : plain[i];
            plain[i] = relu ? dg::math::max_f(0.0f, v) : v;
        }
        for (const auto* v : {&fused, &plain, &rm1, &rv1, &rm2, &rv2}) out.insert(out.end(), v->begin(), v->end());
    } else if (op == "conv2d_grad_input") {
        const auto dy = in.take(y_n), w = in.take(w_n);
        in.expect_end();
        out = nans(x_n);
        Workspace ws(dg::conv2d_workspace(g));
        dg::conv2d_grad_input(dy.data(), w.data(), out.data(), ws.get(), g);
        intact = ws.intact();
    } else if (op == "conv2d_grad_weight") {
        const auto x = in.take(x_n), dy = in.take(y_n);
        in.expect_end();
        out = nans(w_n);
        Workspace ws(dg::conv2d_grad_weight_workspace(g));
        dg::conv2d_grad_weight(x.data(), dy.data(), out.data(), ws.get(), g);
        intact = ws.intact();
    } else if (op == "max_pool2d") {
        const auto x = in.take(x_n);
        in.expect_end();
        out = nans(y_n);
        dg::max_pool2d(x.data(), out.data(), g);
    } else if (op == "max_pool2d_reference") {
        const auto x = in.take(x_n);
        in.expect_end();
        out = nans(y_n);
        max_pool2d_reference(x.data(), out.data(), g);
    } else if (op == "max_pool2d_grad") {
        const auto x = in.take(x_n), y = in.take(y_n), dy = in.take(y_n);
        in.expect_end();
        out = nans(x_n);
        dg::max_pool2d_grad(x.data(), y.data(), dy.data(), out.data(), g);
    } else if (op == "avg_pool2d") {
        const auto x = in.take(x_n);
        in.expect_end();
        out = nans(y_n);
        dg::avg_pool2d(x.data(), out.data(), g);
    } else if (op == "avg_pool2d_grad") {
        const auto dy = in.take(y_n);
        in.expect_end();
        out = nans(x_n);
        dg::avg_pool2d_grad(dy.data(), out.data(), g);
    } else {
        throw std::runtime_error("driver: unknown op " + op);
    }
    if (!intact) {
        std::fprintf(stderr, "driver: %s wrote past the end of its workspace\n", op.c_str());
        return kGuardExit;
    }
    write(out);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
    }
}
