// Test-only fault injection. Arm it and the Nth chunk completion (counted
// from the moment it is armed, across all handles) is replaced by a failure,
// so tests can prove that errors and short transfers are never reported as
// success. Also armed from the environment: INFINITY_IO_FAULT="nth:mode[:errno]".
#pragma once

#include <cstdint>

namespace infinity::io {

enum class FaultMode : int {
  kNone = 0,
  kErrno = 1,  // the completion becomes -errno
  kShort = 2,  // only half of the bytes are reported moved
  kZero = 3,   // zero bytes moved (end of file / no progress)
};

void arm_fault(int64_t nth, FaultMode mode, int err);
void disarm_fault();
// Applied to every completion; returns the (possibly replaced) result.
int64_t apply_fault(int64_t res, uint64_t len);
// Reads INFINITY_IO_FAULT once; returns false and leaves faults off if it is malformed.
bool arm_fault_from_env();

}  // namespace infinity::io
