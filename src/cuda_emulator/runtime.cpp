// The CUDA emulator's runtime (include/cuda_runtime.h): device memory, copies, and kernels run on the CPU.
//
// Kernels: a block's threads are fibers on one stack each, switched by a few instructions of assembly (x86-64). A
// thread runs until it waits at a barrier (__syncthreads, or a warp's shuffle or ballot) or exits, then passes control
// to its warp's next ready thread; a barrier opens when every live thread of its block (or warp) waits at it. Threads
// in a different order than the GPU's would expose a race, so each launch walks its blocks and threads forward or
// backward, chosen by a hash of the launch count (TESSERA_CUDA_EMULATOR_ORDER=forward|reverse fixes it): a kernel whose
// result depends on the order is not bitwise run to run, which the CUDA tests check. Threads that meet at different
// barriers (a hang or undefined behaviour on a GPU) stop the process with a message.
//
// Memory: device allocations come from one reserved range of the address space that is inaccessible (PROT_NONE)
// except during device work (a kernel, a copy, a GEMM), so host code that reads or writes device memory through a
// pointer faults here as it would on a GPU (TESSERA_CUDA_EMULATOR_GUARD=0 turns this off). New allocations are
// filled with 0xff bytes (NaN in every float type), so reading memory nobody wrote shows. Copies check that their
// pointers are on the sides their kind names. Everything runs on the calling thread under one process-wide lock;
// streams are in order because every call completes before it returns.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_emulator/emulator.h"

uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace tessera::cuda_emulator {

namespace {

[[noreturn]] void die(const char* what) {
    std::fprintf(stderr, "CUDA emulator: %s\n", what);
    std::abort();
}

bool env_is(const char* name, const char* value) {
    const char* v = std::getenv(name);
    return v && std::string(v) == value;
}

std::recursive_mutex& lock() {
    static std::recursive_mutex m;
    return m;
}

cudaError_t g_last_error = cudaSuccess;
cudaError_t record(cudaError_t e) {
    if (e != cudaSuccess) g_last_error = e;
    return e;
}

// ---- device memory: one reserved range, first fit over its free pieces. The range is backed by huge pages where
// the kernel gives them (madvise), so switching its protection at every launch changes few page-table entries.
constexpr size_t kReserve = size_t(1) << 37;  // 128 GiB of address space, none of it committed until written
constexpr size_t kPage = 4096, kHugePage = size_t(2) << 20;

struct Memory {
    std::byte* base = nullptr;
    size_t top = 0;                  // the end of the highest allocation, rounded up to a huge page
    std::map<size_t, size_t> free_;  // offset -> size
    std::map<size_t, size_t> used;   // offset -> size
    int open = 0;                    // nesting of device work
    bool guard = !env_is("TESSERA_CUDA_EMULATOR_GUARD", "0");

    Memory() {
        void* p = mmap(nullptr, kReserve + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) die("cannot reserve the device's address range");
        base = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + kHugePage - 1) / kHugePage * kHugePage);
        madvise(base, kReserve, MADV_HUGEPAGE);
        free_[0] = kReserve;
    }
    bool contains(const void* p) const {
        const auto* b = static_cast<const std::byte*>(p);
        return b >= base && b < base + kReserve;
    }
    void protect(int prot) {
        if (top > 0 && mprotect(base, top, prot) != 0) die("mprotect of device memory failed");
    }
    // The accessible part grows with the highest allocation: always (no guard), or during device work.
    void grow(size_t end) {
        const size_t rounded = (end + kHugePage - 1) / kHugePage * kHugePage;
        if (rounded <= top) return;
        if ((!guard || open > 0) && mprotect(base + top, rounded - top, PROT_READ | PROT_WRITE) != 0)
            die("mprotect of device memory failed");
        top = rounded;
    }
};

Memory& memory() {
    static Memory m;
    return m;
}

// Device work: device memory is readable and writable inside it (nested scopes are one).
struct DeviceWork {
    std::lock_guard<std::recursive_mutex> hold{lock()};
    DeviceWork() {
        Memory& m = memory();
        if (m.open++ == 0 && m.guard) m.protect(PROT_READ | PROT_WRITE);
    }
    ~DeviceWork() {
        Memory& m = memory();
        if (--m.open == 0 && m.guard) m.protect(PROT_NONE);
    }
    DeviceWork(const DeviceWork&) = delete;
    DeviceWork& operator=(const DeviceWork&) = delete;
};

