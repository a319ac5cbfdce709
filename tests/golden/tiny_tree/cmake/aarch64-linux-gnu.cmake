# CMake toolchain file: cross-compile this project for 64-bit ARM Linux (aarch64)
# with Debian's cross compiler (apt-get install g++-aarch64-linux-gnu):
#
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
#   cmake --build build-aarch64
#
# (or `deepgen build . --cross aarch64`). It builds the C++ library and the
# example program; the Python module is not built (it would need an aarch64
# Python). The compiler targets the CPU named by the cache variable
# <NAME>_ARM_ARCH (see CMakeLists.txt) instead of -march=native; run the program
# on an ARM machine, or on this one under emulation:
#
#   qemu-aarch64 -L /usr/aarch64-linux-gnu build-aarch64/<name>_example
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Libraries and headers come from the aarch64 tree only; programs (cmake's own
# helpers) from this machine.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
