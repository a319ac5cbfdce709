// tiny_train: an example program using the C++ API without Python.
// Build: cmake -S . -B build && cmake --build build && ./build/tiny_train_example
#include <cstdio>
#include <vector>

#include "tiny_train/model.h"

int main() {
  tiny_train::Model model(/*seed=*/0);
  tiny_train::Inputs inputs;
  std::vector<float> x_data(6, 0);  // [N, 3] with N=2
  inputs.x = {x_data.data(), {2, 3}};
  tiny_train::Outputs outputs = model.forward(inputs);
  double logits_sum = 0;
  for (float v : outputs.logits.data)
    logits_sum += v;
  std::printf("logits: shape %s, sum %.6g\n", dg::shape_str(outputs.logits.shape).c_str(), logits_sum);
  return 0;
}
