// Stand-ins for the Metal built-ins that the mlx-dflash kernels use, so that the same kernel
// text (metal_kernels/*.h and *.metal, or the source MLX generates from them) compiles and runs
// as C++ on a machine without Metal (tests/kernel_harness.py generates the translation unit
// and drives it).
//
// Threads, by default. The threads of a threadgroup are fibers on one OS thread (a few lines
// of assembly switch stacks on x86-64 ELF; ucontext elsewhere, ~10x slower for its signal-mask
// syscalls). A fiber runs until it reaches a threadgroup_barrier or a simdgroup collective
// (simd_sum, ...), where it waits until every thread of its threadgroup (barrier) or simdgroup
// (collective) has arrived; with kSwitchOnShared it also yields before each access to
// threadgroup memory (it stays runnable). Then the scheduler resumes the runnable fiber that
// comes first in the launch's order:
//   kForward  thread 0 first, kReverse  the last thread first,
//   kShuffled a fresh seeded random order at every switch,
//   kRoundRobin  each runnable fiber in turn.
// A fiber always runs as far as it can, so one simdgroup runs ahead of the others as far as
// the barriers let it: without a barrier between a write to threadgroup memory and a read by
// another simdgroup, one of the orders reads before the write (or after the next write).
// Between switches a fiber's memory accesses are atomic.
//
// kOsThreads instead runs one std::thread per GPU thread of the threadgroup, with a real
// barrier, collectives that synchronise each simdgroup's lanes, and real (relaxed) atomics.
//
// Errors a GPU would hide or hang on are reported: a barrier that not all threads reach,
// simdgroup lanes in different collectives (with kCheckSites: in the same collective called
// from different source lines, which on a GPU are divergent calls over part of the lanes), or
// a deadlock.
//
// Threadgroup memory. Kernels declare it with DFLASH_THREADGROUP(T, name, n) and pass it to
// helpers as tg_ptr<T> (`threadgroup T name[n]` and `threadgroup T*` on Metal). Here the
// storage is allocated per threadgroup, on the first thread's arrival at the declaration,
// filled with garbage under kGarbage (NaN floats, 0xA5 bytes otherwise; zeros without), and
// every access goes through TgRef, where kSwitchOnShared puts its switch points. Threadgroups
// of a launch run one after another.
//
// Address spaces. With DFLASH_HARNESS_ADDRESS_SPACES (clang), device, constant and threadgroup
// are distinct address spaces (__attribute__((address_space(N)))), so passing a pointer of one
// where another is declared fails to compile, as in Metal; elsewhere they are erased.
#pragma once

#if defined(__APPLE__) && !defined(_XOPEN_SOURCE)
#define _XOPEN_SOURCE 600  // macOS hides its (deprecated) ucontext without it
#endif
#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define DFLASH_HARNESS 1

#ifdef DFLASH_HARNESS_ADDRESS_SPACES
#define DFLASH_AS_DEVICE __attribute__((address_space(1)))
#define DFLASH_AS_CONSTANT __attribute__((address_space(2)))
#define DFLASH_AS_THREADGROUP __attribute__((address_space(3)))
#else
#define DFLASH_AS_DEVICE
#define DFLASH_AS_CONSTANT
#define DFLASH_AS_THREADGROUP
#endif

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
// The modes of a launch (bits of its flags).
enum Flags { kGarbage = 1, kSwitchOnShared = 2, kCheckSites = 4, kOsThreads = 8 };
enum class Wait { kRunnable, kBarrier, kSimd, kDone };

struct Fiber {
  Context context;
  uint index = 0;
  Wait wait = Wait::kRunnable;
};

// Where a collective is called from (kCheckSites).
struct Site {
  const char* file;
  unsigned line;
};

struct SimdGroup {
  int arrived = 0;
  int lanes = 32;
  int done = 0;           // kOsThreads: lanes that finished
  long generation = 0;    // kOsThreads: collectives completed
  const char* op = nullptr;  // the collective the lanes are in
  Site site{"", 0};
  alignas(8) unsigned char in[32][8];
  alignas(8) unsigned char out[32][8];
};

