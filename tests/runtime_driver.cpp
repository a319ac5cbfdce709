// Test driver for the C++ runtime headers, used by tests/test_runtime.py.
//
// One program runs every case so the tests compile only once:
//   runtime_driver <op> <args...>  < inputs  > outputs
// Inputs and outputs are raw little-endian arrays (float32 or integer ids) in
// the order each op documents below.  Float parameters on the command line are
// passed as their uint32 bit patterns so they arrive exactly.
// std::invalid_argument is reported on stderr with exit status 3.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <limits>
#include <vector>

#include "dg_finite_loss.h"
#include "dg_gather.h"
#include "dg_layer_norm.h"
#include "dg_layout.h"
#include "dg_loss.h"
#include "dg_masks.h"
#include "dg_matmul.h"
#include "dg_memory_stats.h"
#include "dg_parallel.h"
#include "dg_range_checks.h"
#include "dg_reduce.h"
#include "dg_rng.h"
#include "dg_state_lock.h"
#include "dg_tensor.h"
#include "dg_windows.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// The stream hash must be usable at compile time (for generated constants).
static_assert(dg::name_stream("") == 0xCBF29CE484222325ULL, "FNV-1a offset basis");
static_assert(dg::name_stream("a") == 0xAF63DC4C8601EC8CULL, "FNV-1a of \"a\"");

namespace {

// Sequential reader over everything on stdin.
class Input {
public:
    Input() : bytes_(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()) {}