// ---- fibers (x86-64 System V: the callee-saved registers live on the stack; the floating-point control words are
// the process's, which no kernel changes)
extern "C" void tessera_cuda_emulator_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl tessera_cuda_emulator_switch
    .type tessera_cuda_emulator_switch, @function
tessera_cuda_emulator_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tessera_cuda_emulator_switch, .-tessera_cuda_emulator_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");

constexpr size_t kSmemAlign = 128;  // dynamic shared memory's alignment (ops/cuda/kernel_util.cuh: dynamic_shared)
constexpr size_t kStack = size_t(256) << 10;  // per thread: kernels keep arrays of up to a few KiB in registers

enum class State : uint8_t { ready, at_block_barrier, at_warp_barrier, done };

struct Slot {  // a lane's value in a warp exchange, and the exchange's number (runtime.cpp: warp_exchange)
    uint64_t value;
    uint32_t number;
};

struct Block {
    std::vector<std::byte*> stacks;  // kStack each, a guard page below
    std::vector<void*> sp;
    std::vector<State> state;
    std::vector<uint3> index;         // each thread's threadIdx
    std::vector<Slot> exchange;       // two slots per thread: a warp's exchanges alternate between them
    std::vector<uint32_t> exchanges;  // per thread: how many it has made
    std::vector<unsigned char> dynamic_smem;
    std::vector<unsigned> live, waiting;  // per warp: lanes not exited, lanes at a warp barrier
    void* scheduler_sp = nullptr;
    unsigned current = 0, threads = 0;
    bool reverse = false;
    void (*thread)(void*) = nullptr;
    void* context = nullptr;
};

Block g_block;
uint64_t g_launches = 0;
std::unordered_map<const void*, int> g_max_dynamic_smem;

[[noreturn]] void fiber_main();

// Control passes from lane to lane of a warp without the scheduler: a lane that stops (at a barrier, or exited)
// switches to the warp's next ready lane in the launch's order, or back to the scheduler when none is.
void switch_from(unsigned t) {
    Block& b = g_block;
    const unsigned first = t / 32 * 32, end = first + 32 < b.threads ? first + 32 : b.threads, lanes = end - first;
    for (unsigned k = 1; k <= lanes; ++k) {
        const unsigned i = t - first, j = b.reverse ? (i + lanes - k) % lanes : (i + k) % lanes, u = first + j;
        if (b.state[u] != State::ready) continue;
        b.current = u;
        threadIdx = b.index[u];
        tessera_cuda_emulator_switch(&b.sp[t], b.sp[u]);
        return;
    }
    tessera_cuda_emulator_switch(&b.sp[t], b.scheduler_sp);
}

// Opens warp w's barrier once every live lane waits at it.
bool open_warp_barrier(unsigned w) {
    Block& b = g_block;
    if (b.waiting[w] == 0 || b.waiting[w] != b.live[w]) return false;
    const unsigned first = w * 32, end = first + 32 < b.threads ? first + 32 : b.threads;
    for (unsigned t = first; t < end; ++t)
        if (b.state[t] == State::at_warp_barrier) b.state[t] = State::ready;
    b.waiting[w] = 0;
    return true;
}

[[noreturn]] void fiber_main() {
    Block& b = g_block;
    b.thread(b.context);
    const unsigned t = b.current;
    b.state[t] = State::done;
    --b.live[t / 32];
    open_warp_barrier(t / 32);
    switch_from(t);
    die("a finished fiber was resumed");
}

void start_fiber(unsigned t) {
    Block& b = g_block;
    while (b.stacks.size() <= t) {
        void* p =
            mmap(nullptr, kStack + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) die("cannot map a fiber's stack");
        mprotect(p, kPage, PROT_NONE);  // a stack overflow faults instead of writing into the next stack
        b.stacks.push_back(static_cast<std::byte*>(p) + kPage);
    }
    // the frame tessera_cuda_emulator_switch pops: six registers, then fiber_main as the return address at a 16-byte
    // boundary (so fiber_main starts with the stack aligned as after a call)
    auto* top = reinterpret_cast<uint64_t*>(b.stacks[t] + kStack);
    uint64_t* ret = top - 2;
    ret[0] = reinterpret_cast<uint64_t>(&fiber_main);
    ret[1] = 0;
    uint64_t* frame = ret - 6;
    for (int i = 0; i < 6; ++i) frame[i] = 0;
    b.sp[t] = frame;
    b.state[t] = State::ready;
}

