// Checks the CUDA runtime's ops (targets/cuda/runtime) against plain host loops,
// at sizes that cross the GEMM's 64x64x16 tiles and the 256-long row blocks.
//
// Built twice by tests/test_cuda.py: with a C++ compiler and DG_CUDA_EMULATE
// (the kernels' bodies, the GEMM's tile phases included, run on the CPU), and,
// on a machine with a GPU, with nvcc as a .cu file (the real kernels). Prints
// one line per failed check and "ok <count>" at the end; exits 1 on failure.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_gather.h"
#include "dg_cuda_gemm.h"
#include "dg_cuda_layer_norm.h"
#include "dg_cuda_layout.h"
#include "dg_cuda_loss.h"
#include "dg_cuda_masks.h"
#include "dg_cuda_reduce.h"
#include "dg_cuda_tree.h"
#include "dg_cuda_windows.h"

namespace {

int failures = 0, checks = 0;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

template <typename T>
dg::DeviceVector<T> upload(const std::vector<T>& host) {
  dg::DeviceVector<T> d(static_cast<int64_t>(host.size()));
  dg::copy_bytes(d.data(), host.data(), host.size() * sizeof(T));
  return d;
}

template <typename T>
std::vector<T> download(const dg::DeviceVector<T>& d) {
  std::vector<T> host(static_cast<size_t>(d.size()));
  dg::copy_bytes(host.data(), d.data(), host.size() * sizeof(T));
  dg::synchronize();
  return host;
}

void expect_close(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                  float tol = 1e-4f) {
  ++checks;
  if (got.size() != want.size()) {
    std::printf("FAIL %s: %zu values, expected %zu\n", what.c_str(), got.size(), want.size());
    ++failures;
    return;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const float err = std::fabs(got[i] - want[i]);
    if (!(err <= tol * (1.0f + std::fabs(want[i])))) {
      std::printf("FAIL %s: element %zu is %.7g, expected %.7g\n", what.c_str(), i, got[i], want[i]);
      ++failures;
      return;
    }
  }
}

// An epilogue like the generated ones: bias per column, then relu.
struct BiasRelu {
  const float* bias;
  DG_HD void operator()(int64_t /*row*/, int64_t col0, float* acc, int64_t n) const {
    for (int64_t j = 0; j < n; ++j) acc[j] = fmaxf(0.0f, acc[j] + bias[col0 + j]);
  }
};

void check_gemm(int64_t M, int64_t K, int64_t N) {
  const std::string size = " " + std::to_string(M) + "x" + std::to_string(K) + "x" + std::to_string(N);
  const auto a = random_floats(static_cast<size_t>(M * K), 1), b = random_floats(static_cast<size_t>(K * N), 2);
  const auto bias = random_floats(static_cast<size_t>(N), 3);
  // want = a @ b with a [M,K], b [K,N]; at = a^T stored [K,M]; bt = b^T stored [N,K]
  std::vector<float> want(static_cast<size_t>(M * N), 0.0f), at(a.size()), bt(b.size()), fused(want.size());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) at[k * M + i] = a[i * K + k];
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < N; ++j) bt[j * K + k] = b[k * N + j];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(a[i * K + k]) * b[k * N + j];
      want[i * N + j] = static_cast<float>(s);
      fused[i * N + j] = std::max(0.0f, static_cast<float>(s) + bias[j]);
    }
  auto da = upload(a), db = upload(b), dat = upload(at), dbt = upload(bt), dbias = upload(bias);
  dg::DeviceVector<float> c(M * N);
  dg::matmul(da.data(), db.data(), c.data(), M, K, N);
  expect_close("matmul" + size, download(c), want);
  dg::matmul_tn(dat.data(), db.data(), c.data(), M, K, N);
  expect_close("matmul_tn" + size, download(c), want);
  dg::matmul_nt(da.data(), dbt.data(), c.data(), M, K, N);
  expect_close("matmul_nt" + size, download(c), want);
  dg::matmul(da.data(), db.data(), c.data(), M, K, N, BiasRelu{dbias.data()});
  expect_close("matmul+epilogue" + size, download(c), fused);
}

