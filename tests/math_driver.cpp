// math_driver.cpp - test driver for targets/cpu/runtime/dg_math.h (see tests/test_math.py).
//
//   math_driver eval FN                   float32 array on stdin -> FN of each on stdout
//   math_driver ref FN                    float32 array on stdin -> the double libm function of
//                                         each as float64 (the sweep's oracle, for checking it)
//   math_driver sweep FN START END STRIDE [THREADS]
//                                         every float whose bit pattern is START, START+STRIDE,
//                                         ... < END (uint32 range, END up to 2^32), compared with
//                                         double-precision libm; prints one line of key=value
//   math_driver bench FN N REPS           ns per element of dg::math vs the float libm function
//
// FN: exp expm1 log log1p tanh erf sigmoid (1 / (1 + e^-x): its "libm" is that formula in float).  All evaluation goes through `apply`, whose inner loop has a
// constant trip count of 16 so that GCC vectorizes it even at -O2 (the cheap cost model does not
// vectorize loops that need an epilogue): the tests check the vectorized code.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dg_math.h"

namespace {

constexpr size_t kBlock = 16;

template <class F>
void apply(const float* __restrict x, float* __restrict y, size_t n) {  // n: a multiple of kBlock
    for (size_t i = 0; i < n; i += kBlock) {
        for (size_t j = 0; j < kBlock; ++j) y[i + j] = F{}(x[i + j]);
    }
}

#define DG_FN(NAME)                                                      \
    struct NAME##_dg {                                                   \
        float operator()(float v) const { return dg::math::NAME##_f(v); } \
    };                                                                   \
    struct NAME##_libm {                                                 \
        float operator()(float v) const { return std::NAME(v); }         \
    };
DG_FN(exp)
DG_FN(expm1)
DG_FN(log)
DG_FN(log1p)
DG_FN(tanh)
DG_FN(erf)
#undef DG_FN
// No libm function: the plain formula in float (what a kernel would write), and in double as the reference.
struct sigmoid_dg {
    float operator()(float v) const { return dg::math::sigmoid_f(v); }
};
struct sigmoid_libm {
    float operator()(float v) const { return 1.0f / (1.0f + std::exp(-v)); }
};
double sigmoid_ref(double v) { return 1.0 / (1.0 + std::exp(-v)); }

struct Fn {
    const char* name;
    void (*dg)(const float*, float*, size_t);
    void (*libm)(const float*, float*, size_t);
    double (*ref)(double);
};

