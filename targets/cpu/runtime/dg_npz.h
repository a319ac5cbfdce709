// dg_npz.h: numpy's .npy and .npz files, read and written in C++.
//
// Reading: .npy format versions 1, 2 and 3; any byte order; C or Fortran order
// (Fortran order is rearranged to C order); numeric dtypes (bool, int, uint,
// float). .npz archives as np.savez (stored) and np.savez_compressed (deflated)
// write them, zip64 included. Writing: .npy version 1 and stored .npz, as
// np.savez writes them, with a fixed timestamp so equal arrays give equal files.
//
// Files are read whole, and only regular files: a folder, a FIFO or a device
// such as /dev/zero is refused before it is opened. An .npy header is parsed
// strictly (the three keys numpy writes, a dtype, a tuple of sizes >= 0), and
// its shape must account for every byte after it. An .npz archive's members
// are read header first (NpzFile): a compressed member is inflated no further
// than its header's shape needs, and only when its data is asked for.
//
// A malformed file throws std::invalid_argument naming the file (and, in an
// archive, the array) and what is wrong with it; a file that cannot be opened,
// read or written throws dg::FileError; memory running out while reading
// throws dg::OutOfMemory (a std::bad_alloc) naming the file and array.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17, no dependencies.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>  // fsync: a saved file is on disk before it replaces the old one
#endif

#include "dg_inflate.h"
#include "dg_tensor.h"

namespace dg {

// A file that cannot be opened, read or written (Python: FileNotFoundError
// when `missing`, else OSError).
class FileError : public std::runtime_error {
 public:
  FileError(const std::string& what, bool is_missing) : std::runtime_error(what), missing(is_missing) {}
  bool missing;
};

// Memory ran out while reading a file: a std::bad_alloc (Python: MemoryError)
// whose message names the file and array and the bytes asked for.
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

// One array as a file stores it, converted to C order and little-endian.
struct NpyArray {
  char kind = 0;      // numpy's dtype.kind: 'b', 'i', 'u', 'f'; '?' for any other dtype
  int itemsize = 0;   // bytes per element
  std::string descr;  // for kind '?': the file's dtype ("<U3", "|O"); its values are not read
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // numel(shape) * itemsize

  int64_t size() const { return numel(shape); }
  // numpy's name of the dtype: "float32", "int64", "bool", ...
  std::string dtype() const {
    const std::string bits = std::to_string(8 * itemsize);
    if (kind == '?') return descr;
    return kind == 'b' ? "bool" : kind == 'f' ? "float" + bits : kind == 'i' ? "int" + bits : "uint" + bits;
  }
  // Element i as a double (exact for every value but int64/uint64 beyond 2**53).
  double number(int64_t i) const;
  // Element i of an integer (or bool) array, exactly (uint64 beyond int64 wraps).
  int64_t integer(int64_t i) const;
};

// An array to write: float32 or int64 data, C order.
struct NpyOut {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> floats;  // used when !is_int
  std::vector<int64_t> ints;
  bool is_int = false;
};

namespace npz_detail {

inline uint32_t crc32(const uint8_t* data, size_t size) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k)
        c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i)
    c = table[(c ^ data[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i)
    v = (v << 8) | p[i];
  return v;
}

inline void put_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Fortran order (first index fastest) to C order (last index fastest).
inline std::vector<uint8_t> fortran_to_c(const std::vector<uint8_t>& from, const std::vector<int64_t>& shape,
                                         int itemsize) {
  std::vector<uint8_t> to(from.size());
  const size_t rank = shape.size();
  std::vector<int64_t> index(rank, 0);
  const int64_t count = numel(shape);
  for (int64_t c = 0; c < count; ++c) {  // c walks C order; f is the same element's Fortran position
    int64_t f = 0;
    for (size_t k = rank; k-- > 0;)
      f = f * shape[k] + index[k];
    std::memcpy(&to[c * itemsize], &from[f * itemsize], itemsize);
    for (size_t k = rank; k-- > 0;) {
      if (++index[k] < shape[k]) break;
      index[k] = 0;
    }
  }
  return to;
}

// Refuses a path no file can be at: empty, or holding a NUL byte (which the
// file system would cut it at).
inline void check_path(const std::string& path) {
  if (path.empty()) throw std::invalid_argument("the path is empty: name a file");
  if (path.find('\0') != std::string::npos)
    throw std::invalid_argument(path.substr(0, path.find('\0')) + "...: the path holds a NUL byte");
}

// What a path that is not a regular file is: "a folder", "a FIFO", ...
inline std::string kind_of(const std::filesystem::file_status& status) {
  switch (status.type()) {
    case std::filesystem::file_type::directory:
      return "a folder";
    case std::filesystem::file_type::fifo:
      return "a FIFO";
    case std::filesystem::file_type::character:
      return "a character device";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::socket:
      return "a socket";
    default:
      return "not a regular file";
  }
}

// The whole of the regular file at `path`. Anything else is refused before it is
// opened: a FIFO would block, /dev/zero would never end.
inline std::vector<uint8_t> read_file(const std::string& path) {
  check_path(path);
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);  // symlinks followed
  if (status.type() == std::filesystem::file_type::not_found)
    throw FileError("cannot open " + path + ": " + std::strerror(ENOENT), true);
  if (ec) throw FileError("cannot open " + path + ": " + ec.message(), false);
  if (status.type() != std::filesystem::file_type::regular)
    throw FileError(path + ": is " + kind_of(status) + ", not a regular file", false);
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw FileError("cannot read " + path + ": " + ec.message(), false);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError("cannot open " + path + ": " + std::strerror(errno), errno == ENOENT);
  std::vector<uint8_t> data;
  try {
    data.resize(static_cast<size_t>(size));
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(path + ": the file's " + std::to_string(size) + " bytes do not fit in memory");
  }
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(size));
  if (in.bad()) throw FileError("cannot read " + path, false);
  if (static_cast<uintmax_t>(in.gcount()) != size)
    throw FileError("cannot read " + path + ": it became shorter while it was read", false);
  return data;
}

