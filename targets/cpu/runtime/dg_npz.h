// dg_npz.h: numpy's .npy and .npz files, read and written in C++.
//
// Reading: .npy format versions 1, 2 and 3; any byte order; C or Fortran order
// (Fortran order is rearranged to C order); numeric dtypes (bool, int, uint,
// float). .npz archives as np.savez (stored) and np.savez_compressed (deflated)
// write them, zip64 included. Writing: .npy version 1 and stored .npz, as
// np.savez writes them, with a fixed timestamp so equal arrays give equal files.
//
// A malformed file throws std::invalid_argument naming the file and what is
// wrong with it; a file that cannot be opened, read or written throws
// dg::FileError.
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
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

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
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline uint64_t le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

inline void put_le(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw FileError(path + ": is a folder, not a file", false);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError("cannot open " + path + ": " + std::strerror(errno), errno == ENOENT);
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FileError("cannot read " + path, false);
  return data;
}

// The value after `'key':` in a .npy header (a Python dict literal).
inline std::string header_field(const std::string& header, const std::string& key, const std::string& path) {
  const size_t at = header.find("'" + key + "'");
  const size_t colon = at == std::string::npos ? at : header.find(':', at);
  if (colon == std::string::npos) throw std::invalid_argument(path + ": the .npy header has no '" + key + "'");
  size_t start = header.find_first_not_of(' ', colon + 1);
  size_t end = start;
  if (start != std::string::npos && header[start] == '(') {
    end = header.find(')', start);
    if (end != std::string::npos) ++end;
  } else if (start != std::string::npos && header[start] == '\'') {
    end = header.find('\'', start + 1);
    if (end != std::string::npos) ++end;
  } else {
    end = header.find_first_of(",}", start);
  }
  if (start == std::string::npos || end == std::string::npos)
    throw std::invalid_argument(path + ": the .npy header's '" + key + "' is malformed");
  return header.substr(start, end - start);
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
    for (size_t k = rank; k-- > 0;) f = f * shape[k] + index[k];
    std::memcpy(&to[c * itemsize], &from[f * itemsize], itemsize);
    for (size_t k = rank; k-- > 0;) {
      if (++index[k] < shape[k]) break;
      index[k] = 0;
    }
  }
  return to;
}