    template <typename T>
    std::vector<T> take(int64_t n) {
        const size_t size = static_cast<size_t>(n) * sizeof(T);
        if (pos_ + size > bytes_.size()) throw std::runtime_error("driver: input too short");
        std::vector<T> values(static_cast<size_t>(n));
        if (size > 0) std::memcpy(values.data(), bytes_.data() + pos_, size);
        pos_ += size;
        return values;
    }

private:
    std::vector<char> bytes_;
    size_t pos_ = 0;
};

void write(const std::vector<float>& values) {
    std::fwrite(values.data(), sizeof(float), values.size(), stdout);
}

int64_t int_arg(char** argv, int i) { return std::stoll(argv[i]); }
uint64_t u64_arg(char** argv, int i) { return std::stoull(argv[i]); }

float float_arg(char** argv, int i) {
    const uint32_t bits = static_cast<uint32_t>(std::stoul(argv[i]));
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// init_* <n> <seed> <name> <param bits> <param bits>  ->  n floats
int run_rng(const std::string& op, char** argv) {
    const int64_t n = int_arg(argv, 2);
    std::vector<float> out(static_cast<size_t>(n));
    if (op == "init_constant") {
        dg::init_constant(out.data(), n, float_arg(argv, 3));
    } else {
        const uint64_t seed = u64_arg(argv, 3);
        const uint64_t stream = dg::name_stream(argv[4]);
        if (op == "init_uniform") {
            dg::init_uniform(out.data(), n, seed, stream, float_arg(argv, 5), float_arg(argv, 6));
        } else {
            dg::init_normal(out.data(), n, seed, stream, float_arg(argv, 5), float_arg(argv, 6));
        }
    }
    write(out);
    return 0;
}

// <op> <outer> <len> <inner>, input x  ->  y
int run_axis_op(const std::string& op, char** argv) {
    const int64_t outer = int_arg(argv, 2), len = int_arg(argv, 3), inner = int_arg(argv, 4);
    Input in;
    const std::vector<float> x = in.take<float>(outer * len * inner);
    const bool reduces = op.rfind("reduce_", 0) == 0;
    std::vector<float> y(static_cast<size_t>(outer * (reduces ? 1 : len) * inner));
    if (op == "reduce_sum") dg::reduce_sum(x.data(), y.data(), outer, len, inner);
    if (op == "reduce_mean") dg::reduce_mean(x.data(), y.data(), outer, len, inner);
    if (op == "reduce_max") dg::reduce_max(x.data(), y.data(), outer, len, inner);
    if (op == "softmax") dg::softmax(x.data(), y.data(), outer, len, inner);
    if (op == "log_softmax") dg::log_softmax(x.data(), y.data(), outer, len, inner);
    write(y);
    return 0;
}

// matmul <M> <K> <N>, input a then b  ->  c
int run_matmul(char** argv) {
    const int64_t M = int_arg(argv, 2), K = int_arg(argv, 3), N = int_arg(argv, 4);
    Input in;
    const std::vector<float> a = in.take<float>(M * K);
    const std::vector<float> b = in.take<float>(K * N);
    std::vector<float> c(static_cast<size_t>(M * N), -1.0f);  // must be overwritten
    dg::matmul(a.data(), b.data(), c.data(), M, K, N);
    write(c);
    return 0;
}

// matmul_tn <M> <K> <N>, input a stored [K,M] then b [K,N]  ->  c = a^T @ b
// matmul_nt <M> <K> <N>, input a [M,K] then b stored [N,K]  ->  c = a @ b^T
int run_matmul_t(const std::string& op, char** argv) {
    const int64_t M = int_arg(argv, 2), K = int_arg(argv, 3), N = int_arg(argv, 4);
    Input in;
    const std::vector<float> a = in.take<float>(M * K);
    const std::vector<float> b = in.take<float>(K * N);
    std::vector<float> c(static_cast<size_t>(M * N), -1.0f);  // must be overwritten
    if (op == "matmul_tn") dg::matmul_tn(a.data(), b.data(), c.data(), M, K, N);
    if (op == "matmul_nt") dg::matmul_nt(a.data(), b.data(), c.data(), M, K, N);
    write(c);
    return 0;
}

// The epilogue of the gemm cases: c = max(c + bias[col], 0), and for every
// element it is called on, one more in `count` and the OpenMP thread in `thread`.
struct BiasReluEpilogue {
    const float* bias;
    float* count;
    float* thread;
    int64_t M, N, ldc;
    void operator()(int64_t row, int64_t col0, float* c, int64_t n) const {
        if (row < 0 || row >= M || col0 < 0 || n < 1 || col0 + n > N) {
            count[0] = 1e9f;  // a piece outside C: fails the test's count check
            return;
        }
#ifdef _OPENMP
        const float id = static_cast<float>(omp_get_thread_num());
#else
        const float id = 0.0f;
#endif
        for (int64_t j = 0; j < n; ++j) {
            c[j] = std::max(c[j] + bias[col0 + j], 0.0f);
            count[row * ldc + col0 + j] += 1.0f;
            thread[row * ldc + col0 + j] = id;
        }
    }
};

// gemm <ta> <tb> <M> <N> <K> <lda> <ldb> <ldc> <threads> <epilogue 0|1>,
// input A (stored [K,lda] if ta else [M,lda]), B (stored [N,ldb] if tb else
// [K,ldb]), the initial C [M,ldc], then bias [N] if epilogue
//   ->  C [M,ldc], then (epilogue only) count [M,ldc] and thread [M,ldc]
int run_gemm(char** argv) {
    const bool ta = int_arg(argv, 2) != 0, tb = int_arg(argv, 3) != 0;
    const int64_t M = int_arg(argv, 4), N = int_arg(argv, 5), K = int_arg(argv, 6);
    const int64_t lda = int_arg(argv, 7), ldb = int_arg(argv, 8), ldc = int_arg(argv, 9);
    const int threads = static_cast<int>(int_arg(argv, 10));
    const bool epilogue = int_arg(argv, 11) != 0;
    Input in;
    const std::vector<float> a = in.take<float>((ta ? K : M) * lda);
    const std::vector<float> b = in.take<float>((tb ? N : K) * ldb);
    std::vector<float> c = in.take<float>(M * ldc);
    dg::set_num_threads(threads);
    if (epilogue) {
        const std::vector<float> bias = in.take<float>(N);
        std::vector<float> count(c.size(), 0.0f), thread(c.size(), -1.0f);
        const BiasReluEpilogue epi{bias.data(), count.data(), thread.data(), M, N, ldc};
        dg::gemm(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, c.data(), ldc, epi);
        write(c);
        write(count);
        write(thread);
    } else {
        dg::gemm(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, c.data(), ldc);
        write(c);
    }
    return 0;
}

// gemm_packed <ta> <tb> <M> <N> <K> <lda> <ldb> <ldc> <threads>, inputs as for
// gemm (C's initial values are ignored)  ->  C from dg::gemm with a PackedB of B,
// then C from the same PackedB used a second, third and fourth time (once packed,
// the products walk its panels forward and backward in turn), then C from plain dg::gemm,
// then C from the PackedB for the first min(M, 2) rows only, then for the first row only
int run_gemm_packed(char** argv) {
    const bool ta = int_arg(argv, 2) != 0, tb = int_arg(argv, 3) != 0;
    const int64_t M = int_arg(argv, 4), N = int_arg(argv, 5), K = int_arg(argv, 6);
    const int64_t lda = int_arg(argv, 7), ldb = int_arg(argv, 8), ldc = int_arg(argv, 9);
    dg::set_num_threads(static_cast<int>(int_arg(argv, 10)));
    Input in;
    const std::vector<float> a = in.take<float>((ta ? K : M) * lda);
    const std::vector<float> b = in.take<float>((tb ? N : K) * ldb);
    std::vector<float> c = in.take<float>(M * ldc);
    const dg::PackedB packed(tb, K, N, b.data(), ldb);
    for (int pass = 0; pass < 4; ++pass) {  // in place, packing, packed (walked both ways)
        std::fill(c.begin(), c.end(), -1.0f);
        dg::gemm(ta, M, a.data(), lda, packed, c.data(), ldc);
        write(c);
    }
    std::fill(c.begin(), c.end(), -1.0f);
    dg::gemm(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, c.data(), ldc);
    write(c);
    // Then a product of the first min(M, 2) rows of op(A) (for ta, A's first
    // columns: the same lda) with the same PackedB, packed by now where M > MR.
    std::fill(c.begin(), c.end(), -1.0f);
    dg::gemm(ta, std::min<int64_t>(M, 2), a.data(), lda, packed, c.data(), ldc);
    write(c);
    std::fill(c.begin(), c.end(), -1.0f);
    dg::gemm(ta, 1, a.data(), lda, packed, c.data(), ldc);
    write(c);
    return 0;
}

// gemm_update <ta> <tb> <M> <N> <K> <threads> <apply 0|1>, inputs A and B
// stored as for gemm (lda, ldb their widths; ldc = N), then w [M, N]  ->  C
// from dg::gemm with a dg::update_rows epilogue whose update is
// w -= 0.5 * g and count += 1 (a parameter and one optimizer slot), then w,
// then count (how often each element was updated), then C from plain dg::gemm
int run_gemm_update(char** argv) {
    const bool ta = int_arg(argv, 2) != 0, tb = int_arg(argv, 3) != 0;
    const int64_t M = int_arg(argv, 4), N = int_arg(argv, 5), K = int_arg(argv, 6);
    dg::set_num_threads(static_cast<int>(int_arg(argv, 7)));
    const bool apply = int_arg(argv, 8) != 0;
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    Input in;
    const std::vector<float> a = in.take<float>((ta ? K : M) * lda);
    const std::vector<float> b = in.take<float>((tb ? N : K) * ldb);
    std::vector<float> w = in.take<float>(M * N);
    std::vector<float> count(w.size(), 0.0f), c(w.size(), -1.0f);
    float* const wp = w.data();
    float* const cp = count.data();
    const auto update = [wp, cp](int64_t at, const float* g, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
            wp[at + j] -= 0.5f * g[j];
            cp[at + j] += 1.0f;
        }
    };
    dg::gemm(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, c.data(), N, dg::update_rows(apply, N, update, wp, cp));
    write(c);
    write(w);
    write(count);
    std::fill(c.begin(), c.end(), -1.0f);
    dg::gemm(ta, tb, M, N, K, a.data(), lda, b.data(), ldb, c.data(), N);
    write(c);
    return 0;
}

// gemm_unpack <tb> <M> <N> <K> <ldb>, inputs a [M, K] and b as stored  ->  B
// written back from its packing (PackedB::unpack, into NaN-filled storage of
// the same shape: what a stand-in packing restores), then C = A @ op(B) read
// through the packing alone (set_source(nullptr): no row streaming from B)
int run_gemm_unpack(char** argv) {
    const bool tb = int_arg(argv, 2) != 0;
    const int64_t M = int_arg(argv, 3), N = int_arg(argv, 4), K = int_arg(argv, 5), ldb = int_arg(argv, 6);
    Input in;
    const std::vector<float> a = in.take<float>(M * K);
    std::vector<float> b = in.take<float>((tb ? N : K) * ldb);
    dg::PackedB packed(tb, K, N, b.data(), ldb);
    packed.packed();
    std::vector<float> back(b.size(), std::numeric_limits<float>::quiet_NaN());
    packed.unpack(back.data(), ldb);
    write(back);
    std::fill(b.begin(), b.end(), std::numeric_limits<float>::quiet_NaN());  // the stored copy is gone
    packed.set_source(nullptr);
    std::vector<float> c(M * N, -1.0f);
    dg::gemm(false, M, a.data(), K, packed, c.data(), N);
    write(c);
    return 0;
}

// gemm_info <threads>  ->  "<isa> <get_num_threads() after set_num_threads(threads)> <openmp 0|1>"
int run_gemm_info(char** argv) {
    dg::set_num_threads(static_cast<int>(int_arg(argv, 2)));
#ifdef _OPENMP
    const int openmp = 1;
#else
    const int openmp = 0;
#endif
    std::printf("%s %d %d\n", dg::gemm_isa(), dg::get_num_threads(), openmp);
    return 0;
}

// A transpose's <ndim> <shape...> <perm...> from argv[2] on: its element count.
int64_t transpose_args(char** argv, std::vector<int64_t>& shape, std::vector<int>& perm) {
    const int ndim = static_cast<int>(int_arg(argv, 2));
    shape.resize(ndim);
    perm.resize(ndim);
    int64_t total = 1;
    for (int d = 0; d < ndim; ++d) {
        shape[d] = int_arg(argv, 3 + d);
        perm[d] = static_cast<int>(int_arg(argv, 3 + ndim + d));
        total *= shape[d];
    }
    return total;
}

// transpose <ndim> <shape...> <perm...>, input x  ->  y
int run_transpose(char** argv) {
    std::vector<int64_t> shape;
    std::vector<int> perm;
    const int64_t total = transpose_args(argv, shape, perm);
    const int ndim = static_cast<int>(shape.size());
    Input in;
    const std::vector<float> x = in.take<float>(total);
    std::vector<float> y(static_cast<size_t>(total));
    dg::transpose(x.data(), y.data(), ndim, shape.data(), perm.data());
    write(y);
    return 0;
}

// transpose_rows <ndim> <shape...> <perm...> <row_axes> <ld> <start>: the same of
// a row-strided piece of x (rows of ld floats, the piece's from float start on)
int run_transpose_rows(char** argv) {
    std::vector<int64_t> shape;
    std::vector<int> perm;
    const int64_t total = transpose_args(argv, shape, perm);
    const int ndim = static_cast<int>(shape.size());
    const int row_axes = static_cast<int>(int_arg(argv, 3 + 2 * ndim));
    const int64_t ld = int_arg(argv, 4 + 2 * ndim), start = int_arg(argv, 5 + 2 * ndim);
    int64_t rows = 1;
    for (int d = 0; d < row_axes; ++d)
        rows *= shape[d];
    Input in;
    const std::vector<float> x = in.take<float>(rows * ld);
    std::vector<float> y(static_cast<size_t>(total));
    dg::transpose(x.data() + start, y.data(), ndim, shape.data(), perm.data(), row_axes, ld);
    write(y);
    return 0;
}

// copy_axis <outer> <src_len> <src_start> <dst_len> <dst_start> <count> <inner>,
// input src then the initial dst  ->  dst after the copy
int run_copy_axis(char** argv) {
    const int64_t outer = int_arg(argv, 2), src_len = int_arg(argv, 3), src_start = int_arg(argv, 4),
                  dst_len = int_arg(argv, 5), dst_start = int_arg(argv, 6), count = int_arg(argv, 7),
                  inner = int_arg(argv, 8);
    Input in;
    const std::vector<float> src = in.take<float>(outer * src_len * inner);
    std::vector<float> dst = in.take<float>(outer * dst_len * inner);
    dg::copy_axis(src.data(), dst.data(), outer, src_len, src_start, dst_len, dst_start, count, inner);
    write(dst);
    return 0;
}

// gather_rows_i32|gather_rows_i64 <rows> <width> <n> <what>, input table then ids  ->  out
template <typename Id>
int run_gather(char** argv) {
    const int64_t rows = int_arg(argv, 2), width = int_arg(argv, 3), n = int_arg(argv, 4);
    Input in;
    const std::vector<float> table = in.take<float>(rows * width);
    const std::vector<Id> ids = in.take<Id>(n);
    std::vector<float> out(static_cast<size_t>(n * width));
    dg::gather_rows(table.data(), rows, width, ids.data(), n, out.data(), argv[5]);
    write(out);
    return 0;
}

int dispatch(int argc, char** argv) {
    if (argc < 2) throw std::runtime_error("usage: runtime_driver <op> <args...>");
    const std::string op = argv[1];
    if (op == "name_stream") {
        std::printf("%llu\n", static_cast<unsigned long long>(dg::name_stream(argv[2])));
        return 0;
    }
    if (op == "mix") {
        std::printf("%llu\n", static_cast<unsigned long long>(
                                  dg::mix(u64_arg(argv, 2), u64_arg(argv, 3), u64_arg(argv, 4))));
        return 0;
    }
    if (op.rfind("init_", 0) == 0) return run_rng(op, argv);
    if (op == "matmul") return run_matmul(argv);
    if (op == "matmul_tn" || op == "matmul_nt") return run_matmul_t(op, argv);
    if (op == "gemm") return run_gemm(argv);
    if (op == "gemm_info") return run_gemm_info(argv);
    if (op == "gemm_packed") return run_gemm_packed(argv);
    if (op == "gemm_unpack") return run_gemm_unpack(argv);
    if (op == "gemm_update") return run_gemm_update(argv);
    if (op == "transpose") return run_transpose(argv);
    if (op == "transpose_rows") return run_transpose_rows(argv);
    if (op == "copy_axis") return run_copy_axis(argv);
    if (op == "gather_rows_i32") return run_gather<int32_t>(argv);
    if (op == "gather_rows_i64") return run_gather<int64_t>(argv);
    if (op == "numel") {  // numel <d0> <d1> ...: prints the element count (std::length_error: exit 4)
        std::vector<int64_t> shape;
        for (int i = 2; i < argc; ++i) shape.push_back(std::stoll(argv[i]));
        std::printf("%lld\n", static_cast<long long>(dg::numel(shape)));
        return 0;
    }
    if (op == "require_size") {  // require_size <a> <b> <c>: the size a * b * c, checked in double
        const double exact = std::stod(argv[2]) * std::stod(argv[3]) * std::stod(argv[4]);
        dg::require_size(exact, "the arena");
        return 0;
    }
    if (op == "finite_loss") {  // finite_loss <float bits> <step>
        float loss;
        const uint32_t bits = static_cast<uint32_t>(std::stoul(argv[2]));
        std::memcpy(&loss, &bits, sizeof loss);
        dg::require_finite_loss(loss, std::stoll(argv[3]));
        return 0;
    }
    if (op.rfind("reduce_", 0) == 0 || op == "softmax" || op == "log_softmax") {
        return run_axis_op(op, argv);
    }
    throw std::runtime_error("driver: unknown op " + op);
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return dispatch(argc, argv);
    } catch (const std::invalid_argument& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 3;
    } catch (const std::length_error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 4;
    } catch (const std::domain_error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 5;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "driver error: %s\n", e.what());
        return 2;
    }
}
