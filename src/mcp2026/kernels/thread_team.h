// A decode stack's threads as one team for the whole step (DecodeStack::run): the kernels split their loops with
// team::parallel_for, which hands the other threads their parts through a spinning handshake instead of an
// OpenMP fork and join per call. A batch-1 step of a small model makes about five parallel calls per layer, each
// a few microseconds of work, and a fork and join adds more than a microsecond to each. Outside a team,
// team::parallel_for is at::parallel_for. A range is divided as at::parallel_for divides it, and every kernel's
// result is independent of how its range is divided, so a step gives the same numbers either way.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace team {

inline void pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

struct Team {
  int64_t size = 1;
  alignas(64) std::atomic<uint64_t> posted{0};  // the job number thread 0 last posted
  alignas(64) std::atomic<int64_t> remaining{0};  // helpers still on the posted job
  alignas(64) void (*fn)(const void*, int64_t, int64_t) = nullptr;  // null: the step is over
  const void* ctx = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first helper's, rethrown on thread 0
};

// The team whose thread 0 is this thread (null elsewhere, including on its helpers).
inline thread_local Team* current = nullptr;

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* t = current;
  if (t == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t tasks = std::min(t->size, (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (tasks <= 1) {  // as at::parallel_for: one thread's worth runs inline
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + tasks - 1) / tasks;
  t->fn = [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); };
  t->ctx = &f;
  t->begin = begin;
  t->end = end;
  t->chunk = chunk;
  t->remaining.store(t->size - 1, std::memory_order_relaxed);
  t->posted.store(t->posted.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  std::exception_ptr own;  // the helpers still use f and t's fields: wait for them before leaving
  try {
    f(begin, std::min(end, begin + chunk));
  } catch (...) {
    own = std::current_exception();
  }
  while (t->remaining.load(std::memory_order_acquire) != 0) pause();
  if (own) std::rethrow_exception(own);
  if (t->failed.load(std::memory_order_relaxed)) {
    t->failed.store(false, std::memory_order_relaxed);
    std::rethrow_exception(std::exchange(t->error, nullptr));
  }
}

// body() on this thread while the other OpenMP threads serve its team::parallel_for calls, until it returns.
// With one thread (or already inside a parallel region) body() runs as it would without a team.
template <typename Body>
void run(const Body& body) {
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || at::in_parallel_region() || current != nullptr) {
    body();
    return;
  }
  Team t;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      t.size = omp_get_num_threads();
      if (t.size > 1) current = &t;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      current = nullptr;
      t.fn = nullptr;
      t.posted.store(t.posted.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    } else {
      uint64_t seen = 0;
      for (;;) {
        uint64_t job;
        while ((job = t.posted.load(std::memory_order_acquire)) == seen) pause();
        seen = job;
        if (t.fn == nullptr) break;
        const int64_t b = t.begin + tid * t.chunk, e = std::min(t.end, b + t.chunk);
        if (b < e) {
          try {
            t.fn(t.ctx, b, e);
          } catch (...) {
            if (!t.failed.exchange(true)) t.error = std::current_exception();
          }
        }
        t.remaining.fetch_sub(1, std::memory_order_release);
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace team
