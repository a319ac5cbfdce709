// The .npy/.npz reader of the runtime (dg_npz.h, dg_inflate.h, dg_weights.h)
// behind a line protocol, for tests/test_fuzz.py, which builds it with
// AddressSanitizer and UndefinedBehaviorSanitizer and sends it fuzzed files.
//
// One request per line on stdin, every field hex-encoded (paths and names may
// hold any bytes):
//   npy PATH                     dg::read_npy
//   npz PATH                     dg::read_npz
//   weights PATH NAME SHAPE ...  dg::stage_weights of a model whose parameters are
//                                NAME with SHAPE ("3,4"; "" for a scalar), not trainable
// One answer per line on stdout:
//   ok NAME/DTYPE/SHAPE/CRC ...  each array read: dtype as NpyArray::dtype(), CRC-32 of
//                                its bytes in C order, little-endian (weights: float32)
//   error KIND MESSAGE           KIND: invalid_argument, file_error, out_of_memory, or
//                                other (the test's finding: no other kind is allowed)
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "dg_npz.h"
#include "dg_weights.h"

namespace {

std::string hex(const std::string& text) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : text) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out.empty() ? "-" : out;
}

std::string unhex(const std::string& text) {
  std::string out;
  if (text == "-") return out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) out += static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16));
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? "," : "") + std::to_string(shape[i]);
  return out;
}

std::string describe(const std::string& name, const dg::NpyArray& a) {
  const uint32_t crc = dg::npz_detail::crc32(a.bytes.data(), a.bytes.size());
  return " " + hex(name) + "/" + hex(a.dtype()) + "/" + hex(shape_text(a.shape)) + "/" + std::to_string(crc);
}

std::string answer(const std::vector<std::string>& fields) {
  const std::string& what = fields.at(0);
  const std::string path = unhex(fields.at(1));
  std::string out = "ok";
  if (what == "npy") {
    out += describe("", dg::read_npy(path));
  } else if (what == "npz") {
    for (const auto& [name, array] : dg::read_npz(path)) out += describe(name, array);
  } else if (what == "weights") {
    std::vector<dg::Tensor<float>> tensors;
    std::vector<std::string> names;
    for (size_t i = 2; i + 1 < fields.size(); i += 2) {
      names.push_back(unhex(fields[i]));
      std::vector<int64_t> shape;
      std::stringstream sizes(unhex(fields[i + 1]));
      for (std::string size; std::getline(sizes, size, ',');) shape.push_back(std::stoll(size));
      tensors.emplace_back(shape);
    }
    dg::NamedTensors<dg::Tensor<float>> params;
    for (size_t i = 0; i < tensors.size(); ++i) params.emplace_back(names[i], &tensors[i]);
    const dg::StagedWeights staged = dg::stage_weights(path, params, {}, /*trainable=*/false);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& values = staged.arrays[i];
      const auto* bytes = reinterpret_cast<const uint8_t*>(values.data());
      const uint32_t crc = dg::npz_detail::crc32(bytes, values.size() * sizeof(float));
      out += " " + hex(names[i]) + "/" + hex("float32") + "/" + hex(shape_text(tensors[i].shape)) + "/" +
             std::to_string(crc);
    }
  } else {
    throw std::logic_error("unknown request " + what);
  }
  return out;
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> fields;
    std::stringstream words(line);
    for (std::string word; words >> word;) fields.push_back(word);
    std::string reply;
    try {
      reply = answer(fields);
    } catch (const dg::FileError& e) {
      reply = "error file_error " + hex(e.what());
    } catch (const dg::OutOfMemory& e) {
      reply = "error out_of_memory " + hex(e.what());
    } catch (const std::invalid_argument& e) {
      reply = "error invalid_argument " + hex(e.what());
    } catch (const std::exception& e) {
      reply = "error other " + hex(std::string(typeid(e).name()) + ": " + e.what());
    }
    std::cout << reply << std::endl;
  }
}
