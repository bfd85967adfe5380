// path_select_sample: first [B, K], rest [B, n-1, K, K], uniforms [B, n], n_steps [],
// inv_temperature [] -> picks [B, n], probs [B, n, K]: at each position the proposal
// softmax(scores * inv_temperature) over the K candidates, and the pick sampled from it by
// inverse CDF with that position's uniform. One simdgroup (32 threads) per row; template: K.
const uint row = threadgroup_position_in_grid.x;
const uint lane = thread_index_in_simdgroup;
const uint steps = uint(n_steps);

uint pick = 0;
for (uint t = 0; t < steps; t++) {
  float z = step_score<K>(first, rest, row, steps, t, pick, lane) * inv_temperature;
  float top = metal::simd_max(z);
  float e = lane < uint(K) ? metal::exp(z - top) : 0.0f;
  float p = e / metal::simd_sum(e);
  if (lane < uint(K)) {
    probs[(size_t(row) * steps + t) * K + lane] = p;
  }
  pick = simd_sample(p, float(uniforms[row * steps + t]), lane, K - 1);
  if (lane == 0) {
    picks[row * steps + t] = pick;
  }
}