// What a .npy header says: the array's dtype and shape (in `array`, without
// its bytes), its layout, and where its data starts and how long it is.
struct NpyHeader {
  NpyArray array;
  bool fortran = false;
  bool big_endian = false;
  size_t data_at = 0;       // the magic string, version, length field and dict come first
  uint64_t data_bytes = 0;  // numel(shape) * itemsize; 0 for a dtype that is not read (kind '?')
};

// The longest .npy header read: a numeric array's takes about 128 bytes (numpy
// itself refuses headers over 10000 bytes by default).
constexpr size_t kMaxNpyHeader = 65536;

// The bytes an .npy image's header takes, from its first 12 (or fewer) bytes.
inline size_t npy_header_size(const uint8_t* data, size_t size, const std::string& what) {
  static const char kMagic[] = "\x93NUMPY";
  if (size < 8 || std::memcmp(data, kMagic, 6) != 0) throw std::invalid_argument(what + ": not a .npy array");
  const int major = data[6], minor = data[7];
  if (major < 1 || major > 3 || minor != 0)
    throw std::invalid_argument(what + ": .npy format version " + std::to_string(major) + "." +
                                std::to_string(minor) + " is not supported (1.0, 2.0 and 3.0 are)");
  const size_t prefix = major == 1 ? 10 : 12;
  if (size < prefix) throw std::invalid_argument(what + ": truncated .npy header");
  const uint64_t header_len = le(data + 8, major == 1 ? 2 : 4);
  if (header_len > kMaxNpyHeader)
    throw std::invalid_argument(what + ": the .npy header says it is " + std::to_string(header_len) +
                                " bytes long, more than the " + std::to_string(kMaxNpyHeader) + " read");
  return prefix + static_cast<size_t>(header_len);
}

