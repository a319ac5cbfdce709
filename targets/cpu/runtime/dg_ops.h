// dg_ops.h - operator kernels used by deepgen-generated C++ code.
//
// Every tensor is a dense row-major float array.  Kernels that work along one
// axis view their input as [outer, len, inner]: `outer` is the product of the
// dimensions before the axis, `len` the axis itself and `inner` the product of
// the dimensions after it.  This lets one kernel serve every axis of every rank.
//
// The loops are deliberately plain; tuning comes later, with these versions as
// the reference.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dg_gemm.h"
#include "dg_layer_norm.h"

namespace dg {

// c[M,N] = a[M,K] @ b[K,N]; c is overwritten.  All three matmuls run dg::gemm
// (dg_gemm.h: packed, cache-blocked, SIMD, threaded with OpenMP); `epi`, when
// given, is called on each finished piece of c (see dg_gemm.h), e.g. to add a
// bias and apply an activation while the piece is still in cache.
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
    gemm(false, false, M, N, K, a, K, b, N, c, N, epi);
}

// c[M,N] = a[M,K] @ b for a b packed once before a loop (dg_gemm.h: PackedB).
template <class Epilogue = NoEpilogue>
void matmul(const float* a, const PackedB& b, float* c, int64_t M, int64_t K, int64_t N,
            const Epilogue& epi = Epilogue()) {
    if (b.K() != K || b.N() != N) {
        throw std::invalid_argument("dg::matmul: the packed right operand is [" + std::to_string(b.K()) + ", " +
                                    std::to_string(b.N()) + "], the product needs [" + std::to_string(K) +
                                    ", " + std::to_string(N) + "]");
    }
    gemm(false, M, a, K, b, c, N, epi);
}

// c[M,N] = a[M,K] @ b^T for a b^T packed once before a loop (PackedB made with tb = true).
template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const PackedB& b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
    matmul(a, b, c, M, K, N, epi);
}

// y[o, i] = sum over l of x[o, l, i].  The innermost loop runs over `inner`,
// which is contiguous in both x and y.
inline void reduce_sum(const float* x, float* y,
                       int64_t outer, int64_t len, int64_t inner) {
    for (int64_t o = 0; o < outer; ++o) {
        float* y_row = y + o * inner;
        for (int64_t i = 0; i < inner; ++i) y_row[i] = 0.0f;
        for (int64_t l = 0; l < len; ++l) {
            const float* x_row = x + (o * len + l) * inner;
            for (int64_t i = 0; i < inner; ++i) y_row[i] += x_row[i];
        }
    }
}

// y[o, i] = mean over l of x[o, l, i].  An empty axis gives NaN, as in numpy.
inline void reduce_mean(const float* x, float* y,
                        int64_t outer, int64_t len, int64_t inner) {
    reduce_sum(x, y, outer, len, inner);
    const float count = static_cast<float>(len);
    for (int64_t j = 0; j < outer * inner; ++j) y[j] /= count;
}

// y[o, i] = max over l of x[o, l, i].  NaN propagates, as in numpy.
inline void reduce_max(const float* x, float* y,
                       int64_t outer, int64_t len, int64_t inner) {
    if (len == 0) throw std::invalid_argument("max over an empty axis");
    for (int64_t o = 0; o < outer; ++o) {
        float* y_row = y + o * inner;
        const float* x_first = x + o * len * inner;
        for (int64_t i = 0; i < inner; ++i) y_row[i] = x_first[i];
        for (int64_t l = 1; l < len; ++l) {
            const float* x_row = x + (o * len + l) * inner;
            for (int64_t i = 0; i < inner; ++i) {
                const float v = x_row[i];
                // Once y holds NaN, `v > NaN` is false, so the NaN is kept.
                if (v > y_row[i] || std::isnan(v)) y_row[i] = v;
            }
        }
    }
}

namespace ops_detail {

// Maximum of x[l * stride] over l in [0, len); len must be > 0.
inline float strided_max(const float* x, int64_t len, int64_t stride) {
    float m = x[0];
    for (int64_t l = 1; l < len; ++l) {
        const float v = x[l * stride];
        if (v > m || std::isnan(v)) m = v;
    }
    return m;
}

// Sum of exp(x[l * stride] - m) over l in [0, len).
inline float strided_sum_exp(const float* x, int64_t len, int64_t stride, float m) {
    float s = 0.0f;
    for (int64_t l = 0; l < len; ++l) s += std::exp(x[l * stride] - m);
    return s;
}

}  // namespace ops_detail

