// dg_rng.h - deterministic parameter initialization for deepgen models.
//
// Bit-identical twin of generator/reference/rng.py: a model built with Model(seed) holds
// exactly the weights the numpy reference computes.  Keep both files in
// lock-step; tests/test_runtime.py checks that they agree bit for bit.
//
// The generator is counter based (no hidden state): element i of a parameter
// draws the 64-bit word mix(seed, name_stream(name), i), so a parameter does
// not depend on which other parameters exist or on initialization order.
//
// Do not compile code using this header with -ffast-math: the results rely on
// IEEE-754 float rounding of each individual operation.
#pragma once

#include <cstdint>
#include <string_view>

namespace dg {

namespace rng_detail {

constexpr uint64_t kFnvOffset = 0xCBF29CE484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001B3ULL;

// splitmix64 constants (Steele, Lea & Flood; as in java.util.SplittableRandom).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMixMul1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMixMul2 = 0x94D049BB133111EBULL;

// Normal draws: 12 uniform chunks of 20 bits taken from 4 words (see init_normal).
constexpr int kNormalWords = 4;
constexpr int kNormalBits = 20;
constexpr uint64_t kNormalChunkMask = (uint64_t{1} << kNormalBits) - 1;
constexpr int64_t kNormalCenter = 6 * static_cast<int64_t>(kNormalChunkMask);

// splitmix64 finalizer.
constexpr uint64_t fmix(uint64_t z) {
  z = (z ^ (z >> 30)) * kMixMul1;
  z = (z ^ (z >> 27)) * kMixMul2;
  return z ^ (z >> 31);
}

// Per-(seed, stream) splitmix64 state.
constexpr uint64_t key(uint64_t seed, uint64_t stream) {
  return fmix(fmix(seed + kGolden) ^ stream);
}

// Output number `counter` of the splitmix64 generator whose state is `k`.
constexpr uint64_t word(uint64_t k, uint64_t counter) {
  return fmix(k + (counter + 1) * kGolden);
}

// Top 24 bits scaled by 2^-24: an exact float in [0, 1).
inline float uniform01(uint64_t w) {
  return static_cast<float>(w >> 40) * (1.0f / 16777216.0f);
}

// Forces `x` to be rounded to float before further use.  Without it the
// compiler may fuse `a + b * c` into one fused multiply-add (GCC does so by
// default on targets with FMA, e.g. aarch64 or -march=native), which rounds
// once instead of twice and would no longer match numpy.  Initialization runs
// once per model, so the cost of the volatile store does not matter.
inline float rounded(float x) {
  volatile float stored = x;
  return stored;
}

}  // namespace rng_detail

// FNV-1a 64-bit hash of the (UTF-8) bytes of a parameter name: its stream id.
constexpr uint64_t name_stream(std::string_view name) {
  uint64_t h = rng_detail::kFnvOffset;
  for (char c : name) {
    h = (h ^ static_cast<unsigned char>(c)) * rng_detail::kFnvPrime;
  }
  return h;
}

// The random 64-bit word for one (seed, stream, counter) triple:
//   key  = fmix(fmix(seed + GOLDEN) ^ stream)
//   word = fmix(key + (counter + 1) * GOLDEN)
// All arithmetic is modulo 2^64.
constexpr uint64_t mix(uint64_t seed, uint64_t stream, uint64_t counter) {
  return rng_detail::word(rng_detail::key(seed, stream), counter);
}

// out[0..n) = value.
inline void init_constant(float* out, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = value;
}

// Uniform in [low, high): low + (high - low) * u, each operation rounded to float.
inline void init_uniform(float* out, int64_t n, uint64_t seed, uint64_t stream, float low, float high) {
  const uint64_t k = rng_detail::key(seed, stream);
  const float span = high - low;
  for (int64_t i = 0; i < n; ++i) {
    const float u = rng_detail::uniform01(rng_detail::word(k, static_cast<uint64_t>(i)));
    out[i] = low + rng_detail::rounded(span * u);
  }
}

// Approximately normal: mean + stddev * z, each operation rounded to float.
//
// z uses the Irwin-Hall approximation (sum of 12 uniforms minus 6, mean 0,
// variance 1, tails cut at +-6) instead of Box-Muller, because log/cos may
// differ in the last bit between libm implementations.  Each uniform is a
// 20-bit integer chunk; the sum of 12 chunks stays below 2^24, so the centered
// sum and its scaling by 2^-20 are exact in float: z involves no rounding.
// Sample i uses the words with counters 4*i .. 4*i+3, three chunks per word
// (bits 44..63, 24..43 and 4..23).
inline void init_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, float mean, float stddev) {
  using namespace rng_detail;
  const uint64_t k = key(seed, stream);
  const float scale = 1.0f / static_cast<float>(uint64_t{1} << kNormalBits);
  for (int64_t i = 0; i < n; ++i) {
    int64_t total = 0;
    for (int j = 0; j < kNormalWords; ++j) {
      const uint64_t w = word(k, static_cast<uint64_t>(i) * kNormalWords + j);
      total += static_cast<int64_t>((w >> 44) & kNormalChunkMask);
      total += static_cast<int64_t>((w >> 24) & kNormalChunkMask);
      total += static_cast<int64_t>((w >> 4) & kNormalChunkMask);
    }
    const float z = static_cast<float>(total - kNormalCenter) * scale;  // exact
    out[i] = mean + rounded(stddev * z);
  }
}

// The train/eval mode the generated code passes to the ops whose behavior
// depends on it (batch norm, dropout), with what dropout draws from: the
// model's seed and the number of training-mode calls made before this one.
struct Mode {
  bool training;
  uint64_t seed;
  uint64_t draw;
};

// Dropout's draws (twin of reference/rng.py's dropout_keep): element i of call
// `mode.draw` is kept when uniform01(word i of key(mix(seed, stream, draw), 0)) >= p.
inline uint64_t dropout_key(const Mode& mode, uint64_t stream) {
  return rng_detail::key(mix(mode.seed, stream, mode.draw), 0);
}

inline bool dropout_keep(uint64_t key, int64_t i, float p) {
  return rng_detail::uniform01(rng_detail::word(key, static_cast<uint64_t>(i))) >= p;
}

}  // namespace dg
