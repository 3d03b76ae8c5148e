// Which ops a computation ran (`tessera onboard` checks those against their references): while an OpUseRecorder
// lives, every op's forward entry point notes its registry name (ops/registry.h). Without a recorder a note is
// one relaxed atomic load.
#pragma once

#include <set>
#include <string>

namespace tessera::ops {

void note_op_use(const char* name);

class OpUseRecorder {
  public:
    OpUseRecorder();  // one at a time (a second is an error)
    ~OpUseRecorder();
    OpUseRecorder(const OpUseRecorder&) = delete;
    OpUseRecorder& operator=(const OpUseRecorder&) = delete;
    std::set<std::string> used() const;  // the registry names noted so far
};

}  // namespace tessera::ops