// Softmax along the middle axis of [outer, len, inner].  The maximum is
// subtracted first so exp never overflows.
inline void softmax(const float* x, float* y,
                    int64_t outer, int64_t len, int64_t inner) {
    if (len == 0) return;
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) {
            const int64_t base = o * len * inner + i;
            const float m = ops_detail::strided_max(x + base, len, inner);
            const float s = ops_detail::strided_sum_exp(x + base, len, inner, m);
            for (int64_t l = 0; l < len; ++l) {
                const int64_t at = base + l * inner;
                y[at] = std::exp(x[at] - m) / s;
            }
        }
    }
}

// log(softmax(x)) along the middle axis, computed as x - max - log(sum(exp(x - max)))
// so that very negative entries do not underflow to log(0).
inline void log_softmax(const float* x, float* y,
                        int64_t outer, int64_t len, int64_t inner) {
    if (len == 0) return;
    for (int64_t o = 0; o < outer; ++o) {
        for (int64_t i = 0; i < inner; ++i) {
            const int64_t base = o * len * inner + i;
            const float m = ops_detail::strided_max(x + base, len, inner);
            const float log_s = std::log(ops_detail::strided_sum_exp(x + base, len, inner, m));
            for (int64_t l = 0; l < len; ++l) {
                const int64_t at = base + l * inner;
                y[at] = (x[at] - m) - log_s;
            }
        }
    }
}

// numpy.transpose(x, perm): y's axis d is x's axis perm[d].
// Walks y in row-major order, keeping the matching offset into x up to date
// like an odometer, so each element costs O(1) amortized.
inline void transpose(const float* x, float* y, int ndim,
                      const int64_t* shape, const int* perm) {
    // Row-major strides of x, then the shape of y and x's stride for each y axis.
    std::vector<int64_t> x_stride(ndim), y_shape(ndim), step(ndim);
    int64_t total = 1;
    for (int d = ndim - 1; d >= 0; --d) {
        x_stride[d] = total;
        total *= shape[d];
    }
    if (total == 0) return;
    for (int d = 0; d < ndim; ++d) {
        y_shape[d] = shape[perm[d]];
        step[d] = x_stride[perm[d]];
    }

    std::vector<int64_t> index(ndim, 0);  // current position in y
    int64_t src = 0;                      // matching offset in x
    for (int64_t dst = 0; dst < total; ++dst) {
        y[dst] = x[src];
        // Advance index like an odometer, last axis fastest.
        for (int d = ndim - 1; d >= 0; --d) {
            if (++index[d] < y_shape[d]) {
                src += step[d];
                break;
            }
            src -= (y_shape[d] - 1) * step[d];
            index[d] = 0;
        }
    }
}

// Copies src[:, src_start : src_start+count, :] into dst[:, dst_start : dst_start+count, :],
// with src viewed as [outer, src_len, inner] and dst as [outer, dst_len, inner].
// Used for concat, split and slice (step 1).  Each outer block is contiguous.
inline void copy_axis(const float* src, float* dst, int64_t outer,
                      int64_t src_len, int64_t src_start,
                      int64_t dst_len, int64_t dst_start,
                      int64_t count, int64_t inner) {
    const int64_t block = count * inner;
    for (int64_t o = 0; o < outer; ++o) {
        const float* from = src + (o * src_len + src_start) * inner;
        float* to = dst + (o * dst_len + dst_start) * inner;
        for (int64_t j = 0; j < block; ++j) to[j] = from[j];
    }
}

// Embedding lookup: out[i, :] = table[ids[i], :], table being [rows, width].
// Ids come from model inputs, so they are checked; `what` names the lookup in
// the error, e.g. "embedding 'emb' ids 'tokens'".
template <typename Id>
void gather_rows(const float* table, int64_t rows, int64_t width,
                 const Id* ids, int64_t n, float* out, const char* what) {
    static_assert(std::is_integral<Id>::value, "gather_rows ids must be integers");
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = static_cast<int64_t>(ids[i]);
        if (id < 0 || id >= rows) {
            throw std::invalid_argument(std::string(what) + ": index " + std::to_string(id) +
                                        " at position " + std::to_string(i) +
                                        " is out of range [0, " + std::to_string(rows) + ")");
        }
        const float* row = table + id * width;
        float* dst = out + i * width;
        for (int64_t j = 0; j < width; ++j) dst[j] = row[j];
    }
}

