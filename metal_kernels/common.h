// Helpers every mlx-dflash kernel shares: the threadgroup's layout, reductions and scans.
//
// This text is the start of each kernel's `header` for mx.fast.metal_kernel (after MLX's own
// preamble, which brings in metal_stdlib and `using namespace metal`). The test harness compiles
// the same text as C++ after metal_kernels/harness/metal_shim.h; so kernels spell Metal names
// with their namespace (metal::simd_sum), declare threadgroup arrays with
// DFLASH_THREADGROUP(T, name, n) and pass them as tg_ptr<T>: the harness turns these into
// storage its emulated threads share, accessed through a type it instruments.
//
// Every kernel runs one threadgroup per vocabulary row (the verify kernels: per row and
// position; path_select: per row), with a multiple of 32 threads (whole simdgroups).
#ifndef DFLASH_COMMON_H
#define DFLASH_COMMON_H

#ifndef DFLASH_THREADGROUP
#define DFLASH_THREADGROUP(T, name, n) threadgroup T name[n]
#endif
#ifndef DFLASH_HARNESS
template <typename T>
using tg_ptr = threadgroup T*;
#endif

// An index no element has: the identity of a min over ids.
static constant constexpr const uint kNoIndex = 0xFFFFFFFFu;
// Threadgroups have at most 1024 threads: 32 simdgroups.
static constant constexpr const int kMaxSimdgroups = 32;

// Where this thread sits in its threadgroup.
struct Layout {
  uint tid;
  uint n_threads;
  uint lane;
  uint simd_group;
  uint n_groups;
};

inline Layout make_layout(uint tid, uint n_threads, uint lane, uint simd_group) {
  return Layout{tid, n_threads, lane, simd_group, (n_threads + 31) / 32};
}

// The contiguous chunk [lo, hi) of n elements that a thread owns. Scans in index order (the
// inverse CDF, tie ranks) need each thread's elements to be contiguous.
struct Chunk {
  uint lo;
  uint hi;
};

inline Chunk chunk_of(uint n, Layout tg) {
  uint size = (n + tg.n_threads - 1) / tg.n_threads;
  uint lo = metal::min(tg.tid * size, n);
  return Chunk{lo, metal::min(lo + size, n)};
}

// Each reduction ends with a barrier: its partials are rewritten by the next one, and a
// simdgroup may not run ahead while another still reads them.

// The maximum is taken by every thread from the same partials in the same order (as the
// sum below), so every thread holds the same float.
inline float threadgroup_max(float v, Layout tg, tg_ptr<float> partials) {
  v = metal::simd_max(v);
  if (tg.lane == 0) {
    partials[tg.simd_group] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float top = -INFINITY;
  for (uint g = 0; g < tg.n_groups; g++) {
    top = metal::max(top, partials[g]);
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return top;
}

// A simd_sum of the partials per simdgroup need not give every simdgroup the same float.
inline float threadgroup_sum(float v, Layout tg, tg_ptr<float> partials) {
  v = metal::simd_sum(v);
  if (tg.lane == 0) {
    partials[tg.simd_group] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint g = 0; g < tg.n_groups; g++) {
    total += partials[g];
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return total;
}

inline uint threadgroup_min(uint v, Layout tg, tg_ptr<uint> partials) {
  v = metal::simd_min(v);
  if (tg.lane == 0) {
    partials[tg.simd_group] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  v = metal::simd_min(tg.lane < tg.n_groups ? partials[tg.lane] : kNoIndex);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return v;
}

inline uint threadgroup_max(uint v, Layout tg, tg_ptr<uint> partials) {
  v = metal::simd_max(v);
  if (tg.lane == 0) {
    partials[tg.simd_group] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  v = metal::simd_max(tg.lane < tg.n_groups ? partials[tg.lane] : 0u);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return v;
}

// A uint whose order is the float order, with -0 and +0 one value (as float comparisons are)
// and NaN above everything (as mx.argmax has it); 0 is below every float: "nothing seen".
inline uint order_key(float v) {
  uint bits = as_type<uint>(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN, by its bits: fast math may drop isnan
    return 0xFFFFFFFFu;
  }
  bits = as_type<uint>(v == 0.0f ? 0.0f : v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The id of the largest key, lowest id among equals (as mx.argmax). Each thread brings its own
// best (key, id), (0, kNoIndex) when it saw nothing. Integer keys: every simdgroup reduces the
// partials to the same id, so the threads that branch on it agree (a float max need not, and
// NaN has no order).
inline uint threadgroup_argmax(uint best_key, uint best_id, Layout tg, tg_ptr<uint> keys,
                               tg_ptr<uint> ids) {
  uint top = metal::simd_max(best_key);
  uint id = metal::simd_min(best_key == top ? best_id : kNoIndex);
  if (tg.lane == 0) {
    keys[tg.simd_group] = top;
    ids[tg.simd_group] = id;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  uint k = tg.lane < tg.n_groups ? keys[tg.lane] : 0u;
  uint i = tg.lane < tg.n_groups ? ids[tg.lane] : kNoIndex;
  top = metal::simd_max(k);
  id = metal::simd_min(k == top ? i : kNoIndex);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return id;
}

// A decision thread 0 makes, shared with the whole threadgroup: the threads branch on it, and
// a barrier that only some threads reach hangs the GPU.
inline bool threadgroup_decide(bool decision, Layout tg, tg_ptr<uint> shared) {
  if (tg.tid == 0) {
    *shared = decision ? 1u : 0u;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  bool d = *shared != 0u;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return d;
}

// An exclusive prefix sum over the threads in thread order, and the total.
template <typename T>
struct Scan {
  T before;
  T total;
};

template <typename T>
inline Scan<T> threadgroup_scan(T v, Layout tg, tg_ptr<T> partials) {
  T before = metal::simd_prefix_exclusive_sum(v);
  if (tg.lane == 31) {
    partials[tg.simd_group] = before + v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  T base = T(0);
  T total = T(0);
  for (uint g = 0; g < tg.n_groups; g++) {
    T s = partials[g];
    base += g < tg.simd_group ? s : T(0);
    total += s;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return Scan<T>{base + before, total};
}

#endif  // DFLASH_COMMON_H