// The header's dict, parsed as strictly as numpy writes it:
//   {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
// the three keys once each (in any order), then spaces up to a newline.
class NpyHeaderDict {
 public:
  NpyHeaderDict(const std::string& text, const std::string& what) : text_(text), what_(what) {
    bool seen_descr = false, seen_fortran = false, seen_shape = false;
    spaces();
    expect('{');
    for (;;) {
      spaces();
      if (take('}')) break;
      const std::string key = quoted("a key");
      bool* seen = key == "descr"           ? &seen_descr
                   : key == "fortran_order" ? &seen_fortran
                   : key == "shape"         ? &seen_shape
                                            : nullptr;
      if (seen == nullptr) bad("unknown key '" + printable(key) + "'");
      if (*seen) bad("key '" + key + "' given twice");
      *seen = true;
      spaces();
      expect(':');
      spaces();
      if (key == "descr") {
        if (at() == '[')
          throw std::invalid_argument(what_ + ": has a structured dtype, expected a plain numeric array");
        descr = quoted("'descr'");
      } else if (key == "fortran_order") {
        fortran_order = boolean();
      } else {
        shape = tuple();
      }
      spaces();
      if (take(',')) continue;
      expect('}');
      break;
    }
    if (!seen_descr || !seen_fortran || !seen_shape)
      bad(std::string("no '") + (!seen_descr ? "descr" : !seen_fortran ? "fortran_order" : "shape") + "'");
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\r'))
      ++pos_;
    if (pos_ + 1 != text_.size() || text_[pos_] != '\n')
      bad("something other than spaces after its closing '}'");
  }

  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;

 private:
  [[noreturn]] void bad(const std::string& why) const {
    throw std::invalid_argument(what_ + ": malformed .npy header (" + why + ")");
  }
  // Up to 40 characters of `s`, with anything unprintable as '?'.
  static std::string printable(const std::string& s) {
    std::string out;
    for (char c : s.substr(0, 40))
      out += (c >= 32 && c < 127) ? c : '?';
    return s.size() > 40 ? out + "..." : out;
  }
  char at() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void spaces() {
    while (at() == ' ')
      ++pos_;
  }
  bool take(char c) {
    if (pos_ >= text_.size() || text_[pos_] != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!take(c))
      bad(std::string("expected '") + c + "' at byte " + std::to_string(pos_) + ", found '" +
          printable(text_.substr(pos_, 12)) + "'");
  }
  std::string quoted(const char* what) {
    const char quote = at();
    if (quote != '\'' && quote != '"') bad(std::string(what) + " is not a quoted string");
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string::npos) bad(std::string(what) + " has no closing quote");
    std::string value = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return value;
  }
  bool boolean() {
    if (text_.compare(pos_, 4, "True") == 0) return pos_ += 4, true;
    if (text_.compare(pos_, 5, "False") == 0) return pos_ += 5, false;
    bad("'fortran_order' is neither True nor False");
  }
  // A tuple of sizes, as Python writes it: (), (5,), (3, 4).
  std::vector<int64_t> tuple() {
    const size_t start = pos_;
    auto shown = [&] { return printable(text_.substr(start, text_.find(')', start) + 1 - start)); };
    std::vector<int64_t> sizes;
    expect('(');
    for (;;) {
      spaces();
      if (take(')')) return sizes;
      if (at() == '-') bad("'shape' " + shown() + " has a negative size");
      const size_t digits = pos_;
      while (at() >= '0' && at() <= '9')
        ++pos_;
      if (pos_ == digits) bad("'shape' " + shown() + " is not a tuple of whole numbers");
      if (pos_ - digits > 18) bad("'shape' " + shown() + " has a size too large");
      sizes.push_back(std::stoll(text_.substr(digits, pos_ - digits)));
      spaces();
      if (take(',')) continue;
      if (sizes.size() == 1 && at() == ')')
        bad("'shape' " + shown() + " is not a tuple (one size is written (n,))");
      expect(')');
      return sizes;
    }
  }

  const std::string& text_;
  const std::string& what_;
  size_t pos_ = 0;
};

