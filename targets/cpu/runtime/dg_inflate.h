// dg_inflate.h: a small DEFLATE decoder (RFC 1951), so that the weights files
// numpy's np.savez_compressed writes can be read without zlib.
//
// inflate(data, size, expected) decodes one raw DEFLATE stream (no zlib or gzip
// wrapper: what a zip member with method 8 holds) and throws
// std::invalid_argument on a malformed stream or one that does not decode to
// exactly `expected` bytes: it stops at the first byte past `expected`, so a
// stream that would inflate to far more costs no more than `expected`.
// inflate_prefix(data, size, count) decodes only the first `count` bytes (an
// .npy header, read before its data). Speed is modest (codes are decoded bit by
// bit); weights files are read once.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17, no dependencies.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dg {
namespace inflate_detail {

[[noreturn]] inline void fail(const std::string& why) {
  throw std::invalid_argument("corrupt compressed data (" + why + ")");
}

// Reads the stream's bits, least significant first, as DEFLATE packs them.
class BitReader {
 public:
  BitReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint32_t bits(int count) {
    uint32_t value = 0;
    for (int i = 0; i < count; ++i)
      value |= static_cast<uint32_t>(bit()) << i;
    return value;
  }

  int bit() {
    if (byte_ >= size_) fail("the stream ends early");
    const int b = (data_[byte_] >> shift_) & 1;
    if (++shift_ == 8) {
      shift_ = 0;
      ++byte_;
    }
    return b;
  }

  // Stored blocks start at a byte boundary.
  void align() {
    if (shift_ != 0) {
      shift_ = 0;
      ++byte_;
    }
  }

  const uint8_t* take_bytes(size_t count) {
    if (size_ - byte_ < count) fail("a stored block runs past the end");
    const uint8_t* at = data_ + byte_;
    byte_ += count;
    return at;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t byte_ = 0;
  int shift_ = 0;
};

// A canonical Huffman code given by its code lengths: how many codes each
// length has, and the symbols in code order.
class Huffman {
 public:
  Huffman(const uint8_t* lengths, int symbols) : sorted_(symbols) {
    for (int s = 0; s < symbols; ++s)
      ++count_[lengths[s]];
    count_[0] = 0;
    int left = 1;  // codes of the current length not yet used
    for (int len = 1; len <= kMaxBits; ++len) {
      left = 2 * left - count_[len];
      if (left < 0) fail("a Huffman code is over-subscribed");
    }
    std::array<int, kMaxBits + 2> offset{};
    for (int len = 1; len <= kMaxBits; ++len)
      offset[len + 1] = offset[len] + count_[len];
    for (int s = 0; s < symbols; ++s)
      if (lengths[s] != 0) sorted_[offset[lengths[s]]++] = static_cast<uint16_t>(s);
  }

  // The next symbol: codes of each length are consecutive numbers, so walk the
  // lengths until the bits read so far fall inside the current length's range.
  int decode(BitReader& in) const {
    int code = 0, first = 0, index = 0;
    for (int len = 1; len <= kMaxBits; ++len) {
      code |= in.bit();
      const int count = count_[len];
      if (code - first < count) return sorted_[index + code - first];
      index += count;
      first = (first + count) << 1;
      code <<= 1;
    }
    fail("an invalid Huffman code");
  }

