// Injected faults (see fault.h).
#include "train/fault.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/check.h"

namespace tessera::train {

int64_t restarts_before() {
    const char* v = std::getenv("TESSERA_RESTARTS");
    if (!v || !*v) return 0;
    try {
        return std::max<int64_t>(0, std::stoll(v));
    } catch (const std::exception&) {
        TESSERA_FAIL("TESSERA_RESTARTS={}: not a number", v);
    }
}

Fault fault_from_env(int rank) {
    const char* v = std::getenv("TESSERA_FAULT");
    if (!v || !*v || restarts_before() > 0) return {};
    const std::string s = v;
    const size_t c1 = s.find(':'), c2 = c1 == std::string::npos ? c1 : s.find(':', c1 + 1);
    TESSERA_CHECK(c1 != std::string::npos, "TESSERA_FAULT={}: expected KIND:STEP[:RANK]", s);
    const std::string kind = s.substr(0, c1);
    Fault f;
    int64_t at_rank = 0;
    try {
        f.step = std::stoll(s.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1));
        if (c2 != std::string::npos) at_rank = std::stoll(s.substr(c2 + 1));
    } catch (const std::exception&) {
        TESSERA_FAIL("TESSERA_FAULT={}: STEP and RANK must be numbers", s);
    }
    static const std::pair<const char*, Fault::Kind> kinds[] = {{"kill", Fault::kill},
                                                                {"hang", Fault::hang},
                                                                {"slow", Fault::slow},
                                                                {"nan", Fault::nan},
                                                                {"kill_write", Fault::kill_write}};
    for (const auto& [name, k] : kinds)
        if (kind == name) f.kind = k;
    TESSERA_CHECK(f.kind != Fault::none, "TESSERA_FAULT={}: unknown fault '{}' (kill, hang, slow, nan, kill_write)", s,
                  kind);
    return at_rank == rank ? f : Fault{};
}

namespace {
void say(const char* what, int64_t step) {  // the moment of the fault, for the recovery times
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::fprintf(stderr, "TESSERA_FAULT: %s step %lld at unix time %.3f\n", what, static_cast<long long>(step), now);
    std::fflush(stderr);
}
}  // namespace

void Fault::while_writing(int64_t checkpoint) const {
    if (kind != kill_write || checkpoint != step) return;
    say("kill while writing the checkpoint of", checkpoint);
    std::raise(SIGKILL);
}

void Fault::before_step(int64_t s) const {
    if ((kind == kill || kind == hang) && s == step) say(kind == kill ? "kill before" : "hang before", s);
    if (kind == kill && s == step) std::raise(SIGKILL);
    if (kind == hang && s == step)
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    if (kind == slow && s >= step) std::this_thread::sleep_for(std::chrono::milliseconds(300));
}

}  // namespace tessera::train