// The header of the .npy image at `data` (`size` bytes, at least
// npy_header_size of them). `what` names it in errors ("w.npz: array 'fc1_w'").
inline NpyHeader parse_npy_header(const uint8_t* data, size_t size, const std::string& what) {
  NpyHeader h;
  h.data_at = npy_header_size(data, size, what);
  if (size < h.data_at) throw std::invalid_argument(what + ": truncated .npy header");
  const size_t prefix = data[6] == 1 ? 10 : 12;
  const std::string text(reinterpret_cast<const char*>(data + prefix), h.data_at - prefix);
  const NpyHeaderDict dict(text, what);
  NpyArray& a = h.array;
  a.shape = dict.shape;
  h.fortran = dict.fortran_order;
  const std::string& descr = dict.descr;
  // A numeric dtype is a byte order, a kind and an item size: '<f4', '>i8', '|b1'.
  const bool ordered = !descr.empty() && std::string("<>|=").find(descr[0]) != std::string::npos;
  const bool numeric =
      ordered && descr.size() >= 2 && std::string("biuf").find(descr[1]) != std::string::npos;
  if (numeric) {
    const std::string digits = descr.substr(2);
    if (digits.empty() || digits.size() > 2 || digits.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument(what + ": malformed .npy header ('descr' '" + descr + "' is not a dtype)");
    a.kind = descr[1];
    a.itemsize = std::stoi(digits);
  }
  const bool readable =
      numeric && ((a.kind == 'f' && (a.itemsize == 2 || a.itemsize == 4 || a.itemsize == 8)) ||
                  ((a.kind == 'i' || a.kind == 'u') &&
                   (a.itemsize == 1 || a.itemsize == 2 || a.itemsize == 4 || a.itemsize == 8)) ||
                  (a.kind == 'b' && a.itemsize == 1));
  if (!readable) {
    a.kind =
        '?';  // strings, objects, complex, float128...: named, not read (whoever asked for numbers refuses it)
    a.itemsize = 0;
    a.descr = descr;
    return h;
  }
  h.big_endian = descr[0] == '>';
  int64_t count = 0, bytes = 0;
  try {
    count = numel(a.shape);
  } catch (const std::length_error&) {
    count = -1;
  }
  if (count < 0 || __builtin_mul_overflow(count, static_cast<int64_t>(a.itemsize), &bytes))
    throw std::invalid_argument(what + ": the .npy shape " + shape_str(a.shape) + " is too large");
  h.data_bytes = static_cast<uint64_t>(bytes);
  return h;
}

// The array an .npy image holds, whose data is the `size - h.data_at` bytes of
// `data` after its header: exactly h.data_bytes of them.
inline NpyArray npy_array(const NpyHeader& h, const uint8_t* data, size_t size, const std::string& what) {
  NpyArray a = h.array;
  if (a.kind == '?') return a;
  const uint64_t have = size - h.data_at;
  if (have < h.data_bytes)
    throw std::invalid_argument(what + ": truncated: its shape " + shape_str(a.shape) + " needs " +
                                std::to_string(h.data_bytes) + " bytes of data, the file has " +
                                std::to_string(have));
  if (have > h.data_bytes)
    throw std::invalid_argument(what + ": " + std::to_string(have - h.data_bytes) + " bytes after the " +
                                std::to_string(h.data_bytes) + " bytes of data its shape " +
                                shape_str(a.shape) + " needs");
  try {
    a.bytes.assign(data + h.data_at, data + size);
    if (h.big_endian && a.itemsize > 1)
      for (size_t i = 0; i < a.bytes.size(); i += a.itemsize)
        std::reverse(a.bytes.begin() + i, a.bytes.begin() + i + a.itemsize);
    if (h.fortran && a.shape.size() > 1) a.bytes = fortran_to_c(a.bytes, a.shape, a.itemsize);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(what + ": its shape " + shape_str(a.shape) + " needs " + std::to_string(h.data_bytes) +
                      " bytes, more memory than is free");
  }
  return a;
}

// One .npy image: `what` names it in errors ("w.npz: array 'fc1_w'").
inline NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what) {
  return npy_array(parse_npy_header(data, size, what), data, size, what);
}

inline float half_to_float(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    value = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    value = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return (h & 0x8000) ? -value : value;
}

// A stored archive member: its name and where its bytes lie in the file.
struct Member {
  std::string name;
  int method = 0;
  uint32_t crc = 0;
  uint64_t compressed = 0, size = 0, offset = 0;
};

