// Stand-ins for the Metal built-ins that the mlx-dflash kernels use, so that the same kernel
// text (metal_kernels/*.h and *.metal) compiles and runs as C++ on a machine without Metal
// (tests/kernel_harness.py generates the translation unit and drives it).
//
// Threads. The threads of a threadgroup are fibers on one OS thread (a few lines of assembly
// switch stacks on x86-64 ELF; ucontext elsewhere, ~10x slower for its signal-mask syscalls). A
// fiber runs
// until it reaches a threadgroup_barrier or a simdgroup collective (simd_sum, ...), where it
// waits until every thread of its threadgroup (barrier) or simdgroup (collective) has arrived.
// Then the scheduler resumes the waiting fiber that comes first in the launch's order:
//   kForward  thread 0 first, kReverse  the last thread first,
//   kShuffled a fresh seeded random order at every switch,
//   kRoundRobin  each runnable fiber in turn.
// A fiber always runs as far as it can, so one simdgroup runs ahead of the others as far as
// the barriers let it: without a barrier between a write to threadgroup memory and a read by
// another simdgroup, one of the orders reads before the write (or after the next write).
// Between switches a fiber's memory accesses are atomic, which makes the threadgroup atomics
// plain operations.
//
// Errors a GPU would hide or hang on are reported: a barrier that not all threads reach,
// simdgroup lanes in different collectives, or a deadlock.
//
// Threadgroup memory. Kernels declare threadgroup arrays with DFLASH_THREADGROUP, defined here
// as `static thread_local`: one copy per OS thread, shared by the fibers of the threadgroup
// that runs on it. Threadgroups of a launch run one after another.
#pragma once

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // macOS hides its (deprecated) ucontext without it
#endif
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using uint = unsigned int;
using ushort = unsigned short;

struct uint3 {
  uint x, y, z;
};

namespace harness {

// A fiber's saved state: its stack pointer (the callee-saved registers are on its stack).
#if defined(__x86_64__) && defined(__ELF__) && !defined(DFLASH_HARNESS_UCONTEXT)
extern "C" void dflash_harness_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl dflash_harness_switch
.hidden dflash_harness_switch
.type dflash_harness_switch, @function
dflash_harness_switch:
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
.size dflash_harness_switch, .-dflash_harness_switch
)");

struct Context {
  void* sp = nullptr;
};

inline void switch_context(Context& from, Context& to) { dflash_harness_switch(&from.sp, to.sp); }

// A stack that "returns" into entry with the alignment of a call, below six zeroed registers.
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;  // entry's return address: it never returns
  *--sp = reinterpret_cast<void*>(entry);
  for (int r = 0; r < 6; r++) *--sp = nullptr;
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;  // entry never returns
  makecontext(&c.uc, entry, 0);
}
#endif

enum Order { kForward = 0, kReverse = 1, kShuffled = 2, kRoundRobin = 3 };
enum class Wait { kRunnable, kBarrier, kSimd, kDone };

struct Fiber {
  Context context;
  uint index = 0;
  Wait wait = Wait::kRunnable;
};

struct SimdGroup {
  int arrived = 0;
  int lanes = 32;
  const char* op = nullptr;  // the collective the lanes are in
  alignas(8) unsigned char in[32][8];
  alignas(8) unsigned char out[32][8];
};

struct Threadgroup {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simd;
  Context scheduler;
  Fiber* current = nullptr;
  int barrier_arrived = 0;
  std::string error;
  std::function<void(uint)> body;
};

inline thread_local Threadgroup* active = nullptr;

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
  Threadgroup& tg = *active;
  switch_context(tg.current->context, tg.scheduler);
}

// Stop this fiber for good after an error (the scheduler never resumes it).
[[noreturn]] inline void fail(const std::string& message) {
  Threadgroup& tg = *active;
  if (tg.error.empty()) {
    tg.error = message;
  }
  tg.current->wait = Wait::kDone;
  yield();
  std::abort();
}

inline void barrier() {
  Threadgroup& tg = *active;
  tg.current->wait = Wait::kBarrier;
  if (++tg.barrier_arrived == static_cast<int>(tg.fibers.size())) {
    tg.barrier_arrived = 0;
    for (Fiber& f : tg.fibers) {
      if (f.wait == Wait::kBarrier) f.wait = Wait::kRunnable;
    }
  }
  yield();
}