#define DG_ENTRY(NAME) \
    {#NAME, apply<NAME##_dg>, apply<NAME##_libm>, [](double v) { return std::NAME(v); }}
const Fn kFns[] = {DG_ENTRY(exp),  DG_ENTRY(expm1), DG_ENTRY(log),
                   DG_ENTRY(log1p), DG_ENTRY(tanh), DG_ENTRY(erf),
                   {"sigmoid", apply<sigmoid_dg>, apply<sigmoid_libm>, sigmoid_ref}};
#undef DG_ENTRY

const Fn* find_fn(const char* name) {
    for (const Fn& f : kFns) {
        if (std::strcmp(f.name, name) == 0) return &f;
    }
    std::fprintf(stderr, "unknown function %s\n", name);
    std::exit(2);
}

uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Floats in increasing order as integers (so the difference of two is their distance in ulps).
int64_t ordered(float f) {
    int32_t i = static_cast<int32_t>(bits_of(f));
    return i < 0 ? -static_cast<int64_t>(i & 0x7FFFFFFF) : static_cast<int64_t>(i);
}

// The float ulp at the magnitude of the exact value `ref` (subnormal spacing below 2^-126).
double ulp_at(double ref) {
    int e;
    std::frexp(std::fabs(ref), &e);  // |ref| = m 2^e, m in [0.5, 1)
    int ex = std::min(std::max(e - 1, -126), 127);
    return std::ldexp(1.0, ex - 23);
}

struct Stats {
    uint64_t count = 0;
    double max_ulp = 0;  // |y - exact| / ulp, exact = double libm
    uint32_t max_ulp_at = 0;
    int64_t max_dist = 0;  // ulps between y and the correctly rounded float
    uint32_t max_dist_at = 0;
    uint64_t special_fail = 0;  // NaN/inf/signed-zero mismatches
    uint32_t special_fail_at = 0;

    void add(uint32_t xb, float y, double ref) {
        ++count;
        float cr = static_cast<float>(ref);
        bool bad = false;
        double err = 0;
        if (std::isnan(ref) || std::isnan(y)) {
            if (std::isnan(ref) && std::isnan(y)) return;
            bad = true;
        } else if (std::isinf(cr) || std::isinf(y)) {
            // Overflow: y must be the rounded result (inf, or FLT_MAX when that is within bounds).
            err = std::isinf(y) && y == cr ? 0.0 : std::fabs(static_cast<double>(y) - ref) / ulp_at(ref);
            bad = std::isinf(ref) && y != cr;
        } else {
            err = std::fabs(static_cast<double>(y) - ref) / ulp_at(ref);
            if (ref == 0 && y == 0) bad = std::signbit(ref) != std::signbit(y);
        }
        if (bad) {
            if (special_fail++ == 0) special_fail_at = xb;
            return;
        }
        if (err > max_ulp) {
            max_ulp = err;
            max_ulp_at = xb;
        }
        int64_t dist = std::isinf(err) ? INT64_MAX : std::llabs(ordered(y) - ordered(cr));
        if (dist > max_dist) {
            max_dist = dist;
            max_dist_at = xb;
        }
    }

    void merge(const Stats& o) {
        if (o.special_fail && !special_fail) special_fail_at = o.special_fail_at;
        special_fail += o.special_fail;
        count += o.count;
        if (o.max_ulp > max_ulp) {
            max_ulp = o.max_ulp;
            max_ulp_at = o.max_ulp_at;
        }
        if (o.max_dist > max_dist) {
            max_dist = o.max_dist;
            max_dist_at = o.max_dist_at;
        }
    }
};

Stats sweep_range(const Fn& fn, uint64_t start, uint64_t end, uint64_t stride) {
    Stats st;
    constexpr size_t kChunk = 4096;
    std::vector<float> x(kChunk), y(kChunk);
    std::vector<uint32_t> xb(kChunk);
    uint64_t i = start;
    while (i < end) {
        size_t n = 0;
        for (; n < kChunk && i < end; ++n, i += stride) {
            xb[n] = static_cast<uint32_t>(i);
            x[n] = float_of(xb[n]);
        }
        size_t padded = (n + kBlock - 1) / kBlock * kBlock;
        std::fill(x.begin() + n, x.begin() + padded, 0.0f);
        fn.dg(x.data(), y.data(), padded);
        for (size_t k = 0; k < n; ++k) st.add(xb[k], y[k], fn.ref(static_cast<double>(x[k])));
    }
    return st;
}

int cmd_eval(const Fn& fn) {
    std::vector<float> x;
    float buf[1024];
    size_t got;
    while ((got = std::fread(buf, sizeof(float), 1024, stdin)) > 0) x.insert(x.end(), buf, buf + got);
    size_t n = x.size();
    x.resize((n + kBlock - 1) / kBlock * kBlock, 0.0f);
    std::vector<float> y(x.size());
    fn.dg(x.data(), y.data(), x.size());
    std::fwrite(y.data(), sizeof(float), n, stdout);
    return 0;
}

int cmd_ref(const Fn& fn) {
    float v;
    while (std::fread(&v, sizeof v, 1, stdin) == 1) {
        double r = fn.ref(static_cast<double>(v));
        std::fwrite(&r, sizeof r, 1, stdout);
    }
    return 0;
}

int cmd_sweep(const Fn& fn, uint64_t start, uint64_t end, uint64_t stride, unsigned threads) {
    threads = std::max(1u, threads);
    uint64_t steps = end > start ? (end - start + stride - 1) / stride : 0;
    std::vector<Stats> part(threads);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        uint64_t a = start + steps * t / threads * stride;
        uint64_t b = std::min(end, start + steps * (t + 1) / threads * stride);
        pool.emplace_back([&, t, a, b] { part[t] = sweep_range(fn, a, b, stride); });
    }
    Stats st;
    for (unsigned t = 0; t < threads; ++t) {
        pool[t].join();
        st.merge(part[t]);
    }
    std::printf("count=%" PRIu64 " max_ulp=%.4f max_ulp_at=0x%08" PRIx32 " max_dist=%" PRId64
                " max_dist_at=0x%08" PRIx32 " special_fail=%" PRIu64 " special_fail_at=0x%08" PRIx32 "\n",
                st.count, st.max_ulp, st.max_ulp_at, st.max_dist, st.max_dist_at, st.special_fail,
                st.special_fail_at);
    return 0;
}

volatile float g_sink;

int cmd_bench(const Fn& fn, size_t n, int reps) {
    n = (n + kBlock - 1) / kBlock * kBlock;
    std::vector<float> x(n), y(n);
    // Arguments spread over the range where the functions do real work.
    for (size_t i = 0; i < n; ++i) {
        float u = static_cast<float>(i) / static_cast<float>(n);  // [0, 1)
        x[i] = (std::strcmp(fn.name, "log") == 0) ? 1e-3f + 100.0f * u
               : (std::strcmp(fn.name, "log1p") == 0) ? -0.9f + 10.0f * u
                                                    : -10.0f + 20.0f * u;
    }
    auto time = [&](void (*f)(const float*, float*, size_t)) {
        double best = 1e30;
        for (int r = 0; r < reps; ++r) {
            auto t0 = std::chrono::steady_clock::now();
            f(x.data(), y.data(), n);
            auto t1 = std::chrono::steady_clock::now();
            g_sink = y[n / 2];
            best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / n);
        }
        return best;
    };
    double t_libm = time(fn.libm);
    double t_dg = time(fn.dg);
    std::printf("%s libm_ns=%.3f dg_ns=%.3f speedup=%.2f\n", fn.name, t_libm, t_dg, t_libm / t_dg);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: math_driver eval|ref|sweep|bench FN ...\n");
        return 2;
    }
    std::string cmd = argv[1];
    const Fn& fn = *find_fn(argv[2]);
    if (cmd == "eval") return cmd_eval(fn);
    if (cmd == "ref") return cmd_ref(fn);
    if (cmd == "sweep" && argc >= 6) {
        unsigned threads = argc >= 7 ? static_cast<unsigned>(std::strtoul(argv[6], nullptr, 0)) : 1;
        return cmd_sweep(fn, std::strtoull(argv[3], nullptr, 0), std::strtoull(argv[4], nullptr, 0),
                         std::strtoull(argv[5], nullptr, 0), threads);
    }
    if (cmd == "bench" && argc >= 5) {
        return cmd_bench(fn, std::strtoull(argv[3], nullptr, 0), std::atoi(argv[4]));
    }
    std::fprintf(stderr, "bad arguments\n");
    return 2;
}