// The central directory of a zip file (`why` is thrown for what is malformed).
inline std::vector<Member> zip_members(const std::vector<uint8_t>& file, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(path + ": not an .npz archive (" + why + ")");
  };
  const uint8_t* d = file.data();
  const size_t n = file.size();
  if (n < 22) throw bad("too short for a zip file");
  size_t eocd = std::string::npos;
  for (size_t at = n - 22 + 1; at-- > 0 && n - at <= 22 + 0xffff;)
    if (le(d + at, 4) == 0x06054b50) {
      eocd = at;
      break;
    }
  if (eocd == std::string::npos) throw bad("no zip directory at its end: truncated, or not a zip file");
  uint64_t count = le(d + eocd + 10, 2), dir_size = le(d + eocd + 12, 4), dir_at = le(d + eocd + 16, 4);
  if (le(d + eocd + 4, 2) != 0 || le(d + eocd + 6, 2) != 0) throw bad("a multi-part zip file");
  if ((count == 0xffff || dir_size == 0xffffffff || dir_at == 0xffffffff) && eocd >= 20 &&
      le(d + eocd - 20, 4) == 0x07064b50) {  // zip64: the real values are in the zip64 end record
    const uint64_t record = le(d + eocd - 12, 8);
    if (record > n || n - record < 56 || le(d + record, 4) != 0x06064b50)
      throw bad("a broken zip64 end record");
    count = le(d + record + 32, 8);
    dir_size = le(d + record + 40, 8);
    dir_at = le(d + record + 48, 8);
  }
  if (dir_at > n || n - dir_at < dir_size) throw bad("its directory lies outside the file: truncated?");
  std::vector<Member> members;
  size_t at = static_cast<size_t>(dir_at);
  for (uint64_t i = 0; i < count; ++i) {
    if (n - at < 46 || le(d + at, 4) != 0x02014b50) throw bad("a broken directory entry");
    Member m;
    const int flags = static_cast<int>(le(d + at + 8, 2));
    m.method = static_cast<int>(le(d + at + 10, 2));
    m.crc = static_cast<uint32_t>(le(d + at + 16, 4));
    m.compressed = le(d + at + 20, 4);
    m.size = le(d + at + 24, 4);
    const size_t name_len = le(d + at + 28, 2), extra_len = le(d + at + 30, 2),
                 comment_len = le(d + at + 32, 2);
    m.offset = le(d + at + 42, 4);
    if (n - at - 46 < name_len + extra_len + comment_len) throw bad("a broken directory entry");
    m.name.assign(reinterpret_cast<const char*>(d + at + 46), name_len);
    if (flags & 1) throw bad("member '" + m.name + "' is encrypted");
    const size_t extra_end = at + 46 + name_len + extra_len;
    for (size_t e = at + 46 + name_len; e + 4 <= extra_end;) {  // zip64 sizes
      const size_t id = le(d + e, 2), len = le(d + e + 2, 2);
      size_t field = e + 4;
      if (id == 0x0001) {
        for (uint64_t* value : {&m.size, &m.compressed, &m.offset})
          if (*value == 0xffffffff && field + 8 <= std::min(e + 4 + len, extra_end)) {
            *value = le(d + field, 8);
            field += 8;
          }
      }
      e += 4 + len;
    }
    members.push_back(m);
    at += 46 + name_len + extra_len + comment_len;
  }
  return members;
}

// What is wrong with archive member `m`, as an error naming the file and member.
inline std::invalid_argument member_error(const std::string& path, const Member& m, const std::string& why) {
  return std::invalid_argument(path + ": not an .npz archive (member '" + m.name + "': " + why + ")");
}

// Where member `m`'s stored bytes start in the file (after its local header),
// checked to lie inside it.
inline const uint8_t* member_start(const std::vector<uint8_t>& file, const Member& m,
                                   const std::string& path) {
  auto bad = [&](const std::string& why) { return member_error(path, m, why); };
  const uint8_t* d = file.data();
  const size_t n = file.size();
  if (m.offset > n || n - m.offset < 30 || le(d + m.offset, 4) != 0x04034b50) throw bad("no local header");
  const uint64_t start = m.offset + 30 + le(d + m.offset + 26, 2) + le(d + m.offset + 28, 2);
  if (start > n || n - start < m.compressed) throw bad("its data runs past the end of the file: truncated?");
  if (m.method == 0 && m.compressed != m.size) throw bad("stored sizes disagree");
  if (m.method != 0 && m.method != 8)
    throw bad("compression method " + std::to_string(m.method) + " (only stored and deflate are supported)");
  return d + start;
}

