// A small persistent thread pool for the memory-bound CPU kernels.
//
// Why not OpenMP: torch ships its own OpenMP runtime and we must not fight
// over it or its settings; a dozen lines of our own keep the native module
// free of both torch and OpenMP.
#pragma once

#include <cstddef>
#include <functional>

namespace infinity::cpu {

// Runs fn(task) for task in [0, ntasks) across the pool; the caller runs
// task 0. Calls from several threads are serialised.
void parallel_run(int ntasks, const std::function<void(int)>& fn);

// Splits [0, n) into at most num_threads() contiguous ranges, each a
// multiple of `align` elements except the last, and runs fn(lo, hi) on each.
// Ranges smaller than `min_per_thread` are merged, so small inputs stay on
// the calling thread.
void parallel_for(size_t n, size_t align, size_t min_per_thread, const std::function<void(size_t, size_t)>& fn);

int num_threads();
void set_num_threads(int n);  // n < 1 means "all cores"

}  // namespace infinity::cpu