// c[M,N] = a^T @ b where a is stored [K,M] and b is [K,N] (a weight gradient:
// activations^T @ output gradient); c is overwritten.
template <class Epilogue = NoEpilogue>
void matmul_tn(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
    gemm(true, false, M, N, K, a, M, b, N, c, N, epi);
}

// c[M,N] = a @ b^T where a is [M,K] and b is stored [N,K] (an input gradient:
// output gradient @ weights^T); c is overwritten.
template <class Epilogue = NoEpilogue>
void matmul_nt(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
               const Epilogue& epi = Epilogue()) {
    gemm(false, true, M, N, K, a, K, b, K, c, N, epi);
}

// A parameter's optimizer step run by the GEMM that makes its gradient, as its
// row-block epilogue (dg_gemm.h): once a block of the gradient's rows is
// complete, update(at, g, n) steps elements [at, at + n) of the parameter and
// of its optimizer state (laid out like it) from g[0..n), the gradient there,
// while that block is still in cache; and while the kernels compute a block,
// the next block's rows of each of `arrays` (the parameter, then its state)
// are prefetched, a share per kernel call, so the update finds them in L2
// rather than waiting on L3 (a separate pass after the product streams all of
// them from L3).  With `apply` false the GEMM only makes the gradient
// (compute_gradients()).  Each element is updated once from the same sum, so
// the result is the same as the update's own pass after the product.
template <class Update, size_t Arrays>
struct UpdateRows {
    static constexpr bool kRowBlocks = true;
    bool apply;
    int64_t ld;  // the parameter's row length: the gradient's N
    std::array<const float*, Arrays> arrays;
    Update update;

    void rows_done(int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* g, int64_t ldg) const {
        if (!apply) return;
        if (c0 == 0 && c1 == ld && ldg == ld) {  // whole rows: one stretch of the parameter
            update(r0 * ld, g, (r1 - r0) * ld);
            return;
        }
        for (int64_t r = r0; r < r1; ++r) update(r * ld + c0, g + (r - r0) * ldg, c1 - c0);
    }
    void prefetch(int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t part, int64_t parts) const {
        if (!apply) return;
        // The block's 64-byte lines, row after row, numbered 0 .. lines - 1: this part's share.
        const int64_t row_lines = ((c1 - c0) * int64_t(sizeof(float)) + 63) / 64;
        const int64_t lines = (r1 - r0) * row_lines;
        for (int64_t l = lines * part / parts, end = lines * (part + 1) / parts; l < end; ++l) {
            const int64_t at = (r0 + l / row_lines) * ld + c0 + (l % row_lines) * 16;
            for (const float* a : arrays) {
#if defined(__GNUC__) || defined(__clang__)
                __builtin_prefetch(a + at, 0, 2);  // to L2 (prefetcht1 on x86)
#else
                (void)a;
#endif
            }
        }
    }
};

// dg::matmul_tn(x, dy, dw, ..., dg::update_rows(apply, ld, update, w, w_state...)).
template <class Update, class... Arrays>
UpdateRows<Update, sizeof...(Arrays)> update_rows(bool apply, int64_t ld, Update update, const Arrays*... arrays) {
    return {apply, ld, {arrays...}, update};
}

// c[i] = op(a[i]) @ op(b[i]) for i in [0, batch): a is [batch, M, K] (stored
// [batch, K, M] when ta), b [batch, K, N] (stored [batch, N, K] when tb), c
// [batch, M, N] (attention's scores q @ k^T and its weighted sum of v).  Many
// small products run one per thread (each gemm then stays serial, as gemm does
// inside a parallel region); a few large ones run in turn, each gemm threaded.
// Either way every product is the same serial-or-threaded gemm, whose results
// do not depend on the thread count.
inline void batched_matmul(const float* a, const float* b, float* c, int64_t batch, int64_t M, int64_t K,
                           int64_t N, bool ta, bool tb) {
    const int64_t a_step = M * K, b_step = K * N, c_step = M * N;
    const double flops = 2.0 * double(batch) * double(M) * double(N) * double(K);
    const int threads = threads_for(flops < 1e18 ? int64_t(flops) : int64_t(1e18));
    const bool per_thread = threads > 1 && batch >= threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (per_thread)
#else
    (void)per_thread;
#endif
    for (int64_t i = 0; i < batch; ++i) {
        gemm(ta, tb, M, N, K, a + i * a_step, ta ? M : K, b + i * b_step, tb ? K : N, c + i * c_step, N);
    }
}