// The first `count` bytes of member `m` (at most its size); a compressed member is
// inflated no further.
inline std::vector<uint8_t> member_prefix(const std::vector<uint8_t>& file, const Member& m, uint64_t count,
                                          const std::string& path) {
  const uint8_t* start = member_start(file, m, path);
  count = std::min(count, m.size);
  if (m.method == 0) return std::vector<uint8_t>(start, start + count);
  try {
    return inflate_prefix(start, static_cast<size_t>(m.compressed), static_cast<size_t>(count));
  } catch (const std::invalid_argument& e) {
    throw member_error(path, m, e.what());
  }
}

// Member `m`'s .npy header, checked to agree with the member's size: the data its
// shape needs and nothing after it.
inline NpyHeader member_header(const std::vector<uint8_t>& file, const Member& m, const std::string& path,
                               const std::string& what) {
  const std::vector<uint8_t> first = member_prefix(file, m, 12, path);
  const size_t header_size = npy_header_size(first.data(), first.size(), what);
  const std::vector<uint8_t> header = member_prefix(file, m, header_size, path);
  NpyHeader h = parse_npy_header(header.data(), header.size(), what);
  if (h.array.kind == '?') return h;
  const uint64_t have = m.size - h.data_at;
  if (have < h.data_bytes)
    throw std::invalid_argument(what + ": truncated: its shape " + shape_str(h.array.shape) + " needs " +
                                std::to_string(h.data_bytes) + " bytes of data, the archive holds " +
                                std::to_string(have));
  if (have > h.data_bytes)
    throw std::invalid_argument(what + ": " + std::to_string(have - h.data_bytes) + " bytes after the " +
                                std::to_string(h.data_bytes) + " bytes of data its shape " +
                                shape_str(h.array.shape) + " needs");
  return h;
}

// The array member `m` holds (its header `h`), inflated and checked against its CRC-32.
inline NpyArray member_array(const std::vector<uint8_t>& file, const Member& m, const NpyHeader& h,
                             const std::string& path, const std::string& what) {
  const uint8_t* start = member_start(file, m, path);
  if (m.method == 0) {
    if (crc32(start, static_cast<size_t>(m.size)) != m.crc)
      throw member_error(path, m, "CRC-32 mismatch: the data is corrupt");
    return npy_array(h, start, static_cast<size_t>(m.size), what);
  }
  std::vector<uint8_t> bytes;
  try {
    bytes =
        inflate(start, static_cast<size_t>(m.compressed), static_cast<size_t>(m.size));  // m.size: as h says
  } catch (const std::invalid_argument& e) {
    throw member_error(path, m, e.what());
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(what + ": its shape " + shape_str(h.array.shape) + " needs " +
                      std::to_string(h.data_bytes) + " bytes, more memory than is free");
  }
  if (crc32(bytes.data(), bytes.size()) != m.crc)
    throw member_error(path, m, "CRC-32 mismatch: the data is corrupt");
  return npy_array(h, bytes.data(), bytes.size(), what);
}

// A .npy image of `a`, format version 1 (header padded to 64 bytes as numpy pads it).
inline std::vector<uint8_t> npy_image(const NpyOut& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i)
    shape += (i ? ", " : "") + std::to_string(a.shape[i]);
  shape += a.shape.size() == 1 ? ",)" : ")";  // numpy's tuples: (), (5,), (3, 4)
  std::string header = std::string("{'descr': '") + (a.is_int ? "<i8" : "<f4") +
                       "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  put_le(out, header.size(), 2);
  out.insert(out.end(), header.begin(), header.end());
  const auto* values = a.is_int ? reinterpret_cast<const uint8_t*>(a.ints.data())
                                : reinterpret_cast<const uint8_t*>(a.floats.data());
  const size_t bytes = (a.is_int ? a.ints.size() : a.floats.size()) * (a.is_int ? 8 : 4);
  out.insert(out.end(), values, values + bytes);  // little-endian hosts (x86-64, ARM64) only
  return out;
}