// One threadgroup's threadgroup memory: a block per declaration (keyed by its address).
struct Allocation {
  const void* key;
  std::unique_ptr<unsigned char[]> bytes;
};

struct Threadgroup {
  int flags = 0;
  uint n_threads = 0;
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simd;
  std::vector<Allocation> memory;
  Context scheduler;
  Fiber* current = nullptr;
  int barrier_arrived = 0;
  std::string error;
  std::function<void(uint)> body;
  // kOsThreads
  std::mutex mutex;
  std::condition_variable changed;
  long barrier_generation = 0;
  int done = 0;
};

inline thread_local Threadgroup* active = nullptr;
inline thread_local uint os_index = 0;  // kOsThreads: this OS thread's GPU thread

inline bool os_threads() { return (active->flags & kOsThreads) != 0; }
inline uint my_index() { return os_threads() ? os_index : active->current->index; }

// kOsThreads: unwinds a thread after an error.
struct Abort {};
const auto kStall = std::chrono::seconds(20);

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
  Threadgroup& tg = *active;
  switch_context(tg.current->context, tg.scheduler);
}

// Stop this thread for good after an error (kOsThreads: called with the mutex held).
[[noreturn]] inline void fail(const std::string& message) {
  Threadgroup& tg = *active;
  if (tg.error.empty()) {
    tg.error = message;
  }
  if (os_threads()) {
    tg.changed.notify_all();
    throw Abort{};
  }
  tg.current->wait = Wait::kDone;
  yield();
  std::abort();
}

// kOsThreads: wait (mutex held) until ready() or an error; a stall is an error.
template <typename Ready>
inline void os_wait(std::unique_lock<std::mutex>& lock, Ready ready) {
  Threadgroup& tg = *active;
  bool ok = tg.changed.wait_for(lock, kStall, [&] { return ready() || !tg.error.empty(); });
  if (!tg.error.empty()) throw Abort{};
  if (!ok) fail("threads stalled (deadlock): no progress for 20 s");
}

// A switch point before each access to threadgroup memory (kSwitchOnShared, fibers).
inline void shared_access() {
  Threadgroup* tg = active;
  if (tg != nullptr && (tg->flags & (kSwitchOnShared | kOsThreads)) == kSwitchOnShared) {
    yield();
  }
}

inline void barrier() {
  Threadgroup& tg = *active;
  if (os_threads()) {
    std::unique_lock<std::mutex> lock(tg.mutex);
    long generation = tg.barrier_generation;
    if (++tg.barrier_arrived + tg.done == static_cast<int>(tg.n_threads)) {
      if (tg.done > 0) fail("a barrier not reached by every thread (some finished)");
      tg.barrier_arrived = 0;
      tg.barrier_generation++;
      tg.changed.notify_all();
      return;
    }
    os_wait(lock, [&] { return tg.barrier_generation != generation; });
    return;
  }
  tg.current->wait = Wait::kBarrier;
  if (++tg.barrier_arrived == static_cast<int>(tg.fibers.size())) {
    tg.barrier_arrived = 0;
    for (Fiber& f : tg.fibers) {
      if (f.wait == Wait::kBarrier) f.wait = Wait::kRunnable;
    }
  }
  yield();
}

inline bool same_site(Site a, Site b) {
  return a.line == b.line && std::strcmp(a.file, b.file) == 0;
}

inline std::string where(const char* op, Site s) {
  return std::string(op) + " at " + s.file + ":" + std::to_string(s.line);
}