// Runs one block to its end: each warp in turn from its first ready lane, its lanes passing control among
// themselves (switch_from) through the warp's exchanges until they all wait at __syncthreads or have exited; then the
// block barrier opens.
void run_block() {
    Block& b = g_block;
    const unsigned n = b.threads, warps = (n + 31) / 32;
    for (unsigned t = 0; t < n; ++t) start_fiber(t);
    b.live.assign(warps, 32);
    b.live[warps - 1] = n - (warps - 1) * 32;
    b.waiting.assign(warps, 0);
    for (;;) {
        unsigned done = 0;
        for (unsigned i = 0; i < warps; ++i) {
            const unsigned w = b.reverse ? warps - 1 - i : i, first = w * 32, end = first + 32 < n ? first + 32 : n;
            for (unsigned j = 0; j < end - first; ++j) {  // the warp's first ready lane in the launch's order
                const unsigned t = b.reverse ? end - 1 - j : first + j;
                if (b.state[t] != State::ready) continue;
                b.current = t;
                threadIdx = b.index[t];
                tessera_cuda_emulator_switch(&b.scheduler_sp, b.sp[t]);
                break;
            }
            if (b.waiting[w] > 0)
                die("deadlock in a kernel: its threads wait at different barriers (__syncthreads and a warp "
                    "shuffle), which hangs or is undefined on a GPU");
            done += (end - first) - b.live[w];
        }
        if (done == n) return;
        for (unsigned t = 0; t < n; ++t)  // every live thread waits at __syncthreads
            if (b.state[t] == State::at_block_barrier) b.state[t] = State::ready;
    }
}

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

bool reverse_order() {
    if (env_is("TESSERA_CUDA_EMULATOR_ORDER", "forward")) return false;
    if (env_is("TESSERA_CUDA_EMULATOR_ORDER", "reverse")) return true;
    return mix(g_launches) & 1;
}

bool copy_sides_ok(void* dst, const void* src, cudaMemcpyKind kind) {
    const Memory& m = memory();
    const bool d = m.contains(dst), s = m.contains(src);
    switch (kind) {
        case cudaMemcpyHostToHost:
            return !d && !s;
        case cudaMemcpyHostToDevice:
            return d && !s;
        case cudaMemcpyDeviceToHost:
            return !d && s;
        case cudaMemcpyDeviceToDevice:
            return d && s;
        case cudaMemcpyDefault:
            return true;
    }
    return false;
}

}  // namespace

bool is_device_pointer(const void* p) { return memory().contains(p); }

DeviceScope::DeviceScope() : work_(new DeviceWork) {}
DeviceScope::~DeviceScope() { delete static_cast<DeviceWork*>(work_); }

cudaError_t launch(const void* kernel,
                   dim3 grid,
                   dim3 block,
                   size_t dynamic_smem,
                   cudaStream_t,
                   void (*thread)(void*),
                   void* context) {
    DeviceWork work;
    const uint64_t threads = uint64_t(block.x) * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 || grid.y > 65535 ||
        grid.z > 65535)
        return record(cudaErrorInvalidConfiguration);
    if (dynamic_smem > 48 * 1024) {
        const auto it = g_max_dynamic_smem.find(kernel);
        if (it == g_max_dynamic_smem.end() || size_t(it->second) < dynamic_smem) return record(cudaErrorInvalidValue);
    }
    Block& b = g_block;
    b.threads = unsigned(threads);
    b.thread = thread;
    b.context = context;
    b.sp.assign(threads, nullptr);
    b.state.assign(threads, State::done);
    b.index.resize(threads);
    for (unsigned t = 0; t < threads; ++t) b.index[t] = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    blockDim = block;
    gridDim = grid;
    b.reverse = reverse_order();
    ++g_launches;
    const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
    for (uint64_t i = 0; i < blocks; ++i) {
        const uint64_t k = b.reverse ? blocks - 1 - i : i;
        blockIdx = {unsigned(k % grid.x), unsigned((k / grid.x) % grid.y), unsigned(k / (uint64_t(grid.x) * grid.y))};
        b.dynamic_smem.assign(dynamic_smem + kSmemAlign, 0xff);
        b.exchange.assign(2 * size_t(threads), Slot{0, 0});
        b.exchanges.assign(threads, 0);
        run_block();
    }
    return cudaSuccess;
}

cudaError_t set_max_dynamic_smem(const void* kernel, int bytes) {
    std::lock_guard<std::recursive_mutex> hold(lock());
    if (bytes < 0 || bytes > kMaxDynamicSmemOptin) return record(cudaErrorInvalidValue);
    g_max_dynamic_smem[kernel] = bytes;
    return cudaSuccess;
}