void check_reductions(int64_t outer, int64_t len, int64_t inner) {
  const std::string size = " " + std::to_string(outer) + "x" + std::to_string(len) + "x" + std::to_string(inner);
  const auto x = random_floats(static_cast<size_t>(outer * len * inner), 4);
  std::vector<float> sum(static_cast<size_t>(outer * inner)), mean(sum.size()), max(sum.size());
  std::vector<float> soft(x.size()), logsoft(x.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      double s = 0.0;
      float m = -INFINITY;
      for (int64_t l = 0; l < len; ++l) {
        const float v = x[(o * len + l) * inner + i];
        s += v;
        m = std::max(m, v);
      }
      double z = 0.0;
      for (int64_t l = 0; l < len; ++l) z += std::exp(static_cast<double>(x[(o * len + l) * inner + i]) - m);
      for (int64_t l = 0; l < len; ++l) {
        const int64_t at = (o * len + l) * inner + i;
        soft[at] = static_cast<float>(std::exp(static_cast<double>(x[at]) - m) / z);
        logsoft[at] = static_cast<float>(static_cast<double>(x[at]) - m - std::log(z));
      }
      sum[o * inner + i] = static_cast<float>(s);
      mean[o * inner + i] = static_cast<float>(s / static_cast<double>(len));
      max[o * inner + i] = m;
    }
  auto dx = upload(x);
  dg::DeviceVector<float> y(outer * inner), z(outer * len * inner);
  dg::reduce_sum(dx.data(), y.data(), outer, len, inner);
  expect_close("reduce_sum" + size, download(y), sum, 1e-3f);
  dg::reduce_mean(dx.data(), y.data(), outer, len, inner);
  expect_close("reduce_mean" + size, download(y), mean, 1e-3f);
  dg::reduce_max(dx.data(), y.data(), outer, len, inner);
  expect_close("reduce_max" + size, download(y), max, 0.0f);
  dg::softmax(dx.data(), z.data(), outer, len, inner);
  expect_close("softmax" + size, download(z), soft);
  dg::log_softmax(dx.data(), z.data(), outer, len, inner);
  expect_close("log_softmax" + size, download(z), logsoft);
}

void check_layout() {
  // transpose of [2, 3, 5] with perm (2, 0, 1) -> [5, 2, 3]
  const int64_t shape[] = {2, 3, 5};
  const int perm[] = {2, 0, 1};
  const auto x = random_floats(30, 5);
  std::vector<float> want(30);
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 5; ++c) want[(c * 2 + a) * 3 + b] = x[(a * 3 + b) * 5 + c];
  auto dx = upload(x);
  dg::DeviceVector<float> y(30);
  dg::transpose(dx.data(), y.data(), 3, shape, perm);
  expect_close("transpose", download(y), want, 0.0f);
  // copy_axis: columns 1..3 of a [4, 5] into columns 2..4 of a [4, 6]
  std::vector<float> dst_want(24, 0.0f);
  for (int64_t o = 0; o < 4; ++o)
    for (int64_t c = 0; c < 3; ++c) dst_want[o * 6 + 2 + c] = x[o * 5 + 1 + c];
  dg::DeviceVector<float> dst(24);
  dg::copy_axis(dx.data(), dst.data(), 4, 5, 1, 6, 2, 3, 1);
  expect_close("copy_axis", download(dst), dst_want, 0.0f);
}