 private:
  static constexpr int kMaxBits = 15;
  std::array<int, kMaxBits + 1> count_{};
  std::vector<uint16_t> sorted_;
};

constexpr uint16_t kLengthBase[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                      31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
constexpr uint8_t kLengthExtra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                      2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
constexpr uint16_t kDistBase[30] = {1,    2,    3,    4,    5,    7,    9,    13,    17,    25,
                                    33,   49,   65,   97,   129,  193,  257,  385,   513,   769,
                                    1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577};
constexpr uint8_t kDistExtra[30] = {0, 0, 0, 0, 1, 1, 2, 2,  3,  3,  4,  4,  5,  5,  6,
                                    6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13};

// The most bytes `size` bytes of DEFLATE stream can decode to: a length-258
// back reference coded in 2 bits (1032 bytes per byte of stream), plus slack
// for a block header. A size claimed beyond it is a lie, refused unallocated.
inline uint64_t most_inflated(size_t size) {
  return 1032 * static_cast<uint64_t>(size) + 1024;
}

class Decoder {
 public:
  // Decodes up to `limit` bytes; with `prefix`, stopping there is success.
  Decoder(const uint8_t* data, size_t size, size_t limit, bool prefix)
      : in_(data, size), limit_(limit), prefix_(prefix) {
    if (limit > most_inflated(size))
      fail("the archive says it holds " + std::to_string(limit) + " bytes, more than " +
           std::to_string(size) + " bytes of compressed data can hold");
    out_.reserve(limit);
  }

  std::vector<uint8_t> run() {
    try {
      blocks();
    } catch (const Full&) {  // a prefix is complete: the rest of the stream is not decoded
      return std::move(out_);
    }
    if (out_.size() != limit_)
      fail("it holds " + std::to_string(out_.size()) + " bytes, the archive says " + std::to_string(limit_));
    return std::move(out_);
  }

 private:
  struct Full {};  // thrown by put() when a prefix has all its bytes

  void blocks() {
    if (prefix_ && limit_ == 0) throw Full{};
    bool last = false;
    while (!last) {
      last = in_.bit() != 0;
      switch (in_.bits(2)) {
        case 0:
          stored();
          break;
        case 1:
          fixed();
          break;
        case 2:
          dynamic();
          break;
        default:
          fail("a block of the reserved type 3");
      }
    }
  }

  void put(uint8_t byte) {
    if (out_.size() == limit_) fail("it holds more bytes than the archive says");
    out_.push_back(byte);
    if (prefix_ && out_.size() == limit_) throw Full{};
  }

  void stored() {
    in_.align();
    const uint8_t* header = in_.take_bytes(4);
    const unsigned length = header[0] | header[1] << 8;
    const unsigned check = header[2] | header[3] << 8;
    if ((length ^ 0xffffu) != check) fail("a stored block's length check does not match");
    const uint8_t* bytes = in_.take_bytes(length);
    for (unsigned i = 0; i < length; ++i)
      put(bytes[i]);
  }

  void fixed() {
    uint8_t lengths[288 + 30];
    for (int s = 0; s < 288; ++s)
      lengths[s] = s < 144 ? 8 : s < 256 ? 9 : s < 280 ? 7 : 8;
    for (int s = 0; s < 30; ++s)
      lengths[288 + s] = 5;
    codes(Huffman(lengths, 288), Huffman(lengths + 288, 30));
  }

  void dynamic() {
    const int literals = static_cast<int>(in_.bits(5)) + 257;
    const int distances = static_cast<int>(in_.bits(5)) + 1;
    const int code_lengths = static_cast<int>(in_.bits(4)) + 4;
    if (literals > 286 || distances > 30) fail("too many codes in a dynamic block");
    static constexpr uint8_t kOrder[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};
    uint8_t lengths[286 + 30] = {};
    for (int i = 0; i < code_lengths; ++i)
      lengths[kOrder[i]] = static_cast<uint8_t>(in_.bits(3));
    for (int i = code_lengths; i < 19; ++i)
      lengths[kOrder[i]] = 0;
    const Huffman lengths_code(lengths, 19);
    int n = 0;
    while (n < literals + distances) {
      const int symbol = lengths_code.decode(in_);
      if (symbol < 16) {
        lengths[n++] = static_cast<uint8_t>(symbol);
        continue;
      }
      uint8_t value = 0;
      int repeat = 0;
      if (symbol == 16) {
        if (n == 0) fail("a length repeat with no previous length");
        value = lengths[n - 1];
        repeat = 3 + static_cast<int>(in_.bits(2));
      } else if (symbol == 17) {
        repeat = 3 + static_cast<int>(in_.bits(3));
      } else {
        repeat = 11 + static_cast<int>(in_.bits(7));
      }
      if (n + repeat > literals + distances) fail("code lengths run past their count");
      while (repeat-- > 0)
        lengths[n++] = value;
    }
    if (lengths[256] == 0) fail("a block without an end-of-block code");
    codes(Huffman(lengths, literals), Huffman(lengths + literals, distances));
  }

  // Literals and back references up to the end-of-block symbol.
  void codes(const Huffman& literal, const Huffman& distance) {
    for (;;) {
      const int symbol = literal.decode(in_);
      if (symbol < 256) {
        put(static_cast<uint8_t>(symbol));
        continue;
      }
      if (symbol == 256) return;
      const int l = symbol - 257;
      if (l >= 29) fail("an invalid length symbol");
      const size_t length = kLengthBase[l] + in_.bits(kLengthExtra[l]);
      const int d = distance.decode(in_);
      if (d >= 30) fail("an invalid distance symbol");
      const size_t back = kDistBase[d] + in_.bits(kDistExtra[d]);
      if (back > out_.size()) fail("a back reference before the start of the data");
      for (size_t i = 0; i < length; ++i)
        put(out_[out_.size() - back]);
    }
  }

  BitReader in_;
  size_t limit_;
  bool prefix_;
  std::vector<uint8_t> out_;
};

}  // namespace inflate_detail

// The `expected` bytes a raw DEFLATE stream decodes to (exactly so many).
inline std::vector<uint8_t> inflate(const uint8_t* data, size_t size, size_t expected) {
  return inflate_detail::Decoder(data, size, expected, /*prefix=*/false).run();
}

// The first `count` bytes a raw DEFLATE stream decodes to; the rest is not decoded.
inline std::vector<uint8_t> inflate_prefix(const uint8_t* data, size_t size, size_t count) {
  return inflate_detail::Decoder(data, size, count, /*prefix=*/true).run();
}

}  // namespace dg
