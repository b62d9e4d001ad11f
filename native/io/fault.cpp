#include "fault.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace infinity::io {
namespace {
std::atomic<int64_t> g_countdown{0};  // 0 = off
std::atomic<int> g_mode{0};
std::atomic<int> g_errno{0};
}  // namespace

void arm_fault(int64_t nth, FaultMode mode, int err) {
  g_mode.store(static_cast<int>(mode));
  g_errno.store(err);
  g_countdown.store(nth > 0 ? nth : 0);
}

void disarm_fault() { g_countdown.store(0); }

int64_t apply_fault(int64_t res, uint64_t len) {
  if (g_countdown.load(std::memory_order_relaxed) <= 0) return res;
  // Exactly one completion sees the countdown go from 1 to 0.
  if (g_countdown.fetch_sub(1) != 1) return res;
  switch (static_cast<FaultMode>(g_mode.load())) {
    case FaultMode::kErrno: return -static_cast<int64_t>(g_errno.load());
    case FaultMode::kShort: return res > 0 ? res / 2 : res;
    case FaultMode::kZero: return len > 0 ? 0 : res;
    default: return res;
  }
}

bool arm_fault_from_env() {
  const char* s = std::getenv("INFINITY_IO_FAULT");
  if (!s || !*s) return true;
  long long nth = 0;
  char mode[16] = {0};
  int err = 5;  // EIO
  int got = std::sscanf(s, "%lld:%15[a-z]:%d", &nth, mode, &err);
  if (got < 2 || nth <= 0) return false;
  std::string_view m(mode);
  FaultMode fm = m == "errno" ? FaultMode::kErrno : m == "short" ? FaultMode::kShort
               : m == "zero" ? FaultMode::kZero : FaultMode::kNone;
  if (fm == FaultMode::kNone) return false;
  arm_fault(nth, fm, err);
  return true;
}

}  // namespace infinity::io
