// tiny: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build && ./build/tiny_example
#include <cstdio>
#include <vector>

#include "tiny/model.h"

int main() {
  tiny::Model model(/*seed=*/0);
  tiny::Inputs inputs;
  std::vector<float> x_data(6, 0);  // [N, 3] with N=2
  inputs.x = {x_data.data(), {2, 3}};
  tiny::Outputs outputs = model.forward(inputs);
  double y_sum = 0;
  for (float v : outputs.y.data)
    y_sum += v;
  std::printf("y: shape %s, sum %.6g\n", dg::shape_str(outputs.y.shape).c_str(), y_sum);
  return 0;
}