void check_gather_scatter_xent() {
  const int64_t rows = 7, width = 70, n = 9, classes = 5;
  const auto table = random_floats(static_cast<size_t>(rows * width), 6);
  const std::vector<int64_t> ids = {3, 0, 6, 3, 3, 1, 2, 6, 0};
  std::vector<float> gathered(static_cast<size_t>(n * width)), scattered(table.size(), 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < width; ++c) {
      gathered[i * width + c] = table[ids[i] * width + c];
      scattered[ids[i] * width + c] += table[(i % rows) * width + c];
    }
  auto dtable = upload(table);
  auto dids = upload(ids);
  dg::DeviceVector<float> out(n * width), grad(rows * width);
  {
    dg::CallScope call;
    dg::gather_rows<int64_t>(dtable.data(), rows, width, dids.data(), n, out.data(), "gather");
    call.finish();
  }
  expect_close("gather_rows", download(out), gathered, 0.0f);
  std::vector<float> src(static_cast<size_t>(n * width));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < width; ++c) src[i * width + c] = table[(i % rows) * width + c];
  auto dsrc = upload(src);
  dg::scatter_add_rows<int64_t>(dids.data(), n, dsrc.data(), width, grad.data(), rows);
  expect_close("scatter_add_rows", download(grad), scattered, 1e-5f);

  // A bad id is reported with the CPU target's message, at the first bad position.
  const std::vector<int64_t> bad_ids = {1, 2, 9, 0, -1};
  auto dbad = upload(bad_ids);
  ++checks;
  try {
    dg::CallScope call;
    dg::gather_rows<int64_t>(dtable.data(), rows, width, dbad.data(), 5, out.data(), "gather 'emb'");
    call.finish();
    std::printf("FAIL gather_rows accepted a bad id\n");
    ++failures;
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()) != "gather 'emb': index 9 at position 2 is out of range [0, 7)") {
      std::printf("FAIL gather_rows message: %s\n", e.what());
      ++failures;
    }
  }

  // softmax cross-entropy and its gradient
  const auto logits = random_floats(static_cast<size_t>(n * classes), 7);
  const std::vector<int32_t> labels = {0, 4, 2, 2, 1, 3, 0, 4, 1};
  double total = 0.0;
  std::vector<float> dlogits(logits.size());
  const float g = 2.0f;
  for (int64_t i = 0; i < n; ++i) {
    float m = -INFINITY;
    for (int64_t j = 0; j < classes; ++j) m = std::max(m, logits[i * classes + j]);
    double z = 0.0;
    for (int64_t j = 0; j < classes; ++j) z += std::exp(static_cast<double>(logits[i * classes + j]) - m);
    total += m + std::log(z) - logits[i * classes + labels[i]];
    for (int64_t j = 0; j < classes; ++j)
      dlogits[i * classes + j] =
          static_cast<float>((std::exp(logits[i * classes + j] - m) / z - (j == labels[i] ? 1.0 : 0.0)) * g / n);
  }
  auto dl = upload(logits);
  auto dlab = upload(labels);
  auto dg_ = upload(std::vector<float>{g});
  dg::DeviceVector<float> loss(1), d(n * classes);
  {
    dg::CallScope call;
    dg::softmax_xent<int32_t>(dl.data(), dlab.data(), loss.data(), n, classes, "xent");
    call.finish();
  }
  expect_close("softmax_xent", download(loss), {static_cast<float>(total / n)});
  dg::softmax_xent_grad<int32_t>(dl.data(), dlab.data(), dg_.data(), d.data(), n, classes);
  expect_close("softmax_xent_grad", download(d), dlogits);
}

void check_tree() {
  // ((0, 1), 2) as nodes: 3 = (0, 1), 4 = (3, 2); leaves 0, 1, 2.
  const std::vector<int64_t> children = {-1, -1, -1, -1, -1, -1, 0, 1, 3, 2};
  const std::vector<int64_t> roots = {4};
  auto dchildren = upload(children);
  auto droots = upload(roots);
  const dg::LevelSchedule s = dg::schedule_levels(dchildren.data(), 5, 2, droots.data(), 1, false, "trees");
  ++checks;
  if (s.levels() != 3 || s.leaves() != 3 || s.max_level_rows != 1) {
    std::printf("FAIL schedule_levels: %lld levels, %lld leaves\n", static_cast<long long>(s.levels()),
                static_cast<long long>(s.leaves()));
    ++failures;
  }
  const std::vector<float> state = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};  // [5 rows, width 2]
  auto dstate = upload(state);
  dg::DeviceVector<float> out(2), unsorted(10);
  // The last level (row 4) has children rows 3 and 2.
  dg::gather_children(dstate.data(), 2, s.child_row.data() + 4 * 2, 2, 1, 1, out.data());
  expect_close("gather_children", download(out), {4, 5}, 0.0f);
  dg::unsort_rows(dstate.data(), s.order.data(), 5, 2, unsorted.data());
  expect_close("unsort_rows", download(unsorted), state, 0.0f);  // already in height order
  // (0, 1) as node 2 before leaf 3, 4 = (2, 3): rows 0, 1, 3, 2, 4 in height order, so node 4's
  // children are rows 3 and 2, i.e. nodes 2 and 3 of a state kept in node order.
  const std::vector<int64_t> later_leaf = {-1, -1, -1, -1, 0, 1, -1, -1, 2, 3};
  auto dlater = upload(later_leaf);
  const dg::LevelSchedule t = dg::schedule_levels(dlater.data(), 5, 2, droots.data(), 1, false, "trees");
  const std::vector<int64_t> order = download(t.order);
  expect_close("schedule order", std::vector<float>(order.begin(), order.end()), {0, 1, 3, 2, 4}, 0.0f);
  dg::DeviceVector<float> both(4);
  for (int64_t slot = 0; slot < 2; ++slot)
    dg::gather_child_nodes(dstate.data(), 2, t.order.data(), t.child_row.data() + 4 * 2, 2, slot, 1,
                           both.data() + 2 * slot, /*out_stride=*/4);
  expect_close("gather_child_nodes", download(both), {4, 5, 6, 7}, 0.0f);
  dg::unsort_rows(dstate.data(), t.order.data(), 5, 2, unsorted.data());
  expect_close("unsort_rows", download(unsorted), {0, 1, 2, 3, 6, 7, 4, 5, 8, 9}, 0.0f);
  ++checks;
  try {
    const std::vector<int64_t> cycle = {1, -1, 0, -1};
    auto dcycle = upload(cycle);
    dg::schedule_levels(dcycle.data(), 2, 2, droots.data(), 0, false, "trees");
    std::printf("FAIL schedule_levels accepted an empty batch\n");
    ++failures;
  } catch (const std::invalid_argument&) {
  }
}

