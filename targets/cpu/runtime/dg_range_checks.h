// dg_range_checks.h: checks of the numbers a caller hands a Model: hyperparameter
// ranges, the step count, and sizes computed from the inputs' dims.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace dg {

// Hyperparameter ranges: checked when a value is set and again by every
// train_step (hand-written code may set them directly).
inline void require_non_negative(const char* name, double value) {
  if (!(std::isfinite(value) && value >= 0.0))
    throw std::invalid_argument(std::string(name) + " must be a finite number >= 0, got " +
                                std::to_string(value));
}

inline void require_positive(const char* name, double value) {
  if (!(std::isfinite(value) && value > 0.0))
    throw std::invalid_argument(std::string(name) + " must be a finite number > 0, got " +
                                std::to_string(value));
}

inline void require_unit_interval(const char* name, double value) {  // [0, 1)
  if (!(value >= 0.0 && value < 1.0))
    throw std::invalid_argument(std::string(name) + " must be in [0, 1), got " + std::to_string(value));
}

// A step count train_step can still add one to.
inline void require_step(int64_t step) {
  if (step < 0 || step == std::numeric_limits<int64_t>::max())
    throw std::invalid_argument("step must be >= 0 and below 2**63 - 1, got " + std::to_string(step));
}

// A size computed from the symbolic dims, evaluated in double before the int64
// arithmetic that allocates it: inputs whose sizes would make it wrap around
// are refused (Python: ValueError) instead.
inline void require_size(double elements, const char* what) {
  if (!(elements < 9.2e18))
    throw std::length_error(std::string("input sizes too large: ") + what + " would need " +
                            std::to_string(elements) + " elements, more than int64 can index");
}

}  // namespace dg
