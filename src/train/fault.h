// Faults injected on purpose, for the operations tests (tests/e2e/test_recovery.cpp, docs/operations.md):
// TESSERA_FAULT=KIND:STEP[:RANK] (rank 0 when not given) acts just before that step on that rank:
//   kill   the process sends itself SIGKILL (what kill -9 from outside does)
//   hang   the process sleeps for ever (a rank lost inside a collective: the others wait for it)
//   slow   the process sleeps 300 ms in every step from STEP on (a straggler)
//   nan    the step's gradient norm is NaN (a non-finite step)
//   kill_write  SIGKILL while the checkpoint of step STEP is written (between two of its files)
// Only in a job's first attempt: tessera launch sets TESSERA_RESTARTS on restarts, and a restarted job runs
// without the fault.
#pragma once

#include <cstdint>

namespace tessera::train {

struct Fault {
    enum Kind { none, kill, hang, slow, nan, kill_write } kind = none;
    int64_t step = 0;
    void before_step(int64_t step) const;          // kill, hang, slow
    void while_writing(int64_t checkpoint) const;  // kill_write
    bool poisons(int64_t s) const { return kind == nan && s == step; }
};

// This rank's fault from the environment (none when unset, on another rank, or on a restart); a malformed value
// is a one-line error.
Fault fault_from_env(int rank);

// TESSERA_RESTARTS: how many times tessera launch restarted the job before this attempt (0 when unset).
int64_t restarts_before();

}  // namespace tessera::train
