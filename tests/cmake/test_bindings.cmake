# Included into every generated project the test suite builds with conftest's
# TEST_BUILD_FLAGS or CHECK_BUILD_FLAGS (CMAKE_PROJECT_INCLUDE: read right after the
# project's project() call); users' builds never read it.
#
# The pybind11 bindings (src/bindings.cpp) only check and convert inputs and call the
# model; in a small project they are the longest compile (pybind11's templates), and
# pybind11_add_module compiles them for link-time optimization in a Release build, so
# the module's link compiled them a second time. The example program
# (examples/main.cpp) reads and writes .npy/.npz files and calls the model. The tests
# check what the module and the program compute, never how fast this code runs: both
# files compile at -O0, and the module links without LTO. The model and the kernels
# (the library both call) keep the build's flags (-O2, or -O0 for CHECK_BUILD_FLAGS).
set_source_files_properties(src/bindings.cpp examples/main.cpp PROPERTIES COMPILE_OPTIONS -O0)
# pybind11_add_module adds its LTO flags only when this is not defined.
set(CMAKE_INTERPROCEDURAL_OPTIMIZATION OFF)
