#include "ops/op_use.h"

#include <atomic>
#include <mutex>

#include "core/check.h"

namespace tessera::ops {

namespace {
struct UseSet {
    std::mutex mu;
    std::set<std::string> names;
};
std::atomic<UseSet*> g_recording{nullptr};
}  // namespace

void note_op_use(const char* name) {
    UseSet* s = g_recording.load(std::memory_order_relaxed);
    if (!s) return;
    std::lock_guard lock(s->mu);
    s->names.insert(name);
}

OpUseRecorder::OpUseRecorder() {
    UseSet* expected = nullptr;
    auto* s = new UseSet;
    if (!g_recording.compare_exchange_strong(expected, s)) {
        delete s;
        TESSERA_CHECK(false, "an op-use recorder is already active");
    }
}

OpUseRecorder::~OpUseRecorder() { delete g_recording.exchange(nullptr); }

std::set<std::string> OpUseRecorder::used() const {
    UseSet* s = g_recording.load();
    std::lock_guard lock(s->mu);
    return s->names;
}

}  // namespace tessera::ops