// One .npy image: `what` names it in errors ("w.npz: array 'fc1_w'").
inline NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what) {
  static const char kMagic[] = "\x93NUMPY";
  if (size < 10 || std::memcmp(data, kMagic, 6) != 0) throw std::invalid_argument(what + ": not a .npy array");
  const int major = data[6];
  if (major < 1 || major > 3)
    throw std::invalid_argument(what + ": .npy format version " + std::to_string(major) + " is not supported (1 to 3 are)");
  const size_t prefix = major == 1 ? 10 : 12;
  if (size < prefix) throw std::invalid_argument(what + ": truncated .npy header");
  const size_t header_len = static_cast<size_t>(le(data + 8, major == 1 ? 2 : 4));
  if (size - prefix < header_len) throw std::invalid_argument(what + ": truncated .npy header");
  const std::string header(reinterpret_cast<const char*>(data + prefix), header_len);

  const std::string descr = header_field(header, "descr", what);
  if (descr.size() < 4 || descr.front() != '\'')
    throw std::invalid_argument(what + ": has the structured dtype " + descr + ", expected a plain numeric array");
  const char order = descr[1];
  NpyArray a;
  a.kind = descr[2];
  try {
    a.itemsize = std::stoi(descr.substr(3, descr.size() - 4));
  } catch (const std::exception&) {
    a.itemsize = 0;
  }
  const bool numeric = (a.kind == 'f' && (a.itemsize == 2 || a.itemsize == 4 || a.itemsize == 8)) ||
                       ((a.kind == 'i' || a.kind == 'u') &&
                        (a.itemsize == 1 || a.itemsize == 2 || a.itemsize == 4 || a.itemsize == 8)) ||
                       (a.kind == 'b' && a.itemsize == 1);
  const std::string fortran = header_field(header, "fortran_order", what);
  if (fortran != "True" && fortran != "False")
    throw std::invalid_argument(what + ": the .npy header's 'fortran_order' is " + fortran);
  const std::string shape = header_field(header, "shape", what);
  size_t pos = 1;
  while (pos < shape.size()) {
    const size_t digit = shape.find_first_of("0123456789", pos);
    if (digit == std::string::npos) break;
    const size_t end = shape.find_first_not_of("0123456789", digit);
    if (end - digit > 18) throw std::invalid_argument(what + ": the .npy shape " + shape + " is too large");
    a.shape.push_back(std::stoll(shape.substr(digit, end - digit)));
    pos = end;
  }
  if (!numeric || (order != '<' && order != '>' && order != '|' && order != '=')) {
    a.kind = '?';  // strings, objects, complex...: named, not read (whoever asked for numbers refuses it)
    a.descr = descr.substr(1, descr.size() - 2);
    return a;
  }

  int64_t bytes = 0;
  if (__builtin_mul_overflow(a.size(), static_cast<int64_t>(a.itemsize), &bytes))
    throw std::invalid_argument(what + ": the .npy shape " + shape_str(a.shape) + " is too large");
  const size_t start = prefix + header_len;
  if (size - start < static_cast<uint64_t>(bytes))
    throw std::invalid_argument(what + ": truncated: its shape " + shape_str(a.shape) + " needs " +
                                std::to_string(bytes) + " bytes of data, the file has " + std::to_string(size - start));
  a.bytes.assign(data + start, data + start + bytes);
  if (order == '>' && a.itemsize > 1)
    for (size_t i = 0; i < a.bytes.size(); i += a.itemsize)
      std::reverse(a.bytes.begin() + i, a.bytes.begin() + i + a.itemsize);
  if (fortran == "True" && a.shape.size() > 1) a.bytes = fortran_to_c(a.bytes, a.shape, a.itemsize);
  return a;
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
  auto bad = [&](const std::string& why) { return std::invalid_argument(path + ": not an .npz archive (" + why + ")"); };
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
    if (record > n || n - record < 56 || le(d + record, 4) != 0x06064b50) throw bad("a broken zip64 end record");
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
    const size_t name_len = le(d + at + 28, 2), extra_len = le(d + at + 30, 2), comment_len = le(d + at + 32, 2);
    m.offset = le(d + at + 42, 4);
    if (n - at - 46 < name_len + extra_len + comment_len) throw bad("a broken directory entry");
    m.name.assign(reinterpret_cast<const char*>(d + at + 46), name_len);
    if (flags & 1) throw bad("member '" + m.name + "' is encrypted");
    for (size_t e = at + 46 + name_len; e + 4 <= at + 46 + name_len + extra_len;) {  // zip64 sizes
      const size_t id = le(d + e, 2), len = le(d + e + 2, 2);
      size_t field = e + 4;
      if (id == 0x0001) {
        for (uint64_t* value : {&m.size, &m.compressed, &m.offset})
          if (*value == 0xffffffff && field + 8 <= e + 4 + len) {
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

// The uncompressed bytes of member `m`, checked against its CRC-32.
inline std::vector<uint8_t> member_bytes(const std::vector<uint8_t>& file, const Member& m, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument(path + ": not an .npz archive (member '" + m.name + "': " + why + ")");
  };
  const uint8_t* d = file.data();
  const size_t n = file.size();
  if (m.offset > n || n - m.offset < 30 || le(d + m.offset, 4) != 0x04034b50) throw bad("no local header");
  const uint64_t start = m.offset + 30 + le(d + m.offset + 26, 2) + le(d + m.offset + 28, 2);
  if (start > n || n - start < m.compressed) throw bad("its data runs past the end of the file: truncated?");
  std::vector<uint8_t> bytes;
  if (m.method == 0) {
    if (m.compressed != m.size) throw bad("stored sizes disagree");
    bytes.assign(d + start, d + start + m.size);
  } else if (m.method == 8) {
    try {
      bytes = inflate(d + start, static_cast<size_t>(m.compressed), static_cast<size_t>(m.size));
    } catch (const std::invalid_argument& e) {
      throw bad(e.what());
    }
  } else {
    throw bad("compression method " + std::to_string(m.method) + " (only stored and deflate are supported)");
  }
  if (crc32(bytes.data(), bytes.size()) != m.crc) throw bad("CRC-32 mismatch: the data is corrupt");
  return bytes;
}

// A .npy image of `a`, format version 1 (header padded to 64 bytes as numpy pads it).
inline std::vector<uint8_t> npy_image(const NpyOut& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape[i]);
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

inline void write_file(const std::string& path, const std::vector<uint8_t>& data) {
  // Written beside the target and renamed over it: a failed save keeps the old file whole.
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    if (!out) throw FileError("cannot write " + path + ": " + std::strerror(errno), errno == ENOENT);
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    out.close();
    if (!out) {
      std::remove(partial.c_str());
      throw FileError("cannot write " + path + " (disk full?)", false);
    }
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

// Every array of the .npz archive at `path`, by name (numpy's names: the
// member names without ".npy"), in the archive's order.
inline std::vector<std::pair<std::string, NpyArray>> read_npz(const std::string& path) {
  const std::vector<uint8_t> file = npz_detail::read_file(path);
  if (file.size() >= 6 && std::memcmp(file.data(), "\x93NUMPY", 6) == 0)
    throw std::invalid_argument(path + ": holds a single array (.npy), not an .npz archive of named arrays");
  std::vector<std::pair<std::string, NpyArray>> arrays;
  for (const auto& m : npz_detail::zip_members(file, path)) {
    std::string name = m.name;
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
    for (const auto& seen : arrays)
      if (seen.first == name) throw std::invalid_argument(path + ": holds two arrays named '" + name + "'");
    const std::vector<uint8_t> bytes = npz_detail::member_bytes(file, m, path);
    arrays.emplace_back(name, npz_detail::parse_npy(bytes.data(), bytes.size(), path + ": array '" + name + "'"));
  }
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
      throw std::length_error(path + ": array '" + a.name + "' makes the file larger than 4 GiB, which save() does not write");
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
