#!/usr/bin/env bash
# gpu_check.sh: everything that needs a GPU, in one run of under 10 minutes on a
# machine with one NVIDIA GPU (written for an H100/H200), the CUDA toolkit and
# PyTorch with CUDA:
#
#   1. what is there: the GPU, nvcc, Python, torch;
#   2. what deepgen needs that is missing (black, clang-format, ...): from wheels in
#      $DEEPGEN_WHEELS (default .whl/) when present, else from the package index;
#   3. every example (and the op and gradient tables) generated with
#      --target cuda and built for the GPU, side by side; each example's C++
#      program runs on the GPU;
#   4. the whole test suite with GPU execution on (DEEPGEN_GPU=1): tests/test_cuda.py
#      then runs every CUDA build against the numpy reference, and the runtime's
#      ops (tests/cuda_runtime_driver.cpp) against host loops;
#   5. benchmarks/treelstm_cuda.py: the generated TreeLSTM against PyTorch CUDA,
#      per node and level-batched.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (logs and figures go to OUT_DIR, default build/gpu_check)
#
# Environment: PYTHON (default python3), CUDAARCHS (default 90: H100/H200; "native"
# for the GPU at hand), JOBS (parallel pytest workers, default: cores / 2),
# DEEPGEN_TEST_CACHE (build cache, default /tmp/deepgen-tests).
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-$ROOT/build/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
CORES=$(nproc 2>/dev/null || echo 2)
JOBS=${JOBS:-$(( CORES / 2 > 1 ? CORES / 2 : 1 ))}
export CUDAARCHS=${CUDAARCHS:-90}
export DEEPGEN_CUDA_ARCHS=${DEEPGEN_CUDA_ARCHS:-$CUDAARCHS}
export DEEPGEN_GPU=1
export DEEPGEN_TEST_CACHE=${DEEPGEN_TEST_CACHE:-/tmp/deepgen-tests}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
STATUS=0

step() { echo; echo "== $1 ($(( $(date +%s) - START )) s)"; }
fail() { echo "FAILED: $1"; STATUS=1; }

step "1. the machine"
nvidia-smi -L || { fail "nvidia-smi finds no GPU: this check needs one"; exit 1; }
nvcc --version | tail -n 2 || fail "nvcc not found"
cmake --version | head -n 1
"$PY" - <<'EOF'
import sys
print("python", sys.version.split()[0], sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
except ImportError:
    print("torch not installed: the benchmark will be skipped")
EOF

step "2. Python packages deepgen needs"
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"jinja2": "jinja2", "numpy": "numpy", "sympy": "sympy", "black": "black", "pybind11": "pybind11",
        "scikit_build_core": "scikit-build-core", "clang_format": "clang-format", "pytest": "pytest",
        "hypothesis": "hypothesis"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$MISSING" ]; then
  WHEELS=${DEEPGEN_WHEELS:-$ROOT/.whl}
  echo "installing: $MISSING"
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target /tmp/deepgen-site $MISSING \
      && export PYTHONPATH="$PYTHONPATH:/tmp/deepgen-site" \
      || fail "pip install from $WHEELS"
  else
    "$PY" -m pip install -q $MISSING || fail "pip install $MISSING (no network? put wheels in $WHEELS)"
  fi
fi
"$PY" -c "import generator, black, clang_format; print('deepgen', generator.__version__, 'from', generator.__file__)" \
  || { fail "deepgen cannot be imported"; exit 1; }
# Bytecode caches and editable installs are not needed: PYTHONPATH points at the checkout.

step "3. every example generated for CUDA and built (CUDAARCHS=$CUDAARCHS, half the cores' worth of builds at a time)"
timeout 300 "$PY" tests/test_cuda.py prebuild gpu 2>&1 | tee "$OUT/build.log" | tail -n 40
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "CUDA builds"
for exe in "$DEEPGEN_TEST_CACHE"/cuda-gpu-*/build/*_gpu_example; do
  [ -x "$exe" ] || continue
  if timeout 60 "$exe" > "$OUT/$(basename "$exe").txt" 2>&1; then
    echo "ran $(basename "$exe"): $(head -n 1 "$OUT/$(basename "$exe").txt")"
  else
    fail "$(basename "$exe")"; cat "$OUT/$(basename "$exe").txt"
  fi
done

step "4. the test suite with GPU execution (DEEPGEN_GPU=1)"
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null && [ "$JOBS" -gt 1 ]; then
  PARALLEL=(-n "$JOBS" --dist loadfile)
fi
timeout 420 "$PY" -m pytest -q -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} tests 2>&1 | tee "$OUT/tests.log" | tail -n 60
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "test suite"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 40

step "5. TreeLSTM: generated CUDA vs PyTorch CUDA"
LEFT=$(( 570 - ($(date +%s) - START) ))
if [ "$LEFT" -gt 60 ]; then
  QUICK=$([ "$LEFT" -lt 240 ] && echo --quick)
  timeout "$LEFT" "$PY" benchmarks/treelstm_cuda.py $QUICK --json "$OUT/treelstm_cuda.json" 2>&1 \
    | tee "$OUT/treelstm_cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "benchmark"
else
  fail "no time left for the benchmark ($LEFT s)"
fi

step "done: $([ $STATUS -eq 0 ] && echo 'all passed' || echo 'something FAILED (see above)'); logs in $OUT"
exit $STATUS