// A simdgroup collective: every lane brings a value, and once all lanes have, each gets
// combine(values, lanes, its lane).
template <typename T, typename Combine>
inline T collective(const char* op, T value, Combine combine) {
  static_assert(sizeof(T) <= 8, "collectives on values of up to 8 bytes");
  Threadgroup& tg = *active;
  Fiber& me = *tg.current;
  SimdGroup& g = tg.simd[me.index / 32];
  uint lane = me.index % 32;
  if (g.arrived == 0) {
    g.op = op;
  } else if (std::strcmp(g.op, op) != 0) {
    fail(std::string("simdgroup lanes in different collectives: ") + g.op + " and " + op);
  }
  std::memcpy(g.in[lane], &value, sizeof(T));
  me.wait = Wait::kSimd;
  if (++g.arrived == g.lanes) {
    T values[32];
    for (int l = 0; l < g.lanes; l++) {
      std::memcpy(&values[l], g.in[l], sizeof(T));
    }
    for (int l = 0; l < g.lanes; l++) {
      T r = combine(values, g.lanes, l);
      std::memcpy(g.out[l], &r, sizeof(T));
    }
    g.arrived = 0;
    uint first = (me.index / 32) * 32;
    for (int l = 0; l < g.lanes; l++) {
      tg.fibers[first + l].wait = Wait::kRunnable;
    }
  }
  yield();
  T r;
  std::memcpy(&r, g.out[lane], sizeof(T));
  return r;
}

[[noreturn]] inline void fiber_entry() {
  Threadgroup& tg = *active;
  tg.body(tg.current->index);
  tg.current->wait = Wait::kDone;
  yield();  // for good: a finished fiber is never resumed
  std::abort();
}

// Why no fiber can run, for the error message.
inline std::string stall_reason(const Threadgroup& tg) {
  int done = 0, at_barrier = 0, at_simd = 0;
  for (const Fiber& f : tg.fibers) {
    done += f.wait == Wait::kDone;
    at_barrier += f.wait == Wait::kBarrier;
    at_simd += f.wait == Wait::kSimd;
  }
  return "threads stalled: " + std::to_string(at_barrier) + " at a barrier, " +
         std::to_string(at_simd) + " in a simdgroup collective, " + std::to_string(done) +
         " finished (a barrier or collective not reached by every thread)";
}

// The next fiber to resume, or -1 when none can run.
inline int pick_next(const Threadgroup& tg, Order order, std::mt19937_64& rng, size_t& cursor) {
  const size_t n = tg.fibers.size();
  auto runnable = [&](size_t i) { return tg.fibers[i].wait == Wait::kRunnable; };
  if (order == kShuffled) {
    std::vector<int> ready;
    for (size_t i = 0; i < n; i++) {
      if (runnable(i)) ready.push_back(static_cast<int>(i));
    }
    if (ready.empty()) return -1;
    return ready[rng() % ready.size()];
  }
  for (size_t k = 0; k < n; k++) {
    size_t i = order == kForward ? k : order == kReverse ? n - 1 - k : (cursor + k) % n;
    if (runnable(i)) {
      cursor = i + 1;
      return static_cast<int>(i);
    }
  }
  return -1;
}

// Runs `body(thread index)` for every thread of one threadgroup of n_threads threads.
inline std::string run_threadgroup(uint n_threads, Order order, uint64_t seed,
                                   std::vector<std::unique_ptr<char[]>>& stacks,
                                   size_t stack_size, std::function<void(uint)> body) {
  Threadgroup tg;
  tg.body = std::move(body);
  tg.fibers.resize(n_threads);
  tg.simd.resize((n_threads + 31) / 32);
  for (size_t g = 0; g < tg.simd.size(); g++) {
    tg.simd[g].lanes = static_cast<int>(std::min<uint>(32, n_threads - 32 * g));
  }
  while (stacks.size() < n_threads) {
    stacks.emplace_back(new char[stack_size]);
  }
  for (uint i = 0; i < n_threads; i++) {
    Fiber& f = tg.fibers[i];
    f.index = i;
    make_context(f.context, stacks[i].get(), stack_size, fiber_entry);
  }
  Threadgroup* outer = active;
  active = &tg;
  std::mt19937_64 rng(seed);
  size_t cursor = 0;
  while (tg.error.empty()) {
    int next = pick_next(tg, order, rng, cursor);
    if (next < 0) {
      bool all_done = std::all_of(tg.fibers.begin(), tg.fibers.end(),
                                  [](const Fiber& f) { return f.wait == Wait::kDone; });
      if (!all_done) tg.error = stall_reason(tg);
      break;
    }
    tg.current = &tg.fibers[next];
    switch_context(tg.scheduler, tg.current->context);
  }
  active = outer;
  return tg.error;
}

// The attribute values of one thread (the names MLX passes to a kernel that mentions them).
struct ThreadIds {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_threadgroup;
  uint3 threadgroups_per_grid;
  uint3 threads_per_grid;
  uint thread_index_in_threadgroup;
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint threads_per_simdgroup;
  uint thread_execution_width;
};