// A simdgroup collective: every lane brings a value, and once all lanes have, each gets
// combine(values, lanes, its lane).
template <typename T, typename Combine>
inline T collective(const char* op, Site site, T value, Combine combine) {
  static_assert(sizeof(T) <= 8, "collectives on values of up to 8 bytes");
  Threadgroup& tg = *active;
  const uint index = my_index();
  SimdGroup& g = tg.simd[index / 32];
  const uint lane = index % 32;
  std::unique_lock<std::mutex> lock(tg.mutex, std::defer_lock);
  if (os_threads()) lock.lock();
  if (g.arrived == 0) {
    g.op = op;
    g.site = site;
  } else if (std::strcmp(g.op, op) != 0) {
    fail(std::string("simdgroup lanes in different collectives: ") + where(g.op, g.site) +
         " and " + where(op, site));
  } else if ((tg.flags & kCheckSites) && !same_site(g.site, site)) {
    fail(std::string("simdgroup lanes in one collective from different call sites (divergent "
                     "on a GPU): ") + where(g.op, g.site) + " and " + where(op, site));
  }
  std::memcpy(g.in[lane], &value, sizeof(T));
  long generation = g.generation;
  bool last = ++g.arrived + g.done == g.lanes;
  if (last) {
    if (g.done > 0) fail(std::string("a collective not reached by every lane: ") + op);
    T values[32];
    for (int l = 0; l < g.lanes; l++) {
      std::memcpy(&values[l], g.in[l], sizeof(T));
    }
    for (int l = 0; l < g.lanes; l++) {
      T r = combine(values, g.lanes, l);
      std::memcpy(g.out[l], &r, sizeof(T));
    }
    g.arrived = 0;
    g.generation++;
  }
  if (os_threads()) {
    if (last) {
      tg.changed.notify_all();
    } else {
      os_wait(lock, [&] { return g.generation != generation; });
    }
  } else {
    Fiber& me = *tg.current;
    me.wait = Wait::kSimd;
    if (last) {
      uint first = (index / 32) * 32;
      for (int l = 0; l < g.lanes; l++) {
        tg.fibers[first + l].wait = Wait::kRunnable;
      }
    }
    yield();
  }
  T r;
  std::memcpy(&r, g.out[lane], sizeof(T));
  return r;
}

// The threadgroup's block for one DFLASH_THREADGROUP declaration: allocated by the first
// thread to reach it, so every thread of the threadgroup shares it.
template <typename T>
inline DFLASH_AS_THREADGROUP T* threadgroup_alloc(const void* key, size_t n) {
  Threadgroup& tg = *active;
  std::unique_lock<std::mutex> lock(tg.mutex, std::defer_lock);
  if (os_threads()) lock.lock();
  for (Allocation& a : tg.memory) {
    if (a.key == key) return (DFLASH_AS_THREADGROUP T*)(a.bytes.get());
  }
  const size_t size = n * sizeof(T);
  Allocation a{key, std::unique_ptr<unsigned char[]>(new unsigned char[size + 1])};
  if (!(tg.flags & kGarbage)) {
    std::memset(a.bytes.get(), 0, size);
  } else if (std::is_floating_point<T>::value) {
    const uint32_t nan = 0x7FC0A5A5u;  // a quiet NaN: arithmetic on it shows
    for (size_t i = 0; i + 4 <= size; i += 4) std::memcpy(a.bytes.get() + i, &nan, 4);
  } else {
    std::memset(a.bytes.get(), 0xA5, size);
  }
  tg.memory.push_back(std::move(a));
  return (DFLASH_AS_THREADGROUP T*)(tg.memory.back().bytes.get());
}

template <typename T>
struct TgPtr;

// An element of threadgroup memory: reads and writes are switch points (kSwitchOnShared), so
// a read-modify-write is not atomic, as on a GPU.
template <typename T>
struct TgRef {
  DFLASH_AS_THREADGROUP T* p;
  operator T() const {
    shared_access();
    return *p;
  }
  TgRef& operator=(const T& v) {
    shared_access();
    *p = v;
    return *this;
  }
  TgRef& operator=(const TgRef& other) { return *this = T(other); }
  TgRef& operator+=(const T& v) { return *this = T(*this) + v; }
  TgRef& operator-=(const T& v) { return *this = T(*this) - v; }
  TgPtr<T> operator&() const { return TgPtr<T>(p); }
};

