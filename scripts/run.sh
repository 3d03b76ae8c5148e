#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine (as root, or with sudo):
#   scripts/run.sh demo   install what is missing, build, train the demo model, sample from it
#   scripts/run.sh test   install what is missing, build (with the CUDA backend when nvcc exists), run every test,
#                         then build again with the CUDA backend on the CUDA emulator (its kernels run on the CPU)
#                         and run the CUDA tests there (on an AVX-512 machine: every test, as on an AVX2 one)
#   scripts/run.sh build  install what is missing and build only
# The package step is idempotent and quick when everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build ccache pkg-config
          libdnnl-dev ocl-icd-opencl-dev nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libbenchmark-dev
          libopenmpi-dev openmpi-bin clang libclang-rt-14-dev libpcre2-dev libutf8proc-dev
          libcpp-httplib-dev libjs-chart.js)
# only for the tests: the dashboard is checked in a real (headless) browser
TEST_PACKAGES=(chromium)

install_packages() {  # install_packages [MORE_PACKAGES...]
    local missing=()
    for p in "${PACKAGES[@]}" "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "installing: ${missing[*]}"
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "error: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
        sudo="sudo"
    fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

nvcc_path() {
    command -v nvcc 2>/dev/null || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true
}

build() {  # build DIR [cmake args...]
    local dir=$1; shift
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" > "$dir.configure.log" 2>&1 ||
        { cat "$dir.configure.log"; exit 1; }
    cmake --build "$dir" -j "$(nproc)"
}

cmd=${1:-}
case "$cmd" in
    demo)
        install_packages
        mkdir -p build && build build -DTESSERA_TESTS=OFF -DTESSERA_BENCH=OFF
        run="runs/demo-$(date +%Y%m%d-%H%M%S)"
        build/apps/tessera train --out "$run"
        echo "--- a sample from the trained model:"
        build/apps/tessera generate --checkpoint "$run" --prompt "hacker, n." --max-new-tokens 300 --temperature 0.8
        ;;
    test)
        install_packages "${TEST_PACKAGES[@]}"
        if command -v clang-format >/dev/null; then  # the style check (.clang-format), when the tool is here
            git ls-files '*.cpp' '*.h' '*.cu' | xargs clang-format --dry-run --Werror ||
                { echo "error: clang-format differences above (fix: clang-format -i FILES)" >&2; exit 1; }
        fi
        cuda=()
        nvcc=$(nvcc_path)
        if [ -n "$nvcc" ]; then cuda=(-DTESSERA_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc"); fi
        mkdir -p build-test && build build-test -DTESSERA_WERROR=ON "${cuda[@]}"
        # NOTES: one test at a time: every test process runs OpenMP on all cores, and spinning
        # OpenMP barriers in concurrent processes slow the suite down tenfold.
        ctest --test-dir build-test --output-on-failure
        # the parsers under libFuzzer + ASan/UBSan for a bounded time (found inputs: tests/fuzz/corpus/)
        scripts/fuzz.sh --seconds 20
        # The second build: the CUDA backend compiled for the CUDA emulator (src/cuda_emulator), so its kernels run
        # on the CPU and the CUDA tests (each op against the CPU, training on both devices) run without a GPU. On an
        # AVX-512 machine it is also the AVX2 + FMA build: the kernels built for x86-64-v3 with oneDNN held to AVX2
        # run the whole suite again (results and determinism must not depend on the ISA).
        if grep -qw avx512f /proc/cpuinfo; then
            echo "--- the suite again as on an AVX2 machine (-march=x86-64-v3, DNNL_MAX_CPU_ISA=AVX2), CUDA on the emulator"
            mkdir -p build-test-avx2 && build build-test-avx2 -DTESSERA_WERROR=ON -DTESSERA_ARCH=x86-64-v3 \
                -DTESSERA_BENCH=OFF -DTESSERA_CUDA_EMULATOR=ON
            DNNL_MAX_CPU_ISA=AVX2 ctest --test-dir build-test-avx2 --output-on-failure
        else
            echo "--- the CUDA tests on the CUDA emulator"
            mkdir -p build-test-emu && build build-test-emu -DTESSERA_WERROR=ON -DTESSERA_BENCH=OFF \
                -DTESSERA_CUDA_EMULATOR=ON
            ctest --test-dir build-test-emu --output-on-failure -R Cuda
        fi
        ;;
    build)
        install_packages
        mkdir -p build && build build
        ;;
    *)
        echo "usage: scripts/run.sh demo|test|build" >&2
        exit 2
        ;;
esac