unsigned char* dynamic_shared_memory() {
    const auto at = reinterpret_cast<uintptr_t>(g_block.dynamic_smem.data());
    return g_block.dynamic_smem.data() + (kSmemAlign - at % kSmemAlign) % kSmemAlign;
}

void block_barrier() {
    Block& b = g_block;
    const unsigned t = b.current;
    b.state[t] = State::at_block_barrier;
    switch_from(t);
}

namespace {
// One barrier per exchange: its values go to one of two slots by the exchange's parity, so a lane's next exchange,
// which comes after every lane has passed this one's barrier and read, writes the other slot. Each slot carries the
// exchange's number, so a lane that has exited (or not taken part) is told apart from one that wrote.
Slot* exchange_slots(unsigned t) {
    Block& b = g_block;
    return b.exchange.data() + size_t(b.exchanges[t] & 1u) * b.threads;
}

// The last lane to arrive opens the barrier and goes on; the others pass control on.
void warp_barrier() {
    Block& b = g_block;
    const unsigned t = b.current;
    b.state[t] = State::at_warp_barrier;
    ++b.waiting[t / 32];
    if (open_warp_barrier(t / 32)) return;
    switch_from(t);
}
}  // namespace

void warp_sync() { warp_barrier(); }

void fault(const char* what) { die(what); }

uint64_t warp_exchange(uint64_t value, unsigned src) {
    Block& b = g_block;
    const unsigned t = b.current, from = t / 32 * 32 + src, number = b.exchanges[t] + 1;
    Slot* slots = exchange_slots(t);
    slots[t] = {value, number};
    warp_barrier();
    const uint64_t r = from < b.threads && slots[from].number == number ? slots[from].value : value;
    b.exchanges[t] = number;
    return r;
}

unsigned warp_ballot(bool predicate) {
    Block& b = g_block;
    const unsigned t = b.current, first = t / 32 * 32, end = first + 32 < b.threads ? first + 32 : b.threads;
    const unsigned number = b.exchanges[t] + 1;
    Slot* slots = exchange_slots(t);
    slots[t] = {predicate, number};
    warp_barrier();
    unsigned bits = 0;
    for (unsigned l = first; l < end; ++l)
        if (slots[l].number == number && slots[l].value) bits |= 1u << (l - first);
    b.exchanges[t] = number;
    return bits;
}

}  // namespace tessera::cuda_emulator

using namespace tessera::cuda_emulator;

namespace {
// The devices a process sees: TESSERA_CUDA_EMULATOR_DEVICES (1 to 64), 8 by default, as on a node of 8 GPUs. They are
// one device under several indices: a process (an mpirun rank) uses one, so each rank has a device of its own.
int device_count() {
    static const int count = [] {
        const char* v = std::getenv("TESSERA_CUDA_EMULATOR_DEVICES");
        if (!v) return 8;
        char* end = nullptr;
        const long n = std::strtol(v, &end, 10);
        if (end == v || *end != '\0' || n < 1 || n > 64) die("TESSERA_CUDA_EMULATOR_DEVICES: not a count from 1 to 64");
        return int(n);
    }();
    return count;
}
thread_local int g_device = 0;  // per host thread, as in CUDA
bool device_ok(int device) { return device >= 0 && device < device_count(); }
}  // namespace

