// The DFlash 2 selector walk (path_select_*.metal): one simdgroup per row, lane k holding
// candidate k (K <= 32). Step 0 scores the K candidates of position 1 from the anchor (first
// [K]); step t >= 1 reads the row of rest[t-1] [K, K] picked at step t-1.
#ifndef DFLASH_PATH_SELECT_H
#define DFLASH_PATH_SELECT_H

template <int K, typename FirstPtr, typename RestPtr>
inline float step_score(FirstPtr first, RestPtr rest, uint row, uint steps, uint t, uint pick,
                        uint lane) {
  if (lane >= uint(K)) {
    return -INFINITY;
  }
  if (t == 0) {
    return float(first[row * K + lane]);
  }
  return float(rest[((size_t(row) * (steps - 1) + t - 1) * K + pick) * K + lane]);
}

// The lowest lane holding the maximum, NaN above all (as mx.argmax): a lane always, so the next
// step's row index stays in bounds. Lanes past the K candidates bring -INFINITY.
inline uint simd_argmax(float v, uint lane) {
  uint key = order_key(v);
  uint top = metal::simd_max(key);
  return metal::simd_min(key == top ? lane : kNoIndex);
}

// Inverse CDF over the lanes' weights with the uniform u: the first lane whose cumulative
// weight exceeds u * total and whose own weight is positive, else the last positive lane, else
// (no positive weight: NaN scores) the last lane (sample_index in kernels.py). The total is the cumulative weight of the last lane, so that
// u < 1 always lands on a lane.
inline uint simd_sample(float w, float u, uint lane, uint last_lane) {
  float cumulative = metal::simd_prefix_inclusive_sum(w);
  float total = metal::simd_broadcast(cumulative, ushort(last_lane));
  uint hit = metal::simd_min(w > 0.0f && cumulative > u * total ? lane : kNoIndex);
  uint last = metal::simd_max(w > 0.0f ? lane + 1 : 0u);
  return hit != kNoIndex ? hit : last > 0 ? last - 1 : last_lane;
}

#endif  // DFLASH_PATH_SELECT_H