// A 1-D launch like mx.fast.metal_kernel's: grid = total threads, threadgroup = threads per
// group. Returns "" or the first error.
inline std::string launch(uint grid, uint group, Order order, uint64_t seed,
                          const std::function<void(const ThreadIds&)>& kernel) {
  if (group == 0 || grid % group != 0) {
    return "grid must be a positive multiple of the threadgroup size";
  }
  const size_t stack_size = 128 * 1024;
  std::vector<std::unique_ptr<char[]>> stacks;
  const uint groups = grid / group;
  for (uint g = 0; g < groups; g++) {
    auto body = [&, g](uint t) {
      ThreadIds ids;
      ids.thread_position_in_grid = {g * group + t, 0, 0};
      ids.thread_position_in_threadgroup = {t, 0, 0};
      ids.threadgroup_position_in_grid = {g, 0, 0};
      ids.threads_per_threadgroup = {group, 1, 1};
      ids.threadgroups_per_grid = {groups, 1, 1};
      ids.threads_per_grid = {grid, 1, 1};
      ids.thread_index_in_threadgroup = t;
      ids.thread_index_in_simdgroup = t % 32;
      ids.simdgroup_index_in_threadgroup = t / 32;
      ids.simdgroups_per_threadgroup = (group + 31) / 32;
      ids.threads_per_simdgroup = 32;
      ids.thread_execution_width = 32;
      kernel(ids);
    };
    std::string error = run_threadgroup(group, order, seed + g, stacks, stack_size, body);
    if (!error.empty()) {
      return "threadgroup " + std::to_string(g) + ": " + error;
    }
  }
  return "";
}

}  // namespace harness

// Metal types the kernels may take as inputs.
struct bfloat16_t {
  uint16_t bits;
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};
// IEEE half, converted in software (not every g++ has _Float16).
struct float16_t {
  uint16_t bits;
  operator float() const {
    uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
    uint32_t exponent = (bits >> 10) & 0x1fu;
    uint32_t mantissa = bits & 0x3ffu;
    uint32_t out;
    if (exponent == 0 && mantissa == 0) {
      out = sign;
    } else if (exponent == 0) {  // subnormal: normalise
      int shift = -1;
      do {
        shift++;
        mantissa <<= 1;
      } while (!(mantissa & 0x400u));
      out = sign | static_cast<uint32_t>(112 - shift) << 23 | (mantissa & 0x3ffu) << 13;
    } else if (exponent == 31) {
      out = sign | 0x7f800000u | mantissa << 13;
    } else {
      out = sign | (exponent + 112) << 23 | mantissa << 13;
    }
    float f;
    std::memcpy(&f, &out, sizeof f);
    return f;
  }
};

template <typename To, typename From>
inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

inline void threadgroup_barrier(mem_flags) { harness::barrier(); }

inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isnan(float x) { return std::isnan(x); }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }

// With DFLASH_HARNESS_SIMD_SKEW defined (a small number e), simdgroup g's float sums come out
// scaled by 1 + g * e: a GPU need not round a sum of the same values the same way in every
// simdgroup, and a kernel whose threads branch on such sums must still agree.
template <typename T>
inline T simd_sum(T v) {
  T s = harness::collective("simd_sum", v, [](const T* x, int n, int) {
    T s = x[0];
    for (int l = 1; l < n; l++) s += x[l];
    return s;
  });
#ifdef DFLASH_HARNESS_SIMD_SKEW
  if constexpr (std::is_floating_point<T>::value) {
    s *= T(1) + T(DFLASH_HARNESS_SIMD_SKEW) * T(harness::active->current->index / 32);
  }
#endif
  return s;
}

template <typename T>
inline T simd_max(T v) {
  return harness::collective("simd_max", v, [](const T* x, int n, int) {
    T m = x[0];
    for (int l = 1; l < n; l++) m = x[l] > m ? x[l] : m;
    return m;
  });
}

template <typename T>
inline T simd_min(T v) {
  return harness::collective("simd_min", v, [](const T* x, int n, int) {
    T m = x[0];
    for (int l = 1; l < n; l++) m = x[l] < m ? x[l] : m;
    return m;
  });
}

template <typename T>
inline T simd_prefix_exclusive_sum(T v) {
  return harness::collective("simd_prefix_exclusive_sum", v, [](const T* x, int, int lane) {
    T s = T(0);
    for (int l = 0; l < lane; l++) s += x[l];
    return s;
  });
}

template <typename T>
inline T simd_prefix_inclusive_sum(T v) {
  return harness::collective("simd_prefix_inclusive_sum", v, [](const T* x, int, int lane) {
    T s = x[0];
    for (int l = 1; l <= lane; l++) s += x[l];
    return s;
  });
}

template <typename T>
inline T simd_broadcast(T v, ushort from) {
  return harness::collective("simd_broadcast", v,
                             [from](const T* x, int, int) { return x[from]; });
}

// Threadgroup atomics: fibers switch only at barriers and collectives, so plain operations
// on them are atomic.
struct atomic_uint {
  uint value;
};
enum memory_order { memory_order_relaxed };

inline void atomic_store_explicit(atomic_uint* a, uint v, memory_order) { a->value = v; }
inline uint atomic_load_explicit(atomic_uint* a, memory_order) { return a->value; }
inline uint atomic_fetch_add_explicit(atomic_uint* a, uint v, memory_order) {
  uint old = a->value;
  a->value += v;
  return old;
}

}  // namespace metal

using namespace metal;

// Metal's address spaces: nothing in C++ ...
#define device
#define constant
#define thread
#define threadgroup
// ... except threadgroup arrays, which the fibers of a threadgroup share (see above).
#define DFLASH_THREADGROUP static thread_local