// An additive mask for sequences padded to T: mask[n, t] = 0 where t < lengths[n],
// -inf past it (added to attention scores, a padded key gets weight 0).  Lengths
// come from model inputs, so they are checked: each must lie in [1, T] (a row of
// only -inf would make a softmax of NaN); `what` names them in the error.
template <typename Id>
void length_mask(const Id* lengths, float* mask, int64_t N, int64_t T, const char* what) {
    static_assert(std::is_integral<Id>::value, "length_mask lengths must be integers");
    for (int64_t n = 0; n < N; ++n) {
        const int64_t length = static_cast<int64_t>(lengths[n]);
        if (length < 1 || length > T) {
            throw std::invalid_argument(std::string(what) + ": length " + std::to_string(length) + " at position " +
                                        std::to_string(n) + " is out of range [1, " + std::to_string(T) + "]");
        }
        float* row = mask + n * T;
        for (int64_t t = 0; t < T; ++t) row[t] = t < length ? 0.0f : -std::numeric_limits<float>::infinity();
    }
}

// The additive mask of a 0/1 integer mask [N, T] (Hugging Face's attention_mask):
// out[n, t] = 0 where mask[n, t] != 0, -inf where it is 0. The mask comes from a
// model input, so a row that keeps no position is an error naming it (`what`):
// its softmax would be NaN.
template <typename Id>
void key_mask(const Id* mask, float* out, int64_t N, int64_t T, const char* what) {
    static_assert(std::is_integral<Id>::value, "key_mask masks must be integers");
    for (int64_t n = 0; n < N; ++n) {
        bool kept = false;
        for (int64_t t = 0; t < T; ++t) {
            const bool keep = mask[n * T + t] != 0;
            out[n * T + t] = keep ? 0.0f : -std::numeric_limits<float>::infinity();
            kept = kept || keep;
        }
        if (!kept) {
            throw std::invalid_argument(std::string(what) + ": row " + std::to_string(n) +
                                        " keeps no position (all zeros)");
        }
    }
}

// The additive mask of causal attention [T, T]: 0 where key k <= query q, -inf above.
inline void causal_mask(float* out, int64_t T) {
    for (int64_t q = 0; q < T; ++q)
        for (int64_t k = 0; k < T; ++k) out[q * T + k] = k <= q ? 0.0f : -std::numeric_limits<float>::infinity();
}

// x[0..n) = value.
inline void fill(float* x, int64_t n, float value) {
    for (int64_t i = 0; i < n; ++i) x[i] = value;
}

// The adjoint of gather_rows: table_grad[rows, width] = 0, then
// table_grad[ids[i], :] += src[i, :]. Ids were range-checked by the gather.
template <typename Id>
void scatter_add_rows(const Id* ids, int64_t n, const float* src, int64_t width,
                      float* table_grad, int64_t rows) {
    fill(table_grad, rows * width, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
        float* dst = table_grad + static_cast<int64_t>(ids[i]) * width;
        const float* row = src + i * width;
        for (int64_t j = 0; j < width; ++j) dst[j] += row[j];
    }
}

// A label that softmax_xent skips (PyTorch's ignore_index): dg::IgnoreIndex{-1};
// IgnoreIndex{} skips none (every int64 label is then checked against the classes).
struct IgnoreIndex {
    int64_t label = 0;
    bool active = false;
    IgnoreIndex() = default;
    explicit IgnoreIndex(int64_t l) : label(l), active(true) {}
    bool skips(int64_t l) const { return active && l == label; }
};

// Mean softmax cross-entropy of logits[rows, classes] against integer labels:
// loss = mean_i (logsumexp(logits_i) - logits_i[label_i]) over the rows whose
// label is not ignore_index (PyTorch's ignore_index); 0 when no row is labeled.
template <typename Id>
void softmax_xent(const float* logits, const Id* labels, float* loss,
                  int64_t rows, int64_t classes, const char* what, IgnoreIndex ignore = IgnoreIndex()) {
    double total = 0.0;
    int64_t counted = 0;
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t label = static_cast<int64_t>(labels[i]);
        if (ignore.skips(label)) continue;
        if (label < 0 || label >= classes) {
            throw std::invalid_argument(std::string(what) + ": label " + std::to_string(label) +
                                        " at position " + std::to_string(i) +
                                        " is out of range [0, " + std::to_string(classes) + ")");
        }
        const float* z = logits + i * classes;
        const float m = ops_detail::strided_max(z, classes, 1);
        const float logz = m + std::log(ops_detail::strided_sum_exp(z, classes, 1, m));
        total += static_cast<double>(logz - z[label]);
        ++counted;
    }
    loss[0] = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
}