// Windowed attention's tables (ops/windows.py) against their definitions: the bias-table row
// of each (query, key) offset; Swin's mask from the regions its slice assignments label; the
// log-spaced coordinates.
void check_window_tables() {
  const int64_t wh = 2, ww = 3, L = wh * ww;
  std::vector<int64_t> index_want;
  for (int64_t p = 0; p < L; ++p)
    for (int64_t q = 0; q < L; ++q) index_want.push_back((p / ww - q / ww + wh - 1) * (2 * ww - 1) + p % ww - q % ww + ww - 1);
  dg::DeviceVector<int64_t> index(L * L);
  dg::relative_position_index(index.data(), wh, ww);
  ++checks;
  if (download(index) != index_want) {
    std::printf("FAIL relative_position_index\n");
    ++failures;
  }
  for (auto [sh, sw] : {std::array<int64_t, 2>{1, 2}, {0, 1}}) {
    const int64_t H = 4, W = 6;
    std::vector<int64_t> label(H * W, 0);
    const int64_t hs[4] = {0, H - wh, H - sh, H}, ws[4] = {0, W - ww, W - sw, W};
    for (int a = 0; a < 3; ++a)
      for (int b = 0; b < 3; ++b)
        for (int64_t y = hs[a]; y < hs[a + 1]; ++y)
          for (int64_t x = ws[b]; x < ws[b + 1]; ++x) label[y * W + x] = (sh ? a : 0) * 3 + (sw ? b : 0);
    std::vector<float> want;
    for (int64_t top = 0; top < H; top += wh)
      for (int64_t left = 0; left < W; left += ww)
        for (int64_t p = 0; p < L; ++p)
          for (int64_t q = 0; q < L; ++q)
            want.push_back(label[(top + p / ww) * W + left + p % ww] != label[(top + q / ww) * W + left + q % ww]
                               ? -100.0f : 0.0f);
    dg::DeviceVector<float> mask(static_cast<int64_t>(want.size()));
    dg::shifted_window_mask(mask.data(), H, W, wh, ww, sh, sw, -100.0f);
    expect_close("shifted_window_mask", download(mask), want, 0.0f);
  }
  std::vector<float> coords_want;
  for (int64_t i = 0; i < 2 * wh - 1; ++i)
    for (int64_t j = 0; j < 2 * ww - 1; ++j)
      for (auto [d, w] : {std::array<int64_t, 2>{i - wh + 1, wh}, {j - ww + 1, ww}}) {
        const double t = 8.0 * static_cast<double>(d) / static_cast<double>(w - 1);
        coords_want.push_back(static_cast<float>((t > 0) - (t < 0)) * static_cast<float>(std::log2(std::fabs(t) + 1.0) / 3.0));
      }
  dg::DeviceVector<float> coords(static_cast<int64_t>(coords_want.size()));
  dg::relative_coords_table(coords.data(), wh, ww);
  expect_close("relative_coords_table", download(coords), coords_want, 1e-6f);
}

}  // namespace

int main() {
  try {
    for (auto [M, K, N] : {std::array<int64_t, 3>{1, 1, 1}, {3, 4, 5}, {64, 16, 64}, {65, 17, 63}, {130, 37, 70},
                           {7, 0, 5}, {200, 300, 129}})
      check_gemm(M, K, N);
    for (auto [o, l, i] : {std::array<int64_t, 3>{3, 5, 1}, {2, 7, 3}, {4, 300, 1}, {2, 1000, 1}, {1, 513, 2}})
      check_reductions(o, l, i);
    check_layout();
    check_gather_scatter_xent();
    check_tree();
    check_window_tables();
    dg::synchronize();
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("%s %d checks, %d failed\n", failures ? "FAILED" : "ok", checks, failures);
  return failures ? 1 : 0;
}
