#!/usr/bin/env bash
# Fuzz the parsers (safetensors header, run config and --set, Hugging Face index, token shards) with libFuzzer,
# AddressSanitizer and UBSan, each for a bounded time; exits non-zero when a target crashes, hangs or lets a
# stray exception escape. Needs clang and libclang-rt (Debian: clang libclang-rt-14-dev).
#   scripts/fuzz.sh [--seconds N] [TARGET...]    N seconds per target (default 20)
# Targets: safetensors config hf_index token_shard (the default set), and op (every op binding; it builds the
# ops with sanitizers, minutes more the first time, so it runs only when named).
# Builds in build-fuzz/ (tests/fuzz/CMakeLists.txt, only the sources the targets need). Each target starts from
# tests/fuzz/corpus/<target>/ (seeds and every input found before) plus what earlier runs here found
# (build-fuzz/corpus/<target>/, not committed). A crash leaves its input in build-fuzz/crashes/<target>/: fix
# the bug, then copy the input into tests/fuzz/corpus/<target>/ so the ordinary build replays it from then on
# (test_fuzz_corpus).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=20
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
        --seconds=*) seconds=${1#*=}; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        -*) echo "error: unknown option $1 (see scripts/fuzz.sh --help)" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done
[[ "$seconds" =~ ^[0-9]+$ ]] && [ "$seconds" -ge 1 ] || { echo "error: --seconds $seconds: not a positive integer" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=(safetensors config hf_index token_shard)

cxx=$(command -v clang++ || command -v clang++-14 || true)
[ -n "$cxx" ] || { echo "error: clang++ not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > /tmp/tessera-fuzz-probe.cpp
"$cxx" -fsanitize=fuzzer,address,undefined /tmp/tessera-fuzz-probe.cpp -o /tmp/tessera-fuzz-probe 2> /dev/null ||
    { echo "error: $cxx cannot link libFuzzer with ASan/UBSan (apt-get install libclang-rt-14-dev)" >&2; exit 1; }
rm -f /tmp/tessera-fuzz-probe /tmp/tessera-fuzz-probe.cpp

start=$(date +%s)
mkdir -p build-fuzz
if [ ! -f build-fuzz/CMakeCache.txt ]; then
    cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=None \
        > build-fuzz/configure.log 2>&1 || { cat build-fuzz/configure.log; exit 1; }
fi
build_targets=()
for t in "${targets[@]}"; do build_targets+=(--target "fuzz_$t"); done
cmake --build build-fuzz -j "$(nproc)" "${build_targets[@]}" > build-fuzz/build.log 2>&1 ||
    { tail -50 build-fuzz/build.log; exit 1; }
echo "fuzz: built in $(( $(date +%s) - start )) s; ${seconds} s per target"

# allocator_may_return_null: a request past what the machine has fails as malloc does (the code says so in a
# clean error) instead of ASan aborting on it
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:symbolize=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=()
for t in "${targets[@]}"; do
    bin=build-fuzz/fuzz_$t
    [ -x "$bin" ] || { echo "error: no fuzz target $t" >&2; exit 2; }
    mkdir -p "build-fuzz/corpus/$t" "build-fuzz/crashes/$t"
    # -rss_limit_mb, -malloc_limit_mb: an input that asks for gigabytes is a finding, not an out-of-memory kill
    dict=(); [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
    if "$bin" "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t" "${dict[@]}" -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=65536 -artifact_prefix="build-fuzz/crashes/$t/" \
        -print_final_stats=1 > "build-fuzz/$t.log" 2>&1; then
        echo "fuzz: $t: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/$t.log" | grep -o '[0-9]*$') runs, no crash"
    else
        echo "fuzz: $t FAILED (log: build-fuzz/$t.log; input: $(ls -t "build-fuzz/crashes/$t" | head -1))" >&2
        grep -m5 -E 'ERROR|SUMMARY|terminate|what\(\)' "build-fuzz/$t.log" >&2 || true
        failed+=("$t")
    fi
done
echo "fuzz: $(( $(date +%s) - start )) s in all"
if [ ${#failed[@]} -gt 0 ]; then
    echo "error: fuzz targets failed: ${failed[*]}" >&2
    exit 1
fi
