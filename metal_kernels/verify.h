// The pieces of the lossless rejection step (verify_sample_*.metal), one row of target logits
// [P, V] at a time: the top-k filter, the softmax statistics, the target probability of a
// token, and the sample from the residual max(p - q, 0) by inverse CDF.
//
// p is softmax(x * inv_temperature) over the kept tokens (all of them without top-k), where x
// is the float value of a logit. The MLX path (mlx_dflash/kernels.py) computes the same
// function; comments name the rule each step shares with it.
#ifndef DFLASH_VERIFY_H
#define DFLASH_VERIFY_H

// Top-k keeps the tokens above the k-th largest value and, of the tokens equal to it, the
// lowest ids up to k in all (top_k_mask in kernels.py).
struct Filter {
  bool active;
  uint threshold;  // order_key of the k-th largest value
  uint last_tie;   // the highest id kept among the values equal to it
};

inline bool kept(float v, uint id, Filter f) {
  if (!f.active) {
    return true;
  }
  uint key = order_key(v);
  return key > f.threshold || (key == f.threshold && id <= f.last_tie);
}

// The k-th largest key, and which of the keys equal to it (in id order) is the k-th largest.
struct KthKey {
  uint key;
  uint rank_in_ties;  // 1-based
};

// A radix select, 4 bits a pass from the top: each pass counts the keys that share the digits
// chosen so far, per next digit, and keeps the digit where the k-th largest falls.
template <typename Ptr>
inline KthKey kth_largest_key(Ptr x, uint vocab, uint k, Layout tg,
                              tg_ptr<metal::atomic_uint> histogram) {
  uint prefix = 0;
  uint remaining = k;
  for (int shift = 28; shift >= 0; shift -= 4) {
    if (tg.tid < 16) {
      metal::atomic_store_explicit(&histogram[tg.tid], 0u, metal::memory_order_relaxed);
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    uint high = shift == 28 ? 0u : 0xFFFFFFFFu << (shift + 4);
    uint counts[16] = {0};
    for (uint i = tg.tid; i < vocab; i += tg.n_threads) {  // strided: coalesced reads
      uint key = order_key(float(x[i]));
      if ((key & high) == prefix) {
        counts[(key >> shift) & 15u]++;
      }
    }
    for (uint d = 0; d < 16; d++) {
      if (counts[d] > 0) {
        metal::atomic_fetch_add_explicit(&histogram[d], counts[d], metal::memory_order_relaxed);
      }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    uint digit = 15;
    uint n = metal::atomic_load_explicit(&histogram[digit], metal::memory_order_relaxed);
    while (digit > 0 && n < remaining) {
      remaining -= n;
      digit--;
      n = metal::atomic_load_explicit(&histogram[digit], metal::memory_order_relaxed);
    }
    prefix |= digit << shift;
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  }
  return KthKey{prefix, remaining};
}

template <typename Ptr>
inline Filter top_k_filter(Ptr x, uint vocab, uint top_k, Layout tg,
                           tg_ptr<metal::atomic_uint> histogram,
                           tg_ptr<uint> partials, tg_ptr<uint> shared_id) {
  Filter f{false, 0u, 0u};
  if (top_k == 0 || top_k >= vocab) {
    return f;
  }
  KthKey kth = kth_largest_key(x, vocab, top_k, tg, histogram);
  uint ties_kept = kth.rank_in_ties;
  f.threshold = kth.key;
  f.active = true;
  // The id of the ties_kept-th tie in id order: the thread whose chunk holds it publishes it.
  Chunk c = chunk_of(vocab, tg);
  uint ties = 0;
  for (uint i = c.lo; i < c.hi; i++) {
    ties += order_key(float(x[i])) == f.threshold ? 1u : 0u;
  }
  Scan<uint> s = threadgroup_scan(ties, tg, partials);
  if (s.before < ties_kept && ties_kept <= s.before + ties) {
    uint seen = s.before;
    for (uint i = c.lo; i < c.hi; i++) {
      if (order_key(float(x[i])) == f.threshold && ++seen == ties_kept) {
        *shared_id = i;
        break;
      }
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  f.last_tie = *shared_id;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return f;
}

// max and sum of exp(x * scale - max) over the kept tokens: p_i = exp(x_i * scale - max) / sum.
struct Softmax {
  float scale;
  float max;
  float sum;
};

template <typename Ptr>
inline Softmax softmax_stats(Ptr x, uint vocab, float scale, Filter f, Layout tg,
                             tg_ptr<float> partials) {
  // Strided (coalesced) reads: neither pass depends on the order of the tokens.
  float m = -INFINITY;
  for (uint i = tg.tid; i < vocab; i += tg.n_threads) {
    float v = float(x[i]);
    if (kept(v, i, f)) {
      m = metal::max(m, v * scale);
    }
  }
  m = threadgroup_max(m, tg, partials);
  float s = 0.0f;
  for (uint i = tg.tid; i < vocab; i += tg.n_threads) {
    float v = float(x[i]);
    if (kept(v, i, f)) {
      s += metal::exp(v * scale - m);
    }
  }
  return Softmax{scale, m, threadgroup_sum(s, tg, partials)};
}

inline float target_prob(float v, uint id, Softmax sm, Filter f) {
  return kept(v, id, f) ? metal::exp(v * sm.scale - sm.max) / sm.sum : 0.0f;
}

// The token from max(p - q, 0) (p itself when that has no mass: p == q), by inverse CDF with
// the uniform u: the first token whose cumulative weight exceeds u * total and whose own weight
// is positive; the last token of positive weight when rounding leaves none (sample_index in
// kernels.py). RowQ gives the proposal q_i of this row (zero for the bonus position).
template <typename Ptr, typename RowQ>
inline float residual_weight(Ptr x, uint i, Softmax sm, Filter f, thread const RowQ& q,
                             bool of_p) {
  float p = target_prob(float(x[i]), i, sm, f);
  return of_p ? p : metal::max(p - q.at(i), 0.0f);
}

template <typename Ptr, typename RowQ>
inline uint sample_residual(Ptr x, uint vocab, Softmax sm, Filter f, thread const RowQ& q,
                            float u, Layout tg, tg_ptr<float> f_partials,
                            tg_ptr<uint> u_partials) {
  Chunk c = chunk_of(vocab, tg);
  bool of_p = false;
  float mass = 0.0f;
  for (uint i = c.lo; i < c.hi; i++) {
    mass += residual_weight(x, i, sm, f, q, of_p);
  }
  Scan<float> s = threadgroup_scan(mass, tg, f_partials);
  if (!(s.total > 0.0f)) {  // the same total on every thread: a uniform branch
    of_p = true;
    mass = 0.0f;
    for (uint i = c.lo; i < c.hi; i++) {
      mass += residual_weight(x, i, sm, f, q, of_p);
    }
    s = threadgroup_scan(mass, tg, f_partials);
  }
  float target = u * s.total;
  float cumulative = s.before;
  uint hit = kNoIndex;
  uint last_positive = 0;  // id + 1; 0: none in this chunk
  for (uint i = c.lo; i < c.hi; i++) {
    float w = residual_weight(x, i, sm, f, q, of_p);
    if (w > 0.0f) {
      cumulative += w;
      last_positive = i + 1;
      if (cumulative > target) {
        hit = i;
        break;
      }
    }
  }
  hit = threadgroup_min(hit, tg, u_partials);
  last_positive = threadgroup_max(last_positive, tg, u_partials);
  if (hit != kNoIndex) {
    return hit;
  }
  // No positive weight at all (NaN logits): the last token, as sample_index gives.
  return last_positive > 0 ? last_positive - 1 : vocab - 1;
}

// A dense proposal row q [V] (draft_probs), or none (the bonus position).
template <typename Ptr>
struct DenseRow {
  Ptr probs;
  bool present;
  float at(uint i) const {
    return present ? float(probs[i]) : 0.0f;
  }
};

// A K-candidate proposal row: ids [K] (distinct) with probabilities [K], zero elsewhere. Only
// the candidates inside this thread's chunk are kept, so the residual costs little more than p.
template <int K>
struct CandidateRow {
  uint ids[K];
  float probs[K];
  uint n;
  float at(uint i) const {
    float q = 0.0f;
    for (uint c = 0; c < n; c++) {
      q += ids[c] == i ? probs[c] : 0.0f;
    }
    return q;
  }
};

template <int K, typename IdPtr, typename ProbPtr>
inline CandidateRow<K> candidate_row(IdPtr ids, ProbPtr probs, bool present, Chunk c) {
  CandidateRow<K> row;
  row.n = 0;
  for (uint k = 0; present && k < uint(K); k++) {
    uint id = ids[k];
    if (c.lo <= id && id < c.hi) {
      row.ids[row.n] = id;
      row.probs[row.n] = float(probs[k]);
      row.n++;
    }
  }
  return row;
}

// q of one token under a K-candidate proposal row.
template <int K, typename IdPtr, typename ProbPtr>
inline float candidate_prob(IdPtr ids, ProbPtr probs, uint token) {
  float q = 0.0f;
  for (uint k = 0; k < uint(K); k++) {
    q += ids[k] == token ? float(probs[k]) : 0.0f;
  }
  return q;
}

#endif  // DFLASH_VERIFY_H