// Refuses to write at `path` when it is empty, ends in a separator, or names
// something other than a regular file (a folder, a device such as /dev/full, a
// FIFO): save("/dev/full") must not turn into /dev/full.npz.
inline void check_writable_path(const std::string& path) {
  check_path(path);
  if (!std::filesystem::path(path).has_filename())
    throw FileError(path + ": names a folder, not a file", false);
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);  // symlinks followed
  const bool other = status.type() != std::filesystem::file_type::not_found &&
                     status.type() != std::filesystem::file_type::regular;
  if (other && !ec) throw FileError(path + ": is " + kind_of(status) + ", not a regular file", false);
}

// The file's bytes on the disk (fsync where there is one), before it replaces the old file.
inline bool sync_to_disk(std::FILE* file) {
#if __has_include(<unistd.h>)
  return ::fsync(fileno(file)) == 0;
#else
  return std::fflush(file) == 0;
#endif
}

// Writes `data` to a new file beside `path` and renames it over `path`: a
// failed write keeps the old file whole and leaves nothing behind.
inline void write_file(const std::string& path, const std::vector<uint8_t>& data) {
  check_writable_path(path);
  std::string partial;
  std::FILE* out = nullptr;
  std::random_device entropy;
  for (int attempt = 0; out == nullptr; ++attempt) {
    char name[32];
    std::snprintf(name, sizeof name, ".deepgen-%08x.partial", static_cast<unsigned>(entropy()));
    partial = (std::filesystem::path(path).parent_path() / name).string();
    out = std::fopen(partial.c_str(), "wbx");  // "x": a new file, never one that is there
    if (out == nullptr && (errno != EEXIST || attempt == 100))
      throw FileError("cannot write " + path + ": " + std::strerror(errno), errno == ENOENT);
  }
  bool written = std::fwrite(data.data(), 1, data.size(), out) == data.size() && std::fflush(out) == 0 &&
                 sync_to_disk(out);
  int error = errno;
  if (std::fclose(out) != 0 && written) {
    written = false;
    error = errno;
  }
  if (!written) {
    std::remove(partial.c_str());
    throw FileError("cannot write " + path + ": " + std::strerror(error), false);
  }
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) {
    std::remove(partial.c_str());
    throw FileError("cannot write " + path + ": " + ec.message(), false);
  }
}

}  // namespace npz_detail

inline double NpyArray::number(int64_t i) const {
  const uint8_t* p = bytes.data() + i * itemsize;
  const uint64_t raw = npz_detail::le(p, itemsize);
  if (kind == 'f') {
    if (itemsize == 2) return npz_detail::half_to_float(static_cast<uint16_t>(raw));
    if (itemsize == 4) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    double v;
    std::memcpy(&v, p, 8);
    return v;
  }
  if (kind == 'i') {
    const int shift = 64 - 8 * itemsize;  // sign-extend
    return static_cast<double>(static_cast<int64_t>(raw << shift) >> shift);
  }
  return static_cast<double>(raw);
}

inline int64_t NpyArray::integer(int64_t i) const {
  const uint64_t raw = npz_detail::le(bytes.data() + i * itemsize, itemsize);
  const int shift = kind == 'i' ? 64 - 8 * itemsize : 0;  // sign-extend
  return static_cast<int64_t>(raw << shift) >> shift;
}

// The single array of the .npy file at `path`.
inline NpyArray read_npy(const std::string& path) {
  const std::vector<uint8_t> file = npz_detail::read_file(path);
  return npz_detail::parse_npy(file.data(), file.size(), path);
}

// An .npz archive, read header first: opening it reads the file, its directory
// and every member's .npy header (names, dtypes, shapes), so a caller can check
// those before it asks for any data with read(). A compressed member is inflated
// only by read(), and no further than its header's shape needs.
class NpzFile {
 public:
  explicit NpzFile(const std::string& path) : path_(path), file_(npz_detail::read_file(path)) {
    if (file_.size() >= 6 && std::memcmp(file_.data(), "\x93NUMPY", 6) == 0)
      throw std::invalid_argument(path +
                                  ": holds a single array (.npy), not an .npz archive of named arrays");
    for (const auto& m : npz_detail::zip_members(file_, path)) {
      std::string name = m.name;  // numpy's name: the member's without ".npy"
      if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
      for (const auto& seen : entries_)
        if (seen.name == name) throw std::invalid_argument(path + ": holds two arrays named '" + name + "'");
      const std::string what = path + ": array '" + name + "'";
      entries_.push_back({name, m, npz_detail::member_header(file_, m, path, what)});
    }
  }