// A pointer to threadgroup memory (tg_ptr<T>): only a threadgroup pointer converts to it (in
// the address-space mode; elsewhere any pointer does).
template <typename T>
struct TgPtr {
  DFLASH_AS_THREADGROUP T* p;
  TgPtr(DFLASH_AS_THREADGROUP T* q) : p(q) {}
  TgRef<T> operator[](size_t i) const { return TgRef<T>{p + i}; }
  TgRef<T> operator*() const { return TgRef<T>{p}; }
  TgPtr operator+(size_t i) const { return TgPtr(p + i); }
};

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
inline int pick_next(const Threadgroup& tg, Order order, std::mt19937_64& rng, size_t& cursor,
                     std::vector<int>& ready) {
  const size_t n = tg.fibers.size();
  auto runnable = [&](size_t i) { return tg.fibers[i].wait == Wait::kRunnable; };
  if (order == kShuffled) {
    ready.clear();
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

inline void setup(Threadgroup& tg, uint n_threads, int flags) {
  tg.flags = flags;
  tg.n_threads = n_threads;
  tg.simd.resize((n_threads + 31) / 32);
  for (size_t g = 0; g < tg.simd.size(); g++) {
    tg.simd[g].lanes = static_cast<int>(std::min<uint>(32, n_threads - 32 * g));
  }
}

// Runs `body(thread index)` for every thread of one threadgroup of n_threads threads.
inline std::string run_threadgroup(uint n_threads, Order order, uint64_t seed, int flags,
                                   std::vector<std::unique_ptr<char[]>>& stacks,
                                   size_t stack_size, std::function<void(uint)> body) {
  Threadgroup tg;
  setup(tg, n_threads, flags);
  tg.body = std::move(body);
  tg.fibers.resize(n_threads);
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
  std::vector<int> ready;
  while (tg.error.empty()) {
    int next = pick_next(tg, order, rng, cursor, ready);
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

// kOsThreads: one std::thread per GPU thread.
inline std::string run_threadgroup_os(uint n_threads, int flags,
                                      const std::function<void(uint)>& body) {
  Threadgroup tg;
  setup(tg, n_threads, flags);
  std::vector<std::thread> threads;
  threads.reserve(n_threads);
  for (uint i = 0; i < n_threads; i++) {
    threads.emplace_back([&tg, &body, i] {
      active = &tg;
      os_index = i;
      try {
        body(i);
      } catch (const Abort&) {
      }
      std::lock_guard<std::mutex> lock(tg.mutex);
      tg.done++;
      SimdGroup& g = tg.simd[i / 32];
      g.done++;
      if (tg.error.empty() && tg.barrier_arrived > 0 &&
          tg.barrier_arrived + tg.done == static_cast<int>(tg.n_threads)) {
        tg.error = "a barrier not reached by every thread (some finished)";
      }
      if (tg.error.empty() && g.arrived > 0 && g.arrived + g.done == g.lanes) {
        tg.error = std::string("a collective not reached by every lane: ") + g.op;
      }
      tg.changed.notify_all();
    });
  }
  for (std::thread& t : threads) t.join();
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
inline std::string launch(uint grid, uint group, Order order, uint64_t seed, int flags,
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
    std::string error = (flags & kOsThreads)
        ? run_threadgroup_os(group, flags, body)
        : run_threadgroup(group, order, seed + g, flags, stacks, stack_size, body);
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
// Both operands of one type, as Metal's overloads take them (an element of threadgroup
// memory reads as its value).
template <typename T>
struct plain {
  using type = T;
};
template <typename T>
struct plain<harness::TgRef<T>> {
  using type = T;
};
template <typename A, typename B>
inline typename plain<A>::type max(A a, B b) {
  using T = typename plain<A>::type;
  static_assert(std::is_same<T, typename plain<B>::type>::value, "max of two types");
  T x = a, y = b;
  return x > y ? x : y;
}
template <typename A, typename B>
inline typename plain<A>::type min(A a, B b) {
  using T = typename plain<A>::type;
  static_assert(std::is_same<T, typename plain<B>::type>::value, "min of two types");
  T x = a, y = b;
  return x < y ? x : y;
}

// Each collective records where it is called from (kCheckSites).
#define DFLASH_SITE const char *file = __builtin_FILE(), unsigned line = __builtin_LINE()
#define DFLASH_AT harness::Site{file, line}

// With DFLASH_HARNESS_SIMD_SKEW defined (a small number e), simdgroup g's float sums come out
// scaled by 1 + g * e: a GPU need not round a sum of the same values the same way in every
// simdgroup, and a kernel whose threads branch on such sums must still agree.
template <typename T>
inline T simd_sum(T v, DFLASH_SITE) {
  T s = harness::collective("simd_sum", DFLASH_AT, v, [](const T* x, int n, int) {
    T s = x[0];
    for (int l = 1; l < n; l++) s += x[l];
    return s;
  });
#ifdef DFLASH_HARNESS_SIMD_SKEW
  if constexpr (std::is_floating_point<T>::value) {
    s *= T(1) + T(DFLASH_HARNESS_SIMD_SKEW) * T(harness::my_index() / 32);
  }
#endif
  return s;
}

template <typename T>
inline T simd_max(T v, DFLASH_SITE) {
  return harness::collective("simd_max", DFLASH_AT, v, [](const T* x, int n, int) {
    T m = x[0];
    for (int l = 1; l < n; l++) m = x[l] > m ? x[l] : m;
    return m;
  });
}

template <typename T>
inline T simd_min(T v, DFLASH_SITE) {
  return harness::collective("simd_min", DFLASH_AT, v, [](const T* x, int n, int) {
    T m = x[0];
    for (int l = 1; l < n; l++) m = x[l] < m ? x[l] : m;
    return m;
  });
}

template <typename T>
inline T simd_prefix_exclusive_sum(T v, DFLASH_SITE) {
  return harness::collective("simd_prefix_exclusive_sum", DFLASH_AT, v, [](const T* x, int, int lane) {
    T s = T(0);
    for (int l = 0; l < lane; l++) s += x[l];
    return s;
  });
}

template <typename T>
inline T simd_prefix_inclusive_sum(T v, DFLASH_SITE) {
  return harness::collective("simd_prefix_inclusive_sum", DFLASH_AT, v, [](const T* x, int, int lane) {
    T s = x[0];
    for (int l = 1; l <= lane; l++) s += x[l];
    return s;
  });
}

template <typename T>
inline T simd_broadcast(T v, ushort from, DFLASH_SITE) {
  return harness::collective("simd_broadcast", DFLASH_AT, v,
                             [from](const T* x, int, int) { return x[from]; });
}

// Threadgroup atomics (relaxed): real atomics, for kOsThreads.
struct atomic_uint {
  uint value;
};
enum memory_order { memory_order_relaxed };

inline uint* atomic_word(harness::TgPtr<atomic_uint> a) {
  harness::shared_access();
  return &((atomic_uint*)(a.p))->value;
}
inline void atomic_store_explicit(harness::TgPtr<atomic_uint> a, uint v, memory_order) {
  __atomic_store_n(atomic_word(a), v, __ATOMIC_RELAXED);
}
inline uint atomic_load_explicit(harness::TgPtr<atomic_uint> a, memory_order) {
  return __atomic_load_n(atomic_word(a), __ATOMIC_RELAXED);
}
inline uint atomic_fetch_add_explicit(harness::TgPtr<atomic_uint> a, uint v, memory_order) {
  return __atomic_fetch_add(atomic_word(a), v, __ATOMIC_RELAXED);
}

}  // namespace metal

using namespace metal;

// Metal's address spaces: distinct with DFLASH_HARNESS_ADDRESS_SPACES, else erased. `thread`
// is C++'s own memory either way.
#define device DFLASH_AS_DEVICE
#define constant DFLASH_AS_CONSTANT
#define threadgroup DFLASH_AS_THREADGROUP
#define thread

// Threadgroup memory (see above); common.h defines both for Metal.
template <typename T>
using tg_ptr = harness::TgPtr<T>;
#define DFLASH_THREADGROUP(T, name, n)   \
  static const char name##_dflash_key = 0; \
  harness::TgPtr<T> name(harness::threadgroup_alloc<T>(&name##_dflash_key, n))