// Gradient of softmax_xent: d_logits = (softmax(logits) - onehot(labels)) * g / labeled rows,
// zero on the rows it skips.
template <typename Id>
void softmax_xent_grad(const float* logits, const Id* labels, const float* g,
                       float* d_logits, int64_t rows, int64_t classes, IgnoreIndex ignore = IgnoreIndex()) {
    int64_t counted = 0;
    for (int64_t i = 0; i < rows; ++i) counted += !ignore.skips(static_cast<int64_t>(labels[i]));
    const float scale = counted > 0 ? g[0] / static_cast<float>(counted) : 0.0f;
    for (int64_t i = 0; i < rows; ++i) {
        const float* z = logits + i * classes;
        float* d = d_logits + i * classes;
        const int64_t label = static_cast<int64_t>(labels[i]);
        if (ignore.skips(label)) {
            std::fill(d, d + classes, 0.0f);
            continue;
        }
        const float m = ops_detail::strided_max(z, classes, 1);
        const float sum = ops_detail::strided_sum_exp(z, classes, 1, m);
        for (int64_t j = 0; j < classes; ++j) d[j] = std::exp(z[j] - m) / sum * scale;
        d[label] -= scale;
    }
}

// Windowed attention's constant tables (ops/windows.py), written by the runtime instead of
// stored as weights. relative_position_index [(wh*ww)^2]: for query p and key q of a window,
// the row of the relative position bias table [(2wh-1)*(2ww-1), heads] holding q seen from p.
inline void relative_position_index(int64_t* out, int64_t wh, int64_t ww) {
    const int64_t L = wh * ww;
    for (int64_t p = 0; p < L; ++p)
        for (int64_t q = 0; q < L; ++q)
            out[p * L + q] = (p / ww - q / ww + wh - 1) * (2 * ww - 1) + (p % ww - q % ww + ww - 1);
}

// The region of position i along an axis of `length` for shifted-window attention: 0 above
// the last `window`, 1 within it above the last `shift`, 2 in the last `shift`; an axis
// shifted by 0 is one region.
inline int64_t window_region(int64_t i, int64_t length, int64_t window, int64_t shift) {
    if (shift == 0) return 0;
    return (i >= length - window ? 1 : 0) + (i >= length - shift ? 1 : 0);
}

// The additive mask of shifted-window attention over an H x W map [windows, wh*ww, wh*ww]:
// `value` between two pixels of a window from different regions, 0 between the same.
inline void shifted_window_mask(float* out, int64_t H, int64_t W, int64_t wh, int64_t ww, int64_t sh, int64_t sw,
                                float value) {
    const int64_t L = wh * ww, across = W / ww, windows = (H / wh) * across;
    std::vector<int64_t> label(static_cast<size_t>(windows * L));
    for (int64_t w = 0; w < windows; ++w)
        for (int64_t p = 0; p < L; ++p) {
            const int64_t y = (w / across) * wh + p / ww, x = (w % across) * ww + p % ww;
            label[static_cast<size_t>(w * L + p)] = window_region(y, H, wh, sh) * 3 + window_region(x, W, ww, sw);
        }
    for (int64_t w = 0; w < windows; ++w)
        for (int64_t p = 0; p < L; ++p)
            for (int64_t q = 0; q < L; ++q)
                out[(w * L + p) * L + q] =
                    label[static_cast<size_t>(w * L + p)] != label[static_cast<size_t>(w * L + q)] ? value : 0.0f;
}

// Swin v2's log-spaced relative coordinates [2wh-1, 2ww-1, 2]: sign(t) log2(|t| + 1) / 3 with
// t = 8 d / (w - 1) for the offset d along each axis (computed in double, as the reference).
inline float log_spaced_coord(int64_t d, int64_t w) {
    const double t = 8.0 * static_cast<double>(d) / static_cast<double>(w - 1);
    const double s = t > 0 ? 1.0 : (t < 0 ? -1.0 : 0.0);
    return static_cast<float>(s * std::log2(std::fabs(t) + 1.0) / 3.0);
}

inline void relative_coords_table(float* out, int64_t wh, int64_t ww) {
    for (int64_t i = 0; i < 2 * wh - 1; ++i)
        for (int64_t j = 0; j < 2 * ww - 1; ++j) {
            out[(i * (2 * ww - 1) + j) * 2] = log_spaced_coord(i - (wh - 1), wh);
            out[(i * (2 * ww - 1) + j) * 2 + 1] = log_spaced_coord(j - (ww - 1), ww);
        }
}

}  // namespace dg