  const std::string& path() const { return path_; }
  size_t size() const { return entries_.size(); }
  const std::string& name(size_t i) const { return entries_[i].name; }
  // Array i's dtype and shape (kind, itemsize, descr, shape), without its data.
  const NpyArray& header(size_t i) const { return entries_[i].header.array; }
  // Array i with its data.
  NpyArray read(size_t i) const {
    const Entry& e = entries_[i];
    return npz_detail::member_array(file_, e.member, e.header, path_, path_ + ": array '" + e.name + "'");
  }

 private:
  struct Entry {
    std::string name;
    npz_detail::Member member;
    npz_detail::NpyHeader header;
  };
  std::string path_;
  std::vector<uint8_t> file_;
  std::vector<Entry> entries_;
};

// Every array of the .npz archive at `path`, by name (numpy's names: the
// member names without ".npy"), in the archive's order.
inline std::vector<std::pair<std::string, NpyArray>> read_npz(const std::string& path) {
  const NpzFile file(path);
  std::vector<std::pair<std::string, NpyArray>> arrays;
  for (size_t i = 0; i < file.size(); ++i)
    arrays.emplace_back(file.name(i), file.read(i));
  return arrays;
}

// Writes `arrays` to `path` as np.savez does (stored, not compressed).
inline void write_npz(const std::string& path, const std::vector<NpyOut>& arrays) {
  using namespace npz_detail;
  std::vector<uint8_t> out, directory;
  for (const auto& a : arrays) {
    const std::vector<uint8_t> image = npy_image(a);
    const std::string name = a.name + ".npy";
    if (image.size() >= 0xffffffffu || out.size() >= 0xffffffffu)
      throw std::length_error(path + ": array '" + a.name +
                              "' makes the file larger than 4 GiB, which save() does not write");
    const uint32_t crc = crc32(image.data(), image.size());
    const uint64_t offset = out.size();
    // Local header: version 2.0, no flags, stored, 1980-01-01 00:00 (fixed: deterministic files).
    for (auto* header : {&out, &directory}) {
      const bool central = header == &directory;
      put_le(*header, central ? 0x02014b50 : 0x04034b50, 4);
      if (central) put_le(*header, 20, 2);  // version made by
      put_le(*header, 20, 2);               // version needed
      put_le(*header, 0, 2);                // flags
      put_le(*header, 0, 2);                // method: stored
      put_le(*header, 0, 2);                // time
      put_le(*header, 0x21, 2);             // date
      put_le(*header, crc, 4);
      put_le(*header, image.size(), 4);
      put_le(*header, image.size(), 4);
      put_le(*header, name.size(), 2);
      put_le(*header, 0, 2);  // extra length
      if (central) {
        put_le(*header, 0, 2);  // comment length
        put_le(*header, 0, 2);  // disk
        put_le(*header, 0, 2);  // internal attributes
        put_le(*header, 0, 4);  // external attributes
        put_le(*header, offset, 4);
      }
      header->insert(header->end(), name.begin(), name.end());
    }
    out.insert(out.end(), image.begin(), image.end());
  }
  if (arrays.size() >= 0xffff || out.size() >= 0xffffffffu)
    throw std::length_error(path + ": too many arrays or bytes for a zip file without zip64");
  const uint64_t directory_at = out.size();
  out.insert(out.end(), directory.begin(), directory.end());
  put_le(out, 0x06054b50, 4);
  put_le(out, 0, 4);  // disk numbers
  put_le(out, arrays.size(), 2);
  put_le(out, arrays.size(), 2);
  put_le(out, directory.size(), 4);
  put_le(out, directory_at, 4);
  put_le(out, 0, 2);  // comment length
  write_file(path, out);
}

}  // namespace dg