cudaError_t cudaGetDeviceCount(int* count) {
    *count = device_count();
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
    *device = g_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (!device_ok(device)) return record(cudaErrorInvalidValue);
    g_device = device;
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* p) {
    const bool device = memory().contains(p);
    *attributes = {device ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered, device ? g_device : -1,
                   device ? const_cast<void*>(p) : nullptr, device ? nullptr : const_cast<void*>(p)};
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
    std::lock_guard<std::recursive_mutex> hold(lock());
    size_t used = 0;
    for (const auto& [at, size] : memory().used) used += size;
    *free = kReserve - used;
    *total = kReserve;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (!device_ok(device)) return record(cudaErrorInvalidValue);
    *prop = {};
    std::snprintf(prop->name, sizeof prop->name, "tessera CUDA emulator (on the CPU)");
    prop->totalGlobalMem = kReserve;
    prop->sharedMemPerBlock = 48 * 1024;
    prop->sharedMemPerBlockOptin = kMaxDynamicSmemOptin;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->multiProcessorCount = 1;
    prop->major = 9;
    prop->minor = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    if (!device_ok(device) || attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return record(cudaErrorInvalidValue);
    *value = kMaxDynamicSmemOptin;
    return cudaSuccess;
}

cudaError_t cudaGetLastError() {
    std::lock_guard<std::recursive_mutex> hold(lock());
    const cudaError_t e = g_last_error;
    g_last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError() {
    std::lock_guard<std::recursive_mutex> hold(lock());
    return g_last_error;
}

const char* cudaGetErrorString(cudaError_t err) {
    switch (err) {
        case cudaSuccess:
            return "no error";
        case cudaErrorInvalidValue:
            return "invalid argument";
        case cudaErrorMemoryAllocation:
            return "out of memory";
        case cudaErrorInvalidConfiguration:
            return "invalid configuration argument";
        case cudaErrorInvalidDevicePointer:
            return "invalid device pointer";
        case cudaErrorInvalidMemcpyDirection:
            return "invalid copy direction for memcpy";
        case cudaErrorNoDevice:
            return "no CUDA-capable device is detected";
        case cudaErrorLaunchFailure:
            return "unspecified launch failure";
    }
    return "unknown error";
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
    std::lock_guard<std::recursive_mutex> hold(lock());
    Memory& m = memory();
    const size_t size = (bytes + kPage - 1) / kPage * kPage;
    for (auto it = m.free_.begin(); it != m.free_.end(); ++it) {
        if (it->second < size) continue;
        const size_t at = it->first, rest = it->second - size;
        m.free_.erase(it);
        if (rest > 0) m.free_[at + size] = rest;
        m.used[at] = size;
        m.grow(at + size);
        std::byte* q = m.base + at;
        DeviceWork work;
        std::memset(q, 0xff, size);
        *p = q;
        return cudaSuccess;
    }
    return record(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* p) {
    if (!p) return cudaSuccess;
    std::lock_guard<std::recursive_mutex> hold(lock());
    Memory& m = memory();
    const auto it = m.contains(p) ? m.used.find(size_t(static_cast<std::byte*>(p) - m.base)) : m.used.end();
    if (it == m.used.end()) return record(cudaErrorInvalidDevicePointer);
    size_t at = it->first, size = it->second;
    m.used.erase(it);
    if (size >= kHugePage) madvise(m.base + at, size, MADV_DONTNEED);  // give large pieces' pages back
    // merge with the free neighbours
    auto next = m.free_.lower_bound(at);
    if (next != m.free_.end() && next->first == at + size) {
        size += next->second;
        next = m.free_.erase(next);
    }
    if (next != m.free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == at) {
            prev->second += size;
            return cudaSuccess;
        }
    }
    m.free_[at] = size;
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
    DeviceWork work;
    if (bytes > 0 && !memory().contains(p)) return record(cudaErrorInvalidValue);
    std::memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int value, size_t width, size_t height, cudaStream_t) {
    DeviceWork work;
    if (width > 0 && height > 0 && (!memory().contains(p) || width > pitch)) return record(cudaErrorInvalidValue);
    for (size_t r = 0; r < height; ++r) std::memset(static_cast<std::byte*>(p) + r * pitch, value, width);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
    DeviceWork work;
    if (bytes == 0) return cudaSuccess;
    if (!copy_sides_ok(dst, src, kind)) return record(cudaErrorInvalidValue);
    std::memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst,
                              size_t dpitch,
                              const void* src,
                              size_t spitch,
                              size_t width,
                              size_t height,
                              cudaMemcpyKind kind,
                              cudaStream_t) {
    DeviceWork work;
    if (width == 0 || height == 0) return cudaSuccess;
    if (!copy_sides_ok(dst, src, kind) || width > dpitch || width > spitch) return record(cudaErrorInvalidValue);
    for (size_t r = 0; r < height; ++r)
        std::memmove(static_cast<std::byte*>(dst) + r * dpitch, static_cast<const std::byte*>(src) + r * spitch, width);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// a handle is a byte of its own, so that handles differ and a destroyed one can be checked
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
    *stream = reinterpret_cast<cudaStream_t>(new char);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    delete reinterpret_cast<char*>(stream);
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
    *event = reinterpret_cast<cudaEvent_t>(new char);
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
    delete reinterpret_cast<char*>(event);
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
    return event ? cudaSuccess : record(cudaErrorInvalidValue);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t event, unsigned) {
    return event ? cudaSuccess : record(cudaErrorInvalidValue);
}
